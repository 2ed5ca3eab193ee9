"""Save and resume through an object store beside the same on local disk, for a model shape.

The model is a random-init Qwen2.5 shape (bench/workspace.py: --size 1.5b is Qwen2.5-1.5B's layers with its
151,936-id vocabulary and an untied head, 1.78B parameters; --size 1.5b-tied is Qwen2.5-1.5B as published, its head
its embedding, 1.54B), fully fine-tuned with AdamW, so a checkpoint holds
the fp32 weights and both moments (12 bytes a parameter: about 21 GB at 1.5b); with --master-weights bf16
(`master_weights: bf16`) the weights and moments are bf16 (6 bytes a parameter: about 11 GB at 1.5b). For each
location (`local`:
checkpoints in output_dir on this machine's disk; `store`: `checkpoint_dir` in the object store at --store, or in
a local S3 server this script starts, moto's server mode on 127.0.0.1) two `meshtune train` runs:
  1. --steps optimizer steps, the last one saving checkpoint-N. Its manifest.json records `save_seconds`: how long
     training was blocked (the copy to host memory: both locations save in the background here, as a store always
     does) and how long until it was published (shards written, read back and hashed by every rank, then the
     manifest and COMPLETE; on disk also the rename).
  2. one more step, resuming from checkpoint-N; for the store on a fresh output_dir, as a new node would. Its log
     line "resumed from ... (verified in A s, loaded in B s)" gives the verification (on disk: every rank hashes a
     share of the files; from the store: each rank fetches a share of the objects into the node's copy and hashes
     it there) and the DCP load (from the store: of that copy).
The table gives seconds and GB/s (checkpoint bytes / seconds) for each: training blocked by the save, the save
published, the resume (verified + loaded). The JSON beside it keeps every figure.

Disk: at most about two checkpoints at once (45 GB at 1.5b; 23 GB in bf16): the local run's is deleted once
measured, then the store holds one (moto keeps large objects in temporary files, under TMPDIR) while the resume
makes its node-local copy. Host memory: the checkpointed state copied there for the background save (DCP's
staging), beside, on a CPU, the training state itself: at 1.5b on CPU about 29 GB while a step runs (16 bytes a
parameter) and 43 GB while the save uploads (the state and its copy), so 64 GB of RAM; in bf16 14 and 21 GB, so 32
GB. On GPUs the state stays there and the host holds the copy (21 GB at 1.5b; 11 in bf16). Output folders and the
store's prefix are deleted once measured (--keep keeps them).

  python3 bench/object_store_checkpoint.py --size 1.5b --nproc 4 --out results/object-store
  python3 bench/object_store_checkpoint.py --size 1.5b --master-weights bf16 --out results/object-store-bf16
  python3 bench/object_store_checkpoint.py --size tiny --out /tmp/object-store          # on a CPU
  python3 bench/object_store_checkpoint.py --size 0.5b --store s3://bucket/bench --out /tmp/object-store
With --store the store's own client settings apply (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...).
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
from processes import kill_tree  # noqa: E402
from s3_server import S3Server  # noqa: E402
from workspace import SIZES, prepare_workspace  # noqa: E402

RESUMED = re.compile(r"resumed from \S+ at step (\d+) of \d+ \(verified in ([\d.]+) s, loaded in ([\d.]+) s\)")


def job_config(args, work: Path, name: str, output_dir: Path, checkpoint_dir: str | None, model_dir: Path,
               data_file: Path, steps: int, save: bool) -> Path:
    values = dict(
        model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
        output_dir=str(output_dir), finetuning_type="full", per_device_train_batch_size=1, max_steps=steps,
        logging_steps=1, learning_rate=1e-5, cutoff_len=args.maxlen, seed=1, torch_compile=False, async_save=True,
        save_strategy="steps" if save else "no", save_steps=args.steps, save_final=False, plot_loss=False,
        preflight=False, ddp_timeout=1800, master_weights=args.master_weights,
        resume_allow_changed=["max_steps"])  # the resume run goes one step further
    if checkpoint_dir:
        values["checkpoint_dir"] = checkpoint_dir
    config = work / f"{name}-{steps}.yaml"
    config.write_text(yaml.safe_dump(values))
    return config


def run(args, config: Path, log: Path, env: dict) -> tuple[int | str, str, float]:
    """One `meshtune train` on --nproc processes: exit code, log text, wall seconds."""
    began = time.monotonic()
    environ = {**os.environ, **env, "NPROC_PER_NODE": str(args.nproc), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(config)], stdout=out,
                                   stderr=subprocess.STDOUT, env=environ)
    try:
        code: int | str = process.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        kill_tree(process.pid)
    return code, log.read_text(), time.monotonic() - began


def manifest_of(where: str, step: int) -> dict:
    from meshtune.checkpoint import read_manifest
    from meshtune.checkpoint.object_store import location

    return read_manifest(location(where) / f"checkpoint-{step}")


def measure(args, work: Path, name: str, store: str | None, model_dir: Path, data_file: Path, env: dict) -> dict:
    first, again = work / f"{name}-out", work / f"{name}-out-fresh"
    for folder in (first, again):
        shutil.rmtree(folder, ignore_errors=True)
    row: dict = {"location": name, "size": args.size, "nproc": args.nproc, "parameters": parameters(model_dir),
                 "master_weights": args.master_weights, "problem": None}
    code, text, row["save_run_s"] = run(args, job_config(args, work, name, first, store, model_dir, data_file,
                                                         args.steps, save=True), work / f"{name}-save.log", env)
    if code != 0:
        row["problem"] = f"save run exited {code}: {text[-1500:]}"
        return row
    manifest = manifest_of(store or str(first), args.steps)
    row["checkpoint_bytes"] = sum(f["size"] for f in manifest["files"].values())
    row.update(manifest["save_seconds"])
    resume_dir = again if store else first  # a store resumes on a fresh output_dir, as on new nodes
    code, text, row["resume_run_s"] = run(args, job_config(args, work, name, resume_dir, store, model_dir, data_file,
                                                           args.steps + 1, save=False), work / f"{name}-resume.log",
                                          env)
    found = RESUMED.search(text)
    if code != 0 or not found:
        row["problem"] = f"resume run exited {code}{'' if found else ' without resuming'}: {text[-1500:]}"
        return row
    row["verified_s"], row["loaded_s"] = float(found.group(2)), float(found.group(3))
    row["resume_s"] = round(row["verified_s"] + row["loaded_s"], 3)
    if not args.keep:
        for folder in (first, again):
            shutil.rmtree(folder, ignore_errors=True)
    return row


def parameters(model_dir: Path) -> int:
    """The model's parameter count, from its config (built on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e9 / seconds:.3g}" if seconds > 0 else "-"


def table(rows: list[dict]) -> str:
    """Seconds and GB/s of the save (training blocked; published) and the resume (verified + loaded), a location a
    row."""
    lines = ["| location | model | checkpoint | save: blocked s | GB/s | published s | GB/s | "
             "resume: verified s | loaded s | total s | GB/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        count = r["parameters"]
        shown = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
        model = f"{r['size']} ({shown}, {r['master_weights']} state), {r['nproc']} proc"
        if r["problem"]:
            lines.append(f"| {r['location']} | {model} | {r['problem'][:80]!r} | | | | | | | | |")
            continue
        size = r["checkpoint_bytes"]
        lines.append(f"| {r['location']} | {model} | {size / 1e9:,.3f} GB | {r['blocked_s']:.2f} | "
                     f"{rate(size, r['blocked_s'])} | {r['published_s']:.2f} | {rate(size, r['published_s'])} | "
                     f"{r['verified_s']:.2f} | {r['loaded_s']:.2f} | {r['resume_s']:.2f} | "
                     f"{rate(size, r['resume_s'])} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="the model shape")
    parser.add_argument("--store", help="the store's URL (default: a local S3 server this script starts)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs; gloo processes on a CPU)")
    parser.add_argument("--master-weights", choices=("fp32", "bf16"), default="fp32",
                        help="the trained state: fp32 weights and moments (default) or bf16 (master_weights: bf16: "
                             "half the checkpoint and the memory)")
    parser.add_argument("--steps", type=int, default=1, help="steps before the checkpoint")
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--run-timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="keep the output folders (checkpoints) measured")
    parser.add_argument("--locations", default="local,store",
                        help="which to measure, in this order: local, store or both (default: local,store)")
    args = parser.parse_args()
    if not args.locations or set(args.locations.split(",")) - {"local", "store"}:
        parser.error(f"--locations {args.locations}: local, store, or both separated by a comma")
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data_file = prepare_workspace(args.size, work, 64, args.maxlen // 2, args.maxlen)
    server, env, store = None, {}, args.store
    if store is None:
        server = S3Server(work / "moto.log")
        env = server.env
        os.environ.update(env)  # this process reads the manifests from it too
        server.make_bucket("meshtune-bench")
        store = f"s3://meshtune-bench/{args.size}-{int(time.time())}"
    try:
        rows = [measure(args, work, name, store if name == "store" else None, model_dir, data_file, env)
                for name in args.locations.split(",")]
        if not args.keep:
            from meshtune.checkpoint.object_store import open_store

            prefix = open_store(store)
            if prefix.exists():
                prefix.fs.rm(prefix.key, recursive=True)
    finally:
        if server:
            server.stop()
    (work / "object_store_checkpoint.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 1 if any(r["problem"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
