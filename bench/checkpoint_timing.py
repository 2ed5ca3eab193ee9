"""How long a checkpoint takes to save and to resume from, for a model size on N GPUs, sync and async.

For each --modes entry (sync: `async_save: false`; async: `async_save: true`) two `meshtune train` runs on one node
share a fresh output folder:
  1. --steps optimizer steps with `save_steps: --steps`, so the last step writes checkpoint-N. Its manifest.json
     records `save_seconds`: how long training was blocked by the save (sync: the whole write; async: the copy to
     host memory) and how long until it was published (every rank's shards written, fsynced and hashed, then the
     manifest, COMPLETE and the rename).
  2. the same job with one more step and no saving, which resumes from checkpoint-N. Its log line
     "resumed from ... (verified in A s, loaded in B s)" gives the checksum verification (every rank hashes a share
     of the files) and the DCP load onto this run's shards.
With --full-verify, `meshtune ckpt verify` then re-hashes every byte in one process, as an operator would.

The model is a random-init Qwen2.5 shape (bench/workspace.py), fully fine-tuned with meshtune's defaults (fp32
master weights and AdamW moments: 12 bytes a parameter of state), so a checkpoint of 7B holds about 91 GB. Each
mode's output folder is deleted after it is measured (--keep keeps it): two 7B checkpoints need 180 GB of disk.

  python3 bench/checkpoint_timing.py --size 7b --gpus 4 --modes sync,async --out results/checkpoints
On a CPU (the script's smoke test, gloo):
  python3 bench/checkpoint_timing.py --size tiny --gpus 2 --out /tmp/checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_two_agents import free_port, kill_node, start_node  # noqa: E402
from workspace import prepare_workspace  # noqa: E402

RESUMED = re.compile(r"resumed from \S+ at step (\d+) of \d+ \(verified in ([\d.]+) s, loaded in ([\d.]+) s\)")
MODES = {"sync": False, "async": True}


def job_config(args, work: Path, out_dir: Path, model_dir: Path, data_file: Path, async_save: bool,
               steps: int, save: bool) -> Path:
    values = dict(
        model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
        output_dir=str(out_dir), finetuning_type="full", per_device_train_batch_size=1, max_steps=steps,
        logging_steps=1, learning_rate=1e-5, gradient_checkpointing=True, cutoff_len=args.maxlen, seed=1,
        torch_compile=False, async_save=async_save, save_strategy="steps" if save else "no",
        save_steps=args.steps, save_final=False, preflight=False, rdzv_timeout=300, ddp_timeout=1800,
        resume_allow_changed=["max_steps"])  # the resume run goes one step further
    if args.parallel != "auto":
        values["parallel"] = args.parallel
    config = work / f"{out_dir.name}-{steps}.yaml"
    config.write_text(yaml.safe_dump(values))
    return config


def run(args, config: Path, log: Path) -> tuple[int | str, str, float]:
    """One `meshtune train` on --gpus processes: exit code, log text, wall seconds."""
    log.unlink(missing_ok=True)
    began = time.monotonic()
    node = start_node(0, config, free_port(), list(range(args.gpus)), log, nnodes=1)
    try:
        code: int | str = node.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        kill_node(node)
    return code, log.read_text() if log.exists() else "", time.monotonic() - began


def measure(args, work: Path, mode: str, model_dir: Path, data_file: Path) -> dict:
    out_dir = work / f"ckpt-{mode}"
    shutil.rmtree(out_dir, ignore_errors=True)
    row: dict = {"mode": mode, "size": args.size, "gpus": args.gpus, "problem": None}
    try:
        code, text, row["save_run_s"] = run(args, job_config(args, work, out_dir, model_dir, data_file,
                                                             MODES[mode], args.steps, save=True),
                                            work / f"{mode}-save.log")
        checkpoint = out_dir / f"checkpoint-{args.steps}"
        if code != 0 or not (checkpoint / "COMPLETE").exists():
            row["problem"] = f"save run: exit {code}: {text.strip().splitlines()[-1:]}"
            return row
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        size = sum(f["size"] for f in manifest["files"].values())
        row.update(checkpoint_gb=round(size / 1e9, 2), parallel=manifest.get("parallel"),
                   blocked_s=manifest["save_seconds"]["blocked_s"],
                   published_s=manifest["save_seconds"]["published_s"],
                   write_gb_per_s=round(size / 1e9 / manifest["save_seconds"]["published_s"], 2))
        code, text, row["resume_run_s"] = run(args, job_config(args, work, out_dir, model_dir, data_file,
                                                               MODES[mode], args.steps + 1, save=False),
                                              work / f"{mode}-resume.log")
        found = RESUMED.search(text)
        if code != 0 or not found or int(found.group(1)) != args.steps:
            row["problem"] = f"resume run: exit {code}, resumed: {found.group(0) if found else 'no'}"
            return row
        row.update(verified_s=float(found.group(2)), loaded_s=float(found.group(3)),
                   load_gb_per_s=round(size / 1e9 / max(float(found.group(3)), 1e-3), 2))
        if args.full_verify:
            began = time.monotonic()
            verify = subprocess.run([sys.executable, "-m", "meshtune", "ckpt", "verify", str(checkpoint)],
                                    capture_output=True, text=True, timeout=args.run_timeout)
            row["full_verify_s"] = round(time.monotonic() - began, 1)
            if verify.returncode:
                row["problem"] = f"ckpt verify: exit {verify.returncode}: {verify.stdout[-300:]}{verify.stderr[-300:]}"
        return row
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)


def report(rows: list[dict]) -> str:
    lines = ["| mode | checkpoint | training blocked | published | write | resume: verified | loaded | load |"
             " one-process verify |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["problem"]:
            lines.append(f"| {r['mode']} | not measured: {r['problem']} |||||||||")
            continue
        lines.append(f"| {r['mode']} | {r['checkpoint_gb']} GB | {r['blocked_s']:.1f} s | {r['published_s']:.1f} s | "
                     f"{r['write_gb_per_s']} GB/s | {r['verified_s']:.1f} s | {r['loaded_s']:.1f} s | "
                     f"{r['load_gb_per_s']} GB/s | {r.get('full_verify_s', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="7b", help="a bench/workspace.py shape: tiny, 0.5b, 1.5b, 7b, ...")
    p.add_argument("--gpus", type=int, default=4, help="processes of the one node (GPUs; on a CPU, gloo processes)")
    p.add_argument("--parallel", default="auto", help="meshtune's parallel key (auto: what the plan picks)")
    p.add_argument("--modes", default="sync,async", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=2, help="steps before the checkpoint (the resume run adds one)")
    p.add_argument("--maxlen", type=int, default=512, help="sample length (every sample: maxlen/2..maxlen tokens)")
    p.add_argument("--full-verify", action="store_true", help="also time `meshtune ckpt verify` (one process)")
    p.add_argument("--keep", action="store_true", help="keep each mode's output folder")
    p.add_argument("--run-timeout", type=int, default=900)
    p.add_argument("--work", default="/tmp/meshtune-checkpoint-timing")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, data_file = prepare_workspace(args.size, work, args.gpus * (args.steps + 2), args.maxlen // 2,
                                             args.maxlen)
    rows = []
    for mode in args.modes.split(","):
        rows.append(measure(args, work, mode, model_dir, data_file))
        print(json.dumps(rows[-1]), flush=True)
        (out / "checkpoint_timing.json").write_text(json.dumps(rows, indent=1))
    table = report(rows)
    (out / "checkpoint_timing.md").write_text(table + "\n")
    print("\n" + table)
    if any(r["problem"] for r in rows):
        raise SystemExit("checkpoint_timing.py: " + "; ".join(f"{r['mode']}: {r['problem']}" for r in rows
                                                              if r["problem"]))


if __name__ == "__main__":
    main()
