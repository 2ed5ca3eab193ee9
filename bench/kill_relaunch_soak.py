"""Kill and relaunch the nodes of a 2-node job again and again, then check that it ended as an uninterrupted run.

Two `meshtune train CONFIG` launchers on 127.0.0.1 (NNODES=2, one NODE_RANK each, a free MASTER_PORT), as two
machines would run them. Each cycle waits U(--min-s, --max-s) seconds after the last relaunch, SIGKILLs one node's
whole tree (launcher, torchrun, workers: a dead machine), picked at random, and starts it again 1 s later with the
same command. Kills land anywhere: in a step, a save, a rendezvous. After the last cycle the job runs to its end.

What is measured: the longest stall (the longest time with neither a new step in metrics.jsonl nor a relaunch, until
the job ended), whether the final weights equal the reference run's (sha256 of final/'s safetensors), and whether
every checkpoint left verifies (`meshtune ckpt verify`). The reference is an uninterrupted run of the same config
(run here first, or `--reference OUTPUT_DIR`). Seeded: the same --seed kills the same nodes after the same waits.

    python bench/kill_relaunch_soak.py --config cfg.yaml --cycles 20 --seed 1 --workdir /tmp/soak

Prints one JSON object; exits 1 when a check failed or the job did not end within --timeout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import free_port, kill_tree  # noqa: E402

RELAUNCH_AFTER_S = 1.0  # a kill, then the operator's relaunch


class Node:
    def __init__(self, rank: int, config: Path, port: int, output: Path, log: Path, max_restarts: int):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "meshtune", "train", str(config), f"output_dir={output}",
                   f"max_restarts={max_restarts}"]
        self.rank, self.log = rank, log
        with log.open("a") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        kill_tree(self.process.pid)
        self.process.wait(timeout=60)


def steps_logged(output: Path) -> int:
    """Lines in metrics.jsonl: one a logged step, resumed steps logged again."""
    try:
        return sum(1 for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def final_begun(output: Path) -> bool:
    """Rank 0 writes final/ once every rank's part of the job is done: a node's workers may have exited by then."""
    return (output / "final").exists() or (output / "final.tmp").exists()


def final_weights(output: Path) -> dict[str, str]:
    files = sorted((output / "final").glob("*.safetensors"))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def run_job(config: Path, output: Path, logs: Path, cycles: int, rng: random.Random, min_s: float, max_s: float,
            max_restarts: int, timeout: float) -> dict:
    """The 2-node job under `cycles` kills; what happened, cycle by cycle, and the longest stall."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    starts = [0, 0]

    def start(rank: int) -> Node:
        starts[rank] += 1
        return Node(rank, config, port, output, logs / f"node{rank}-{starts[rank]}.log", max_restarts)

    nodes = [start(0), start(1)]
    began = time.monotonic()
    last_event, seen, longest, kills = began, 0, 0.0, []

    def watch(until: float) -> bool:
        """Poll progress until `until` (monotonic) or the job's end; True once both nodes have exited."""
        nonlocal last_event, seen, longest
        while time.monotonic() < until:
            if (count := steps_logged(output)) > seen:
                seen, last_event = count, time.monotonic()
            longest = max(longest, time.monotonic() - last_event)
            if all(node.process.poll() is not None for node in nodes):
                return True
            time.sleep(0.2)
        return False

    try:
        for cycle in range(1, cycles + 1):
            wait, victim = rng.uniform(min_s, max_s), rng.randrange(2)
            if watch(time.monotonic() + wait):
                break
            if any(node.process.poll() == 0 for node in nodes) or final_begun(output):
                break  # past its last step the job ends without the other node: a relaunched one would wait for it
            nodes[victim].kill()
            kills.append({"cycle": cycle, "node": victim, "after_s": round(wait, 1), "steps_logged": seen})
            time.sleep(RELAUNCH_AFTER_S)
            nodes[victim] = start(victim)
            last_event = time.monotonic()  # a relaunch: the time to come back starts here
        ended = watch(began + timeout)
        codes = [node.process.poll() for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node.process.pid)
    return {"kills": kills, "ended": ended, "exit_codes": codes, "longest_stall_s": round(longest, 1),
            "seconds": round(time.monotonic() - began, 1)}


# `meshtune ckpt verify` of each checkpoint named on the command line, in one process (one import of torch, not one
# a checkpoint): each verdict, its exit code, a JSON object on the last line; the command's own output on stderr
VERIFY_EACH = """
import contextlib, json, sys
from meshtune.cli import main
with contextlib.redirect_stdout(sys.stderr):
    codes = {path: main(["ckpt", "verify", path]) for path in sys.argv[1:]}
print(json.dumps(codes))
"""


def verify_checkpoints(output: Path) -> dict[str, bool]:
    checkpoints = [p for p in sorted(output.glob("checkpoint-*")) if not p.name.endswith(".tmp")]
    if not checkpoints:
        return {}
    result = subprocess.run([sys.executable, "-c", VERIFY_EACH, *map(str, checkpoints)], capture_output=True,
                            text=True, timeout=300)
    lines = result.stdout.strip().splitlines()
    codes = json.loads(lines[-1]) if result.returncode == 0 and lines else {}
    return {p.name: codes.get(str(p)) == 0 for p in checkpoints}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the job's YAML (output_dir is set here)")
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--min-s", type=float, default=3.0, help="shortest wait after a relaunch before a kill")
    parser.add_argument("--max-s", type=float, default=25.0, help="longest wait after a relaunch before a kill")
    parser.add_argument("--max-restarts", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the whole job may take")
    parser.add_argument("--reference", type=Path, help="output_dir of an uninterrupted run of the config")
    parser.add_argument("--max-stall-s", type=float, default=60, help="a longer stall fails the run")
    args = parser.parse_args(argv)

    reference = args.reference
    if reference is None:
        reference = args.workdir / "reference"
        plain = run_job(args.config, reference, args.workdir / "reference-logs", 0, random.Random(0), 0, 0,
                        args.max_restarts, args.timeout)
        if not plain["ended"] or plain["exit_codes"] != [0, 0]:
            print(json.dumps({"error": "the uninterrupted reference run failed", **plain}))
            return 1
    output = args.workdir / "output"
    report = run_job(args.config, output, args.workdir / "logs", args.cycles, random.Random(args.seed), args.min_s,
                     args.max_s, args.max_restarts, args.timeout)
    expected, got = final_weights(reference), final_weights(output) if (output / "final").exists() else {}
    report.update(cycles=len(report["kills"]), seed=args.seed, final_matches=bool(expected) and got == expected,
                  checkpoints_verified=verify_checkpoints(output))
    ok = (report["ended"] and report["exit_codes"] == [0, 0] and report["final_matches"]
          and all(report["checkpoints_verified"].values()) and report["longest_stall_s"] <= args.max_stall_s)
    print(json.dumps({"ok": ok, **report}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
