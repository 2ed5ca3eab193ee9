#!/usr/bin/env python3
"""What a meshtune command costs from process start to exit, one of meshtune's garbage-collection choices against
its absence; the two sides alternate, run by run, and the report gives each side's median CPU and wall seconds with
their spread, and the median of the paired ratios.

- `--compare threshold` (default): meshtune's collection threshold for commands (`meshtune.cli.COMMAND_GC_THRESHOLD`)
  against Python's default one.
- `--compare freeze`: a run with the libraries' objects frozen while it trains
  (`meshtune.train.garbage_collection.libraries_frozen`) against one without.

    python3 bench/command_startup.py --config cfg.yaml --repeats 6            # `meshtune train cfg.yaml`
    python3 bench/command_startup.py --import-only --repeats 6               # importing the training code alone
    python3 bench/command_startup.py --config cfg.yaml --compare freeze      # give the config gc_interval: 50

The config should train a few steps in one process (nproc_per_node: 1): start-up then dominates, as it does for each
worker, launcher and test process of a tiny job. With `gc_interval` set, the one process collects at the start and
end of training as each torchrun worker does. Its output_dir is removed before every run, so each trains afresh.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

RUN = """
import contextlib, gc, sys
from meshtune import cli
if sys.argv[2] == "python-default":
    cli.COMMAND_GC_THRESHOLD = gc.get_threshold()
if sys.argv[2] == "unfrozen":
    from meshtune.train import loop
    loop.libraries_frozen = contextlib.nullcontext
raise SystemExit(cli.main(["train", sys.argv[1]]))
"""
IMPORT = """
import contextlib, sys
from meshtune import cli
with cli.rare_collections() if sys.argv[2] == "meshtune" else contextlib.nullcontext():
    import meshtune.train.loop
"""
SIDES = {"threshold": ("meshtune", "python-default"), "freeze": ("frozen", "unfrozen")}


def one_run(config: Path | None, side: str, output_dir: Path | None) -> dict:
    if output_dir is not None:
        shutil.rmtree(output_dir, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    code = IMPORT if config is None else RUN
    result = subprocess.run([sys.executable, "-c", code, str(config), side], capture_output=True, text=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        raise SystemExit(f"{side} run failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"side": side, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, help="a one-process training config: time `meshtune train` on it")
    what.add_argument("--import-only", action="store_true", help="time importing the training code alone")
    parser.add_argument("--compare", choices=sorted(SIDES), default="threshold",
                        help="threshold: meshtune's collection threshold against Python's; freeze: a run with the "
                             "libraries frozen against one without (--config only)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side, alternating (default 5)")
    parser.add_argument("--json", type=Path, help="also write every run and the summary here")
    args = parser.parse_args()
    if args.compare == "freeze" and args.import_only:
        parser.error("--compare freeze needs --config: freezing happens when a run trains")
    sides = SIDES[args.compare]
    output_dir = Path(yaml.safe_load(args.config.read_text())["output_dir"]) if args.config else None
    runs = []
    for _ in range(args.repeats):
        for side in sides:
            runs.append(one_run(args.config, side, output_dir))
            print(json.dumps(runs[-1]), flush=True)
    by_side = {side: [r for r in runs if r["side"] == side] for side in sides}
    ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(*by_side.values())]
    summary = {side: {"cpu_s": spread([r["cpu_s"] for r in rows]), "wall_s": spread([r["wall_s"] for r in rows])}
               for side, rows in by_side.items()}
    summary["cpu_ratio"] = spread(ratios)
    for side in sides:
        print(f"{side:15s} cpu {summary[side]['cpu_s']} s, wall {summary[side]['wall_s']} s (median, min-max)")
    print(f"cpu {sides[0]} / {sides[1]}, paired: {summary['cpu_ratio']}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
