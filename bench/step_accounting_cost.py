"""What meshtune's straggler accounting and hang watchdog cost a training step, measured on this machine's GPUs.

Per optimizer step the loop adds: the step clock (two perf_counter reads), CUDA events around its two line-up
collectives, six notes of where it is for the watchdog, and the watchdog's step mark; per logging interval, the
events' readout and one all-gather of two numbers per rank. Timing a whole training run with and without them
cannot resolve this (runs of one checkout differ by several percent); so this times the same collectives with and
without the accounting, alternating, in one process group, and relates the difference to the step time of real
runs (`step_s` of their metrics.jsonl, e.g. speed_table.py's rows run in the same call).

  python3 bench/step_accounting_cost.py --gpus 2 --metrics /tmp/meshtune-bench/runs/*/output/metrics.jsonl

On a CPU (gloo, a smoke test): python3 bench/step_accounting_cost.py --gpus 2 --device cpu --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(steps: int, logging_steps: int, rounds: int) -> dict:
    """In each worker: the same step-shaped collectives with and without the accounting, alternating."""
    import torch
    import torch.distributed as dist

    from meshtune.distributed import all_reduce_sum, init_distributed
    from meshtune.train.hang_watchdog import HangWatchdog, enable_flight_recorder, flight_record, flight_record_entries
    from meshtune.train.stragglers import Place, StepTimes

    enable_flight_recorder()
    env = init_distributed(120)
    places = [Place(0, socket.gethostname())] * env.world_size  # the reports' names only
    counts = torch.zeros(4, dtype=torch.float64, device=env.device)
    loss = torch.zeros((), dtype=torch.float64, device=env.device)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)

    def plain() -> float:
        sync()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            all_reduce_sum(counts)
            all_reduce_sum(loss)
            if step % logging_steps == 0:
                float(loss)  # the record reads its numbers: the GPU is waited for here in either case
        sync()
        return time.perf_counter() - started

    def accounted() -> float:
        times = StepTimes(env, places, threshold=0.15, intervals=3)
        watch = HangWatchdog(0, 600, Path("."), env, places)  # the loop's calls; its thread is not started
        sync()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            times.begin()
            watch.at(step, "preparing the batch")
            watch.at(step, "counting the step's tokens (all-reduce)")
            times.line_up(lambda: all_reduce_sum(counts))
            watch.at(step, "forward and backward, with the gradient reduction")
            watch.at(step, "gradient clipping and optimizer step")
            watch.at(step, "summing the step's loss (all-reduce)")
            times.line_up(lambda: all_reduce_sum(loss))
            times.end()
            if step % logging_steps == 0:
                float(loss)
                watch.at(step, "comparing step times (all-gather)")
                times.interval()
            watch.step_done()
        sync()
        return time.perf_counter() - started

    plain(), accounted()  # warm-up: NCCL's first collectives, the events' first use
    with_s, without_s = [], []
    for _ in range(rounds):
        without_s.append(plain())
        with_s.append(accounted())
    result = {"rank": env.rank, "world_size": env.world_size, "device": str(env.device),
              "plain_s": without_s, "accounted_s": with_s,
              "cost_us_per_step": (statistics.median(with_s) - statistics.median(without_s)) / steps * 1e6}
    if env.rank == 0:
        result["flight_recorder"] = flight_record(flight_record_entries(), last=5)
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, result)
    dist.destroy_process_group()
    return gathered


def step_times(paths: list[str]) -> dict[str, float]:
    """The median `step_s` of each run's records after the first two (compile and warm-up)."""
    found = {}
    for path in paths:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        values = [r["step_s"] for r in records[2:] if "step_s" in r]
        if values:
            found[path] = statistics.median(values)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="processes (one per GPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=2000, help="steps per timed round")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind, alternating")
    p.add_argument("--metrics", nargs="*", default=[], help="metrics.jsonl of real runs: cost as a share of their step")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="step_accounting_cost.json goes here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        gathered = measure(args.steps, args.logging_steps, args.rounds)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out, "step_accounting_cost.json").write_text(json.dumps(gathered, indent=1))
        return 0

    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               __file__, "--worker", "--steps", str(args.steps), "--logging-steps", str(args.logging_steps),
               "--rounds", str(args.rounds), "--out", args.out]
    subprocess.run(command, env=env, check=True, timeout=600)
    gathered = json.loads(Path(args.out, "step_accounting_cost.json").read_text())
    cost = max(r["cost_us_per_step"] for r in gathered)
    print(f"{gathered[0]['world_size']} processes on {gathered[0]['device']}: "
          f"the accounting costs {cost:.1f} µs a step "
          f"(the slowest rank; medians of {args.rounds} rounds of {args.steps} steps, logging every "
          f"{args.logging_steps})")
    for r in gathered:
        print(f"  rank {r['rank']}: without {statistics.median(r['plain_s']):.4f} s, with "
              f"{statistics.median(r['accounted_s']):.4f} s per round; {r['cost_us_per_step']:.1f} µs a step")
    for path, seconds in step_times(args.metrics).items():
        print(f"  {path}: step {seconds * 1000:.1f} ms -> accounting {cost / 1e6 / seconds:.3%} of it")
    if gathered[0].get("flight_recorder"):
        print(gathered[0]["flight_recorder"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
