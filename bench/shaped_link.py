"""What a job moves between nodes, and what that costs it, on a real network link this machine shapes.

Each "node" is a network namespace of its own running `meshtune train CFG` as on a cluster node (NNODES, NODE_RANK,
MASTER_ADDR = node 0's address, gloo on the node's own interface through GLOO_SOCKET_IFNAME and local_addr). Two
nodes are joined by one veth pair; four hang off a bridge (bench/network_namespaces.py). tc's token-bucket filter
(tbf) on every end shapes each node's link to --rate each way (netem is not needed, nor used).

Per optimizer step it reports:
- the bytes that crossed the node boundary: each node's interface counters (/sys/class/net/IF/statistics, read by
  a sampler inside the node's namespace), taken each time rank 0 appends a step's record to metrics.jsonl, so the
  start-up traffic (rendezvous, preflight, the weights' broadcast) and the final save fall outside every step. Bytes
  are frames as the interface counts them (Ethernet, IP and TCP headers in, the peer's acknowledgements in the
  other direction);
- the step time (metrics.jsonl's own interval: tokens / tokens_per_s);
- the exposed share: 1 - (the step on an unshaped link) / (the step on the shaped one), the share of the step spent
  waiting for the link, with --unshaped (the same job again on the same namespaces, the qdiscs removed) or
  --interleave (one job, its steps on the shaped and the unshaped link in turn: on a machine shared with other work
  the load changes less between two neighbouring steps than between two jobs).

Each --variant is a name and overrides of the config (`ddp:parallel=ddp`, `lora-bf16:finetuning_type=lora,
grad_reduce_dtype=bf16`); the variants run in turn, --repeats times (alternating, so a change in the machine's load
spreads over all of them), the median and spread of each reported. The config's output_dir, max_steps,
logging_steps, saves and the launch keys are set by the tool. Without CFG, --size builds a random-init model and
synthetic samples (bench/workspace.py) and a config for them.

Needs root and iproute2 (ip, tc). Every namespace is deleted at the end, on Ctrl-C and on a failure.

  python bench/shaped_link.py --size tiny --variant ddp:parallel=ddp --steps 3 --rate 1gbit
  python bench/shaped_link.py --size 512x8 --nproc-per-node 2 --rate 1gbit --unshaped --repeats 3 \\
      --variant ddp:parallel=ddp --variant zero3:parallel=zero3 --out results/shaped_link
  python bench/shaped_link.py --size 512x8 --rate 1gbit --unshaped --variant ddp:parallel=ddp \\
      --variant pp2:pipeline_parallel=2,gradient_accumulation_steps=2   (a stage a node: only activations cross)
  python bench/shaped_link.py --merge results/a.json results/b.json --out results/shaped_link   (one report)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from network_namespaces import NetworkNamespaces, unavailable  # noqa: E402
from processes import free_port, kill_tree  # noqa: E402

PORT_PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
SAMPLE_EVERY_S = 0.005
START_TIMEOUT_S = 300


def sample(link: str, metrics: Path, out: Path) -> None:
    """Inside a node's namespace: each time metrics.jsonl gains a line, the interface's byte counters then (one
    JSON line to `out`: records, tx, rx, time); until the parent ends this process."""
    stats = Path("/sys/class/net") / link / "statistics"
    tx, rx = stats / "tx_bytes", stats / "rx_bytes"
    try:  # a sample taken late moves the next step's first bytes into this one: run ahead of the job's processes
        os.nice(-15)
    except OSError:
        pass
    seen, size = -1, -1
    with out.open("a") as f:
        while True:
            try:
                grown = os.stat(metrics).st_size
                lines = metrics.read_bytes().count(b"\n") if grown != size else seen
            except FileNotFoundError:
                grown, lines = -1, 0
            size = grown
            if lines != seen:
                seen = lines
                f.write(json.dumps({"records": lines, "tx": int(tx.read_text()), "rx": int(rx.read_text()),
                                    "t": time.time()}) + "\n")
                f.flush()
            time.sleep(SAMPLE_EVERY_S)


def variant(text: str) -> tuple[str, dict]:
    """`name:key=value,key=value` (values read as YAML)."""
    name, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--variant {text}: {item!r} is not key=value")
        overrides[key.strip()] = yaml.safe_load(value)
    return name, overrides


def job_config(base: dict, overrides: dict, output: Path, steps: int) -> dict:
    return {**base, **overrides, "output_dir": str(output), "max_steps": steps, "logging_steps": 1,
            "save_steps": 0, "save_strategy": "no", "save_final": False, "plot_loss": False, "eval_strategy": "no",
            "report_to": [], "preflight": False}  # the doctor's meeting is start-up, outside every step


def wait_for_port(spaces: NetworkNamespaces, port: int, node0: subprocess.Popen, timeout: float) -> None:
    """Until node 0's rendezvous store answers, probed from node 1's namespace."""
    deadline = time.monotonic() + timeout
    while subprocess.run([*spaces.prefix(1), sys.executable, "-c", PORT_PROBE, spaces.addresses[0], str(port)],
                         capture_output=True).returncode:
        if node0.poll() is not None:
            raise RuntimeError(f"node 0 ended (code {node0.returncode}) before its store answered on port {port}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"node 0's store did not answer on {spaces.addresses[0]}:{port} in {timeout:.0f} s")
        time.sleep(0.2)


def run_job(spaces: NetworkNamespaces, config: dict, work: Path, per_node: int, timeout: float,
            shape_step: Callable[[bool], None] | None = None) -> dict:
    """One job across the namespaces: every node's launcher and sampler, until all launchers end. `shape_step`:
    called as each step's record appears, with whether the next step runs on the shaped link (even steps do)."""
    work.mkdir(parents=True)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    metrics = Path(config["output_dir"]) / "metrics.jsonl"
    port = free_port()
    processes: list[subprocess.Popen] = []
    launchers: list[subprocess.Popen] = []
    try:
        for rank, (link, address) in enumerate(zip(spaces.links, spaces.addresses)):
            processes.append(subprocess.Popen(
                [*spaces.prefix(rank), sys.executable, __file__, "--sample", link, str(metrics),
                 str(work / f"counters{rank}.jsonl")]))
        for rank, (link, address) in enumerate(zip(spaces.links, spaces.addresses)):
            env = {**os.environ, "NNODES": str(len(spaces.names)), "NODE_RANK": str(rank),
                   "MASTER_ADDR": spaces.addresses[0], "MASTER_PORT": str(port), "NPROC_PER_NODE": str(per_node),
                   "GLOO_SOCKET_IFNAME": link, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with (work / f"node{rank}.log").open("w") as log:
                launcher = subprocess.Popen([*spaces.prefix(rank), sys.executable, "-m", "meshtune", "train",
                                             str(cfg_path), f"local_addr={address}"], stdout=log,
                                            stderr=subprocess.STDOUT, env=env)
            processes.append(launcher)
            launchers.append(launcher)
            if rank == 0:
                wait_for_port(spaces, port, launcher, START_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        records = 0
        while shape_step is not None and any(launcher.poll() is None for launcher in launchers):
            lines = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
            if lines != records:
                records = lines
                shape_step((records + 1) % 2 == 0)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("meshtune train", timeout)
            time.sleep(SAMPLE_EVERY_S)
        for rank, launcher in enumerate(launchers):
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
            if launcher.returncode:
                raise RuntimeError(f"node {rank} exited {launcher.returncode}:\n"
                                   + (work / f"node{rank}.log").read_text()[-3000:])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the job did not end in {timeout:.0f} s; logs in {work}") from None
    finally:
        for process in processes:
            kill_tree(process.pid)
            process.wait(timeout=30)
    return step_figures(metrics, [work / f"counters{rank}.jsonl" for rank in range(len(spaces.names))])


def step_figures(metrics: Path, counters: list[Path], parity: int | None = None) -> dict:
    """Per timed step (each record but the first, whose step starts with the job): its seconds and the bytes each
    node sent and received between the record before it and its own. `parity`: only the even (0) or odd (1)
    steps."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    by_node = []
    for path in counters:
        at = {}
        for line in path.read_text().splitlines():
            sample_ = json.loads(line)
            at.setdefault(sample_["records"], sample_)
        by_node.append(at)
    steps = []
    for index, record in enumerate(records[1:], start=2):
        if not all(index in at and index - 1 in at for at in by_node) or (
                parity is not None and record["step"] % 2 != parity):
            continue
        tx = [at[index]["tx"] - at[index - 1]["tx"] for at in by_node]
        rx = [at[index]["rx"] - at[index - 1]["rx"] for at in by_node]
        steps.append({"step": record["step"], "step_s": record["tokens"] / record["tokens_per_s"],
                      "loss": record.get("loss"), "tx_per_node": tx, "rx_per_node": rx, "crossed": sum(tx)})
    if not steps:
        raise RuntimeError(f"{metrics}: no timed step (run more than one step)")
    return {"steps": steps, "step_s": statistics.median(s["step_s"] for s in steps),
            "crossed": statistics.median(s["crossed"] for s in steps),
            "tx_per_node": statistics.median(statistics.mean(s["tx_per_node"]) for s in steps),
            "losses": [r.get("loss") for r in records]}


def build_workspace(size: str, root: Path, tokens_per_row: int, samples: int) -> dict:
    """A random-init model of `size` and synthetic samples of `tokens_per_row` tokens each, with the config keys
    that train on them."""
    from workspace import prepare_workspace

    model_dir, data = prepare_workspace(size, root / "workspace", samples, tokens_per_row, tokens_per_row)
    return {"model_name_or_path": str(model_dir), "dataset": str(data), "cutoff_len": tokens_per_row,
            "tokenized_path": str(root / "workspace" / "tokenized"), "finetuning_type": "full",
            "learning_rate": 1e-4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "rdzv_timeout": 120, "ddp_timeout": 300, "max_restarts": 0, "seed": 1}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summary(name: str, runs: list[dict], unshaped: list[dict]) -> dict:
    row = {"variant": name, "crossed": spread([r["crossed"] for r in runs]),
           "tx_per_node": spread([r["tx_per_node"] for r in runs]), "step_s": spread([r["step_s"] for r in runs])}
    if unshaped:
        row["unshaped_step_s"] = spread([r["step_s"] for r in unshaped])
        row["exposed"] = spread([1 - u["step_s"] / r["step_s"] for r, u in zip(runs, unshaped)])
    return row


def markdown(rows: list[dict], rate: str) -> list[str]:
    lines = [f"| variant | crossed MB a step (all nodes) | MB a node | step s at {rate} | step s unshaped | "
             "exposed |", "|---|---|---|---|---|---|"]
    for row in rows:
        def span(key, scale=1.0, fmt=".2f", unit=""):
            v = row.get(key)
            if v is None:
                return "n/a"
            text = f"{v['median'] * scale:{fmt}}{unit}"
            return text if len(v["runs"]) < 2 else \
                f"{text} ({v['min'] * scale:{fmt}}–{v['max'] * scale:{fmt}}{unit})"
        lines.append(f"| {row['variant']} | {span('crossed', 1e-6, '.1f')} | {span('tx_per_node', 1e-6, '.1f')} | "
                     f"{span('step_s')} | {span('unshaped_step_s')} | {span('exposed', 100, '.0f', '%')} |")
    return lines


def merge(paths: list[Path], out: Path | None) -> int:
    """Earlier reports' runs as one report: each variant's runs in the order of `paths`, its rows recomputed."""
    reports = [json.loads(path.read_text()) for path in paths]
    first = reports[0]
    for path, report in zip(paths, reports):
        if (report["nodes"], report["nproc_per_node"], report["rate"]) != (first["nodes"], first["nproc_per_node"],
                                                                          first["rate"]):
            raise SystemExit(f"{path}: another link or layout than {paths[0]}")
    variants, runs = {}, {}
    for report in reports:
        for name, overrides in report["variants"].items():
            if variants.setdefault(name, overrides) != overrides:
                raise SystemExit(f"variant {name}: other overrides in another report")
            for kind in ("shaped", "unshaped"):
                runs.setdefault(name, {"shaped": [], "unshaped": []})[kind] += report["runs"][name][kind]
    rows = [summary(name, runs[name]["shaped"], runs[name]["unshaped"]) for name in variants]
    merged = {**first, "repeats": None, "merged_from": [str(p) for p in paths], "variants": variants, "rows": rows,
              "runs": runs}
    table = "\n".join(markdown(rows, first["rate"]))
    print(table)
    if out:
        out.with_suffix(".json").write_text(json.dumps(merged, indent=1))
        out.with_suffix(".md").write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", type=Path, help="a meshtune config (else --size builds one)")
    p.add_argument("--size", help="without CONFIG: a bench/workspace.py model size (tiny, 512x8, ...)")
    p.add_argument("--tokens-per-row", type=int, default=256, help="--size: tokens in each synthetic sample")
    p.add_argument("--variant", type=variant, action="append", default=[],
                   help="NAME:key=value,... overrides of the config; repeat for more (default: the config as is)")
    p.add_argument("--nodes", type=int, choices=(2, 4), default=2)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--rate", default="1gbit", help="each node's link, each way (tc's units: 1gbit, 400mbit)")
    p.add_argument("--burst", default="256kb", help="the token bucket (at least 64kb: one GSO packet)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps a job; the first is not timed")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating")
    p.add_argument("--unshaped", action="store_true",
                   help="also run each job with the link unshaped, for the exposed share")
    p.add_argument("--interleave", action="store_true",
                   help="one job a variant, its even steps on the shaped link and its odd ones unshaped: the pairs of "
                        "steps next to each other see the same load of the machine (use an odd --steps)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a job may take")
    p.add_argument("--tag", default="sl", help="prefix of the namespaces' and interfaces' names")
    p.add_argument("--work", type=Path, default=Path("results/shaped_link_work"))
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="no job: the runs of earlier reports (same link and layout) as one report, in --out")
    p.add_argument("--sample", nargs=3, metavar=("LINK", "METRICS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sample:
        sample(args.sample[0], Path(args.sample[1]), Path(args.sample[2]))
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    if args.steps < 2:
        p.error("--steps: at least 2 (the first step is not timed)")
    why = unavailable()
    if why:
        print(f"shaped_link: {why}", file=sys.stderr)
        return 2
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.config:
        base = yaml.safe_load(args.config.read_text())
    elif args.size:
        rows = args.steps * 2 * args.nproc_per_node * args.nodes * 2
        base = build_workspace(args.size, args.work, args.tokens_per_row, rows)
    else:
        p.error("give CONFIG or --size")
    variants = args.variant or [("config", {})]
    spaces = NetworkNamespaces(args.tag, args.nodes)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces go in `finally` also then
    results: dict[str, dict[str, list]] = {name: {"shaped": [], "unshaped": []} for name, _ in variants}
    try:
        spaces.create()
        run = 0
        for repeat in range(args.repeats):
            for name, overrides in variants:
                if args.interleave:
                    run += 1
                    work = args.work / f"run{run:03d}-{name}-interleaved"
                    config = job_config(base, overrides, work / "output", args.steps)
                    spaces.unshape()  # the first step, not timed
                    run_job(spaces, config, work, args.nproc_per_node, args.timeout,
                            lambda shaped: spaces.shape(args.rate, args.burst) if shaped else spaces.unshape())
                    counters = [work / f"counters{rank}.jsonl" for rank in range(args.nodes)]
                    for kind, parity in (("shaped", 0), ("unshaped", 1)):
                        figures = step_figures(work / "output" / "metrics.jsonl", counters, parity)
                        results[name][kind].append(figures)
                        print(f"{name} {kind} steps #{repeat + 1}: step {figures['step_s']:.3f} s, "
                              f"{figures['crossed'] / 1e6:.2f} MB crossed a step", flush=True)
                    continue
                for shaped in (True, False) if args.unshaped else (True,):
                    if shaped:
                        spaces.shape(args.rate, args.burst)
                    else:
                        spaces.unshape()
                    run += 1
                    work = args.work / f"run{run:03d}-{name}-{'shaped' if shaped else 'unshaped'}"
                    config = job_config(base, overrides, work / "output", args.steps)
                    figures = run_job(spaces, config, work, args.nproc_per_node, args.timeout)
                    results[name]["shaped" if shaped else "unshaped"].append(figures)
                    print(f"{name} {'shaped' if shaped else 'unshaped'} #{repeat + 1}: step {figures['step_s']:.3f} s, "
                          f"{figures['crossed'] / 1e6:.2f} MB crossed a step", flush=True)
    finally:
        spaces.delete()
        signal.signal(signal.SIGTERM, previous)
    rows = [summary(name, results[name]["shaped"], results[name]["unshaped"]) for name, _ in variants]
    report = {"namespaces": spaces.names + ([spaces.switch] if spaces.switch else []), "nodes": args.nodes,
              "nproc_per_node": args.nproc_per_node, "rate": args.rate, "burst": args.burst,
              "steps": args.steps, "repeats": args.repeats, "base_config": base,
              "variants": {name: overrides for name, overrides in variants}, "rows": rows, "runs": results}
    table = "\n".join(markdown(rows, args.rate))
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
