"""A 2-node job simulated on one GPU host: two `meshtune train` launchers (each a torchrun agent) joined over NCCL.

Recovery (default): each parallel mode trains once uninterrupted, then once with one node killed (agent and
workers, SIGKILL) after a checkpoint and started again with the same command. Prints whether the job resumed and
how far its losses are from the uninterrupted run's.

  python bench/gpu_two_agents.py --modes zero2,hsdp --gpus-per-node 2 --out results      (4 GPUs)

Hang (--fault hang): instead of a kill, rank 1 stops itself with SIGSTOP two steps after the checkpoint, and the
job must recover by itself: the hang watchdog's reports (stacks, the NCCL flight recorder) and summary are copied to
--out, and the losses are compared with the uninterrupted run's. The faulted run also starts with
`preflight: bandwidth` (the doctor's NCCL all-reduce between the two nodes), whose table goes to --out too.

  python bench/gpu_two_agents.py --fault hang --modes zero2 --gpus-per-node 1 --steps 40 --save-steps 10

Speed across the two nodes: bench/two_node_speed.py.

Every job starts from an empty output folder and fresh logs, so a second invocation on the same --work measures
a new run rather than resuming the last one's checkpoints. A job that trained no tokens, or resumed where it
should have started afresh, fails the script (exit code 1) after its table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import free_port, kill_tree  # noqa: E402
from workspace import prepare_workspace  # noqa: E402


def kill_node(process: subprocess.Popen) -> None:
    kill_tree(process.pid)
    process.wait()


def start_node(rank: int, config: Path, port: int, gpus: list[int], log: Path, extra_env: dict | None = None,
               nnodes: int = 2) -> subprocess.Popen:
    # both "nodes" share this host's cores: one intra-op thread a process unless the caller says otherwise, as
    # torchrun gives the one-node layout's processes (a thread a core each oversubscribes them, and OpenMP's
    # spinning threads then stall the CPU collectives for seconds a step)
    env = {"OMP_NUM_THREADS": "1", **os.environ, **(extra_env or {}), "NNODES": str(nnodes), "NODE_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "NPROC_PER_NODE": str(len(gpus)), "NCCL_NVLS_ENABLE": "0",
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONUNBUFFERED": "1"}
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def fresh(out_dir: Path, logs: list[Path]) -> None:
    """An empty output folder and no logs: a job must not resume, or read the metrics and log lines of, an
    earlier invocation's job of the same name (the logs are appended to, by both starts of a killed node)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    for log in logs:
        log.unlink(missing_ok=True)


def problem(records: list[dict], log_text: str, expect_resume: bool) -> str | None:
    """Why a job's figures are not a fresh run's: no tokens trained, a resume where none was due, or none where
    the restarted node should have resumed."""
    if not sum(r.get("tokens", 0) for r in records):
        return "trained 0 tokens"
    # every line about resuming but the run plan's resume_from_checkpoint row, which every log holds
    resumed = [line.strip() for line in log_text.splitlines()
               if "resum" in line.lower() and "resume_from_checkpoint" not in line]
    if resumed and not expect_resume:
        return f"resumed instead of starting afresh: {resumed[0][:200]}"
    if expect_resume and not any("resumed from" in line for line in resumed):
        return "the restarted node did not resume from the checkpoint"
    return None


def run_job(config: Path, out_dir: Path, gpus_per_node: int, work: Path, kill_at: int | None,
            extra_env: dict | None = None, expect_resume: bool = False) -> dict:
    port = free_port()
    gpus = [list(range(0, gpus_per_node)), list(range(gpus_per_node, 2 * gpus_per_node))]
    logs = [work / f"{out_dir.name}-node{r}.log" for r in (0, 1)]
    fresh(out_dir, logs)
    started = time.monotonic()
    nodes = [start_node(0, config, port, gpus[0], logs[0], extra_env)]
    time.sleep(2)
    nodes.append(start_node(1, config, port, gpus[1], logs[1], extra_env))
    killed_after = None
    if kill_at:
        while not (out_dir / f"checkpoint-{kill_at}" / "COMPLETE").exists():
            if nodes[0].poll() is not None or time.monotonic() - started > 400:
                raise SystemExit(f"no checkpoint-{kill_at}:\n{logs[0].read_text()[-3000:]}")
            time.sleep(0.05)
        kill_node(nodes[1])
        killed_after = round(time.monotonic() - started, 1)
        finished_before_kill = (out_dir / "final").exists()
        time.sleep(3)
        nodes[1] = start_node(1, config, port, gpus[1], logs[1])
    codes = [node.wait(timeout=480) for node in nodes]
    text = logs[0].read_text() + logs[1].read_text()
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [line for line in text.splitlines() if "resumed from" in line]
    result = {"exit_codes": codes, "wall_s": round(time.monotonic() - started, 1), "steps": records[-1]["step"],
              "losses": [r["loss"] for r in records], "resumed": resumed[-1] if resumed else None,
              "tokens_per_s_last": records[-1]["tokens_per_s"], "peak_gib": records[-1]["peak_mem_gib"],
              "problem": problem(records, text, expect_resume=bool(kill_at) or expect_resume)}
    if kill_at:
        result.update(killed_after_s=killed_after, finished_before_kill=finished_before_kill)
    return result


def hang_report(out_dir: Path, keep: Path) -> dict:
    """The watchdog's folder of a hung run, copied to `keep`: whether its summary named the stopped rank and its
    reports hold NCCL flight-recorder entries."""
    folders = sorted(out_dir.glob("hang-*"))
    if not folders:
        return {"problem": "no hang report was written"}
    shutil.copytree(folders[-1], keep, dirs_exist_ok=True)
    summary = (folders[-1] / "summary.txt").read_text() if (folders[-1] / "summary.txt").exists() else ""
    reports = "".join(p.read_text() for p in folders[-1].glob("rank*.txt"))
    return {
        "hang_folder": folders[-1].name,
        "summary_names_rank_1": "rank 1 " in summary and "did not report" in summary,
        "flight_recorder_entries": reports.count("nccl:"),
    }


def fail_on_problems(problems: dict[str, str | None]) -> None:
    """Exit code 1, naming each job whose figures are not a fresh run's: a report must not pass for a measurement."""
    bad = {job: why for job, why in problems.items() if why}
    if bad:
        raise SystemExit("gpu_two_agents.py: " + "; ".join(f"{job}: {why}" for job, why in bad.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="zero2,hsdp")
    p.add_argument("--size", default="0.5b")
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-steps", type=int, default=40)
    p.add_argument("--fault", choices=["kill", "hang"], default="kill",
                   help="recovery from: node 1 killed after a checkpoint, or rank 1 stopped (SIGSTOP) after it")
    p.add_argument("--hang-timeout", type=int, default=20, help="--fault hang: the job's hang_timeout")
    p.add_argument("--work", default="/tmp/meshtune-two-agents")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    work = Path(args.work)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model_dir, data_file = prepare_workspace(args.size, work, 4 * args.steps * 2, 128, 1024)
    summary = {}
    faulted = "killed" if args.fault == "kill" else "hung"
    for mode in args.modes.split(","):
        for label in ("uninterrupted", faulted):
            out_dir = work / f"{mode}-{label}"
            config = work / f"{mode}-{label}.yaml"
            values = dict(
                model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
                output_dir=str(out_dir), finetuning_type="full", parallel=mode, per_device_train_batch_size=2,
                gradient_accumulation_steps=1, max_steps=args.steps, save_steps=args.save_steps, save_total_limit=2,
                logging_steps=1, learning_rate=1e-5, gradient_checkpointing=True, cutoff_len=1024, seed=1,
                rdzv_timeout=120, ddp_timeout=300)
            kill_at, env = None, None
            if label == "killed":
                kill_at = args.save_steps
            elif label == "hung":
                values.update(hang_timeout=args.hang_timeout, preflight="bandwidth")
                env = {"MESHTUNE_FAULT": f"stop:{args.save_steps + 2}:1"}
            config.write_text(yaml.safe_dump(values))
            summary[f"{mode}/{label}"] = run_job(config, out_dir, args.gpus_per_node, work, kill_at, env,
                                                 expect_resume=label == "hung")
            if label == "hung":
                summary[f"{mode}/{label}"].update(hang_report(out_dir, Path(args.out) / f"{mode}-hang"))
            row = {k: v for k, v in summary[f"{mode}/{label}"].items() if k != "losses"}
            print(mode, label, json.dumps(row), flush=True)
        base, hit = summary[f"{mode}/uninterrupted"]["losses"], summary[f"{mode}/{faulted}"]["losses"]
        diffs = [abs(a - b) / abs(b) for a, b in zip(hit, base)]
        print(f"{mode}: {faulted} run vs uninterrupted: {len(hit)} vs {len(base)} steps, max relative loss difference "
              f"{max(diffs):.2e} (first {args.save_steps} steps {max(diffs[:args.save_steps]):.2e}), "
              f"final loss {hit[-1]:.4f} vs {base[-1]:.4f}", flush=True)
    Path(args.out, "two_agents.json").write_text(json.dumps(summary, indent=1))
    for log in [*work.glob("*killed*.log"), *work.glob("*hung*.log")]:
        (Path(args.out) / log.name).write_text(log.read_text()[-20000:])
    fail_on_problems({job: result["problem"] for job, result in summary.items()})


if __name__ == "__main__":
    main()
