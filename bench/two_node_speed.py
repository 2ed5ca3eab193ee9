"""Two nodes simulated on one GPU host, for speed: per-GPU tokens/s of a job across a network boundary, beside the
same GPUs as one node.

The stand-in. Two `meshtune train` launchers (each a torchrun agent) split the host's GPUs, and each gives its
processes its own NCCL_HOSTID: NCCL then sees two hosts, so inside a "node" the GPUs talk over NVLink (P2P) and
between the nodes over TCP sockets (NET/Socket), as on a cluster with an Ethernet network between its nodes. Every
two-node run sets NCCL_DEBUG=INFO and the table counts the transports NCCL's own log names (`via P2P/...`,
`via NET/Socket/...`), so a run that did not cross the boundary as intended shows it.

  python bench/two_node_speed.py --jobs full-1.5b,lora-7b --gpus-per-node 2 --repeats 3 --out results   (4 GPUs)

For each job: the layouts in --layouts (default: two nodes, then one node with all the GPUs), each --repeats
times, alternating, at --global-batch sequences an optimizer step (the accumulation follows). Every run starts
from an empty output folder, with `parallel: auto` unless --modes says otherwise, so each layout runs the mode
meshtune picks for it (one node: zero2 for full fine-tuning; two nodes: hsdp, sharded inside each node). Before
the jobs, `meshtune doctor --bandwidth` measures the link between the two nodes for each --links setting:

  default  NCCL's own socket settings
  fast     more sockets and threads per connection (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = 4 x 4)

A layout named two-nodes runs once per link setting. The report (two_node_speed.json and .md in --out) gives
tokens/s per GPU as the median of the rounds with the lowest and highest, and the two-node runs' share of the
one-node figure, median and spread of the rounds' own ratios. `bench/scaling_model.py` predicts these figures
from the one-node step and the measured link.

Other layouts: sockets (two nodes with every byte on sockets, NVLink and shared memory off inside a node too: the
slowest network) and one-node. On a CPU machine the script runs the tiny job (gloo; no NCCL transports):
  python bench/two_node_speed.py --jobs lora-tiny --gpus-per-node 1 --steps 7 --global-batch 4 --links default
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_two_agents import fresh, free_port, kill_node, problem, start_node  # noqa: E402
from workspace import WARMUP, prepare_workspace, timed_records, timing_problem  # noqa: E402

JOBS = {"full-1.5b": ("1.5b", "full", 8), "lora-1.5b": ("1.5b", "lora", 8), "full-7b": ("7b", "full", 4),
        "lora-7b": ("7b", "lora", 4), "lora-tiny": ("tiny", "lora", 2)}  # size, method, batch a GPU; tiny: CPU
LINKS = {"default": {}, "fast": {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}}
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
LAYOUTS = ("two-nodes", "sockets", "one-node")
TRANSPORT = re.compile(r"via (NET/\w+|P2P/[\w/]+|SHM/[\w/]+)")


def node_env(rank: int, link: str, layout: str) -> dict:
    """What a two-node layout gives node `rank`'s launcher (its workers inherit it)."""
    env = {"NCCL_HOSTID": f"meshtune-node{rank}", "NCCL_DEBUG": "INFO", **LINKS[link]}
    if layout == "sockets":
        env.update(SOCKETS)
    return env


def transports(log_text: str) -> dict[str, int]:
    """NCCL's connections by transport, as its INFO lines name them (`Channel 00/0 : 0[0] -> 2[2] via NET/Socket/0`):
    which links the job's collectives used."""
    counts: dict[str, int] = {}
    for match in TRANSPORT.finditer(log_text):
        kind = match.group(1).split("/")[0] + "/" + match.group(1).split("/")[1]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def accumulation_for(global_batch: int, bs: int, gpus: int) -> int:
    """Micro-steps that make the global batch with `bs` sequences a GPU on `gpus` GPUs, or ValueError."""
    if global_batch % (bs * gpus):
        raise ValueError(f"--global-batch {global_batch} is not a multiple of {bs} sequences a GPU x {gpus} GPUs")
    return global_batch // (bs * gpus)


def job_config(args, work: Path, job: str, mode: str, out_dir: Path, model_dir: Path, data_file: Path) -> Path:
    """The job's config: the same for every layout, so only the network differs."""
    size, method, bs = JOBS[job]
    config = out_dir.with_suffix(".yaml")
    values = dict(
        model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / size / "tokenized"),
        output_dir=str(out_dir), finetuning_type=method, lora_rank=64, lora_alpha=16, lora_target="all",
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=accumulation_for(args.global_batch, bs, 2 * args.gpus_per_node),
        max_steps=args.steps, logging_steps=args.logging_steps, learning_rate=1e-5, gradient_checkpointing=True,
        cutoff_len=1024, seed=1, rdzv_timeout=180, ddp_timeout=600, resume_from_checkpoint="none", save_final=False,
        preflight=False)  # the link is measured once, by the doctor, before the jobs
    if mode != "auto":
        values["parallel"] = mode
    values.update(args.set)
    config.write_text(yaml.safe_dump(values))
    return config


def run_layout(args, work: Path, config: Path, out_dir: Path, layout: str, link: str) -> tuple[list, list, str]:
    """One job in one layout: exit codes, metrics records and the logs' text."""
    port, per_node = free_port(), args.gpus_per_node
    if layout == "one-node":
        logs = [work / f"{out_dir.name}.log"]
        fresh(out_dir, logs)
        nodes = [start_node(0, config, port, list(range(2 * per_node)), logs[0], nnodes=1)]
    else:
        logs = [work / f"{out_dir.name}-node{r}.log" for r in (0, 1)]
        fresh(out_dir, logs)
        gpus = [list(range(per_node)), list(range(per_node, 2 * per_node))]
        nodes = [start_node(r, config, port, gpus[r], logs[r], node_env(r, link, layout)) for r in (0, 1)]
    try:
        codes = [node.wait(timeout=args.job_timeout) for node in nodes]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
    finally:
        for node in nodes:
            kill_node(node)
    metrics = out_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return codes, records, "".join(log.read_text() for log in logs if log.exists())


def measure_link(args, work: Path, link: str, config: Path) -> dict:
    """`meshtune doctor --bandwidth` on the two nodes (one process a node, NCCL across the boundary): the largest
    all-reduce's bus bandwidth and the latency, from node 0's JSON report."""
    port, report = free_port(), work / f"doctor-{link}.json"
    report.unlink(missing_ok=True)
    logs = [work / f"doctor-{link}-node{r}.log" for r in (0, 1)]
    for log in logs:
        log.unlink(missing_ok=True)
    nodes = []
    for rank in (0, 1):
        env = {**os.environ, **node_env(rank, link, "two-nodes"), "NNODES": "2", "NODE_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NPROC_PER_NODE": str(args.gpus_per_node),
               "NCCL_NVLS_ENABLE": "0", "CUDA_VISIBLE_DEVICES": ",".join(
                   str(rank * args.gpus_per_node + i) for i in range(args.gpus_per_node)), "PYTHONUNBUFFERED": "1"}
        extra = ["--json", str(report)] if rank == 0 else []
        with logs[rank].open("w") as out:
            nodes.append(subprocess.Popen([sys.executable, "-m", "meshtune", "doctor", str(config), "--bandwidth",
                                           "--timeout", "120", *extra], stdout=out, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
    finally:
        for node in nodes:
            kill_node(node)
    text = logs[0].read_text() if logs[0].exists() else ""
    result = {"link": link, "exit_codes": codes, "transports": transports(text + (
        logs[1].read_text() if logs[1].exists() else ""))}
    if report.exists():
        measured = (json.loads(report.read_text()).get("bandwidth") or {}).get("result") or {}
        sizes = measured.get("all_reduce") or []
        if sizes:
            largest = max(sizes, key=lambda r: r["bytes"])
            result.update(busbw_gbs=round(largest["busbw"] / 1e9, 3), at_bytes=largest["bytes"],
                          latency_us=round(min(r["seconds"] for r in sizes) * 1e6, 1))
    if "busbw_gbs" not in result:
        result["problem"] = f"no bandwidth in the doctor's report: {text.strip().splitlines()[-1:] or 'no output'}"
    Path(args.out, f"doctor-{link}.txt").write_text(text[-20000:])
    return result


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})" if len(values) > 1 else \
        f"{values[0]:,.0f}"


def report(rows: list[dict], links: list[dict]) -> str:
    """Per job, mode and layout: tokens/s per GPU (median, lowest–highest) and the two-node layouts' share of the
    one-node figure: median of the medians' ratio, and the spread of the rounds' own ratios."""
    lines = ["| link | all-reduce busbw GB/s (largest size) | latency µs | transports |", "|---|---|---|---|"]
    for link in links:
        lines.append(f"| {link['link']} | {link.get('busbw_gbs', link.get('problem'))} | {link.get('latency_us', '')} "
                     f"| {link.get('transports')} |")
    lines += ["", "| job | mode | layout | link | rounds | tokens/s a GPU | step s | of one node | transports |",
              "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["job"], row["mode"], row["layout"], row["link"]), []).append(row)
    for (job, mode, layout, link), runs in groups.items():
        done = [r for r in runs if "per_gpu" in r]
        if not done:
            lines.append(f"| {job} | {mode} | {layout} | {link} | {len(runs)} | failed: {runs[0]['problem']} | | | |")
            continue
        base = [r for r in groups.get((job, mode, "one-node", ""), []) if "per_gpu" in r]
        share = ""
        if layout != "one-node" and base:
            ratio = statistics.median(r["per_gpu"] for r in done) / statistics.median(r["per_gpu"] for r in base)
            by_round = {r["round"]: r["per_gpu"] for r in base}
            paired = [r["per_gpu"] / by_round[r["round"]] for r in done if r["round"] in by_round]
            share = f"{ratio:.1%}" + (f" ({min(paired):.1%}–{max(paired):.1%})" if len(paired) > 1 else "")
        seen = sorted({k for r in done for k in r.get("transports", {})})
        lines.append(f"| {job} | {done[0].get('parallel', mode)} | {layout} | {link} | {len(done)} | "
                     f"{median_spread([r['per_gpu'] for r in done])} | "
                     f"{statistics.median(r['step_s'] for r in done):.3f} | {share} | {', '.join(seen)} |")
    return "\n".join(lines)


def parallel_of(log_text: str) -> str | None:
    """The parallel mode the run plan printed."""
    found = re.search(r"^\s*parallel\s+(\w+)", log_text, re.MULTILINE)
    return found.group(1) if found else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="full-1.5b,lora-7b", help=f"comma list of {', '.join(JOBS)}")
    p.add_argument("--modes", default="auto", help="comma list of auto, ddp, zero2, zero3, hsdp")
    p.add_argument("--layouts", default="two-nodes,one-node", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--links", default="default,fast",
                   help=f"two-node socket settings: comma list of {', '.join(LINKS)}")
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=64, help="sequences an optimizer step (accumulation follows)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps a run, the first --warmup not timed")
    p.add_argument("--warmup", type=int, default=2 * WARMUP,
                   help=f"steps not timed (default {2 * WARMUP}): compilation, first allocations, cache warm-up")
    p.add_argument("--logging-steps", type=int, default=WARMUP, choices=[1, WARMUP])
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every layout once, alternating")
    p.add_argument("--no-bandwidth", dest="bandwidth", action="store_false", help="skip the doctor's link test")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a meshtune config key for every run (values as YAML), e.g. --set grad_reduce_dtype=bf16")
    p.add_argument("--job-timeout", type=int, default=420)
    p.add_argument("--work", default="/tmp/meshtune-two-node-speed")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    try:
        args.set = dict((key.strip(), yaml.safe_load(value))
                        for key, value in (item.split("=", 1) for item in args.set))
    except ValueError:
        p.error(f"--set takes KEY=VALUE, not {args.set}")
    for name, values, allowed in (("--jobs", args.jobs, JOBS), ("--layouts", args.layouts, LAYOUTS),
                                  ("--links", args.links, LINKS)):
        unknown = [v for v in values.split(",") if v not in allowed]
        if unknown:
            p.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    if wrong := timing_problem(args.steps, args.warmup, args.logging_steps):
        p.error(wrong)
    for job in args.jobs.split(","):
        try:
            accumulation_for(args.global_batch, JOBS[job][2], 2 * args.gpus_per_node)
        except ValueError as error:
            p.error(f"{job}: {error}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows, links = [], []

    def save() -> None:
        Path(args.out, "two_node_speed.json").write_text(json.dumps({"links": links, "runs": rows}, indent=1))

    for job in args.jobs.split(","):
        size, _, bs = JOBS[job]
        samples = args.global_batch * (args.steps + WARMUP)
        model_dir, data_file = prepare_workspace(size, work / size, samples, 128, 1024)
        if args.bandwidth and not links and "two-nodes" in args.layouts:
            probe = job_config(args, work, job, "auto", work / "doctor-out", model_dir, data_file)
            for link in args.links.split(","):
                links.append(measure_link(args, work, link, probe))
                print(json.dumps(links[-1]), flush=True)
                save()
        for round_ in range(args.repeats):
            for mode in args.modes.split(","):
                for layout in args.layouts.split(","):
                    for link in (args.links.split(",") if layout == "two-nodes" else [""]):
                        out_dir = work / f"{job}-{mode}-{layout}{'-' + link if link else ''}"
                        config = job_config(args, work, job, mode, out_dir, model_dir, data_file)
                        started = time.monotonic()
                        codes, records, text = run_layout(args, work, config, out_dir, layout, link or "default")
                        failed = codes != [0] * len(codes)
                        row = dict(job=job, mode=mode, layout=layout, link=link, round=round_, exit_codes=codes,
                                   parallel=parallel_of(text), wall_s=round(time.monotonic() - started),
                                   transports=transports(text),
                                   problem=f"exit codes {codes}: {text.strip().splitlines()[-1:]}" if failed
                                   else problem(records, text, expect_resume=False))
                        timed, seconds = timed_records(records, args.warmup)
                        if timed and not row["problem"]:
                            gpus = 2 * args.gpus_per_node
                            tokens_per_s = sum(r["tokens"] for r in timed) / seconds
                            row.update(step_s=round(seconds / (timed[-1]["step"] - args.warmup), 4),
                                       tokens_per_s=round(tokens_per_s), per_gpu=round(tokens_per_s / gpus),
                                       peak_gib=max(r["peak_mem_gib"] for r in records),
                                       tokens_per_step=round(sum(r["tokens"] for r in timed) /
                                                             (timed[-1]["step"] - args.warmup)))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        save()
    table = report(rows, links)
    Path(args.out, "two_node_speed.md").write_text(table + "\n")
    print("\n" + table)
    bad = [f"{r['job']} {r['layout']} {r['link']} round {r['round']}: {r['problem']}" for r in rows if r["problem"]]
    bad += [f"doctor {link['link']}: {link['problem']}" for link in links if link.get("problem")]
    if bad:
        raise SystemExit("two_node_speed.py: " + "; ".join(bad))


if __name__ == "__main__":
    main()
