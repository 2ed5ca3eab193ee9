"""The speed table of the performance issue: meshtune beside the peer (HF Trainer + PEFT) on the same card, one call.

Every row trains the same model shape (random init), on the peer's own synthetic samples (lengths uniform in
128..1024, seed 1), with the same batch per GPU and gradient checkpointing on, as the peer's published figures.
tokens/s counts real (non-padding) tokens after 5 warm-up steps. MFU = achieved FLOP/s per GPU over a bf16
matmul measured on this card (both printed); FLOPs as torchtitan counts them (meshtune/train/throughput.py), for
the peer too (from its tokens/s and the samples' lengths). Scaling = per-GPU tokens/s at N GPUs / at 1 GPU.
Rows that need more GPUs than the machine has are listed as not run, with why. Q-LoRA has no peer run (the peer
has no 4-bit path here): its row is judged against meshtune's LoRA row of the same model.
A failed run is reported in its row; the others still run.

On the device machine (peer copied to .peer/ and carried):
  python3 bench/speed_table.py --peer .peer/peer_hf.py --out $OUT
  python3 bench/speed_table.py --rows lora-1.5b --variants "default;padding_free=false;fused_loss=false"
  python3 bench/speed_table.py --rows lora-1.5b-2gpu --no-peer --variants "profile_steps=12-13"   (operator table
      of rank 0 to $OUT/profile-*.txt; the steps inside the window run slower and count in tokens/s)
On a CPU (smoke test of the script itself):
  python3 bench/speed_table.py --rows lora-tiny --steps 8 --peer ../shared/bench/peer_hf.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import WARMUP, build_model_dir, prepare_workspace, timed_records, workspace_samples  # noqa: E402

from meshtune.model.loading import model_skeleton  # noqa: E402
from meshtune.train.throughput import FlopCounter, measure_peak_flops  # noqa: E402


@dataclass
class Row:
    size: str
    mode: str  # lora | full | qlora
    gpus: int
    bs: int  # per GPU
    peer: bool = False
    settings: dict = field(default_factory=dict)
    scaling_of: str | None = None  # the row this one scales: 1 GPU, or the fewest GPUs that hold the model
    against: str | None = None  # a meshtune row this one is judged against (Q-LoRA: our LoRA's tokens/s and memory)


# Checkpointing as the peer (on), but selective: the fraction of blocks recomputed is chosen per row so that
# LoRA stays within the peer's peak memory (bench/README in docs/benchmarks.md has the ablation behind these)
LORA_15B = {"gradient_checkpointing_ratio": 0.35}
LORA_7B = {"gradient_checkpointing_ratio": 0.8}
QLORA_7B = {"gradient_checkpointing_ratio": 1.0}  # the target is memory (<= 40% of LoRA's): every block recomputed
FULL_7B_ZERO3 = {"parallel": "zero3", "gradient_checkpointing": False}
FULL_7B_HSDP = {"parallel": "hsdp", "hsdp_shard_size": 2}  # replicas of 2 GPUs each, checkpointing on
FULL_15B = {}  # parallel auto: no wrapper on one GPU, zero2 on several (measured faster than ddp on 4 H100s)
ROWS = {
    "lora-tiny": Row("tiny", "lora", 1, 8, peer=True),
    "lora-1.5b": Row("1.5b", "lora", 1, 8, peer=True, settings=LORA_15B),
    "lora-7b": Row("7b", "lora", 1, 4, peer=True, settings=LORA_7B),
    "full-1.5b": Row("1.5b", "full", 1, 8, peer=True, settings=FULL_15B),
    "qlora-7b": Row("7b", "qlora", 1, 4, settings=QLORA_7B, against="lora-7b"),
    # 7B full, 16 bytes a parameter of sharded fp32 state: 30 GB a GPU over 4 (zero3) leaves room for every
    # block's activations (~12 GB at bs 4, measured 41.5 GiB peak); over 2 (hsdp's shard) it is 61 GB, so hsdp
    # recomputes every block on 80 GB cards
    "full-7b-4gpu-zero3": Row("7b", "full", 4, 4, settings=FULL_7B_ZERO3, scaling_of="full-7b-2gpu-zero3"),
    "full-7b-4gpu-hsdp": Row("7b", "full", 4, 4, settings=FULL_7B_HSDP, scaling_of="full-7b-2gpu-hsdp"),
    "lora-1.5b-2gpu": Row("1.5b", "lora", 2, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "lora-1.5b-4gpu": Row("1.5b", "lora", 4, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "full-1.5b-2gpu": Row("1.5b", "full", 2, 8, settings=FULL_15B, scaling_of="full-1.5b"),
    "full-1.5b-4gpu": Row("1.5b", "full", 4, 8, settings=FULL_15B, scaling_of="full-1.5b"),
    # the 8-GPU issue: scaling to 8 GPUs on one host. Full 7B cannot train on one 80 GB GPU (122 GB of state), so
    # its scaling is per GPU against 2 GPUs, the fewest that hold it, with the same settings at every count
    # (zero3 without checkpointing on 2 GPUs: 57 GiB of state + ~12 GiB of activations, expected to fit 80 GB)
    "lora-1.5b-8gpu": Row("1.5b", "lora", 8, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "full-7b-2gpu-zero3": Row("7b", "full", 2, 4, settings=FULL_7B_ZERO3),
    "full-7b-8gpu-zero3": Row("7b", "full", 8, 4, settings=FULL_7B_ZERO3, scaling_of="full-7b-2gpu-zero3"),
    "full-7b-2gpu-hsdp": Row("7b", "full", 2, 4, settings=FULL_7B_HSDP),
    "full-7b-8gpu-hsdp": Row("7b", "full", 8, 4, settings=FULL_7B_HSDP, scaling_of="full-7b-2gpu-hsdp"),
}
SCALING_8GPU = ["lora-1.5b", "lora-1.5b-2gpu", "lora-1.5b-4gpu", "lora-1.5b-8gpu", "full-7b-2gpu-zero3",
                "full-7b-4gpu-zero3", "full-7b-8gpu-zero3", "full-7b-2gpu-hsdp", "full-7b-4gpu-hsdp", "full-7b-8gpu-hsdp"]
# the performance issue's table (the 8-GPU issue's rows are in SCALING_8GPU)
DEFAULT_ROWS = ["lora-1.5b", "lora-7b", "full-1.5b", "qlora-7b", "full-7b-4gpu-zero3", "full-7b-4gpu-hsdp",
                "lora-1.5b-2gpu", "lora-1.5b-4gpu", "full-1.5b-2gpu", "full-1.5b-4gpu"]
PRESETS = {"default": DEFAULT_ROWS, "scaling-8gpu": SCALING_8GPU}


def parse_variant(text: str) -> dict:
    """'default' or 'key=value,key=value' (values as YAML) -> config overrides."""
    if text.strip() in ("", "default"):
        return {}
    pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
    return {key.strip(): yaml.safe_load(value) for key, value in pairs}


def meshtune_row(args, name: str, row: Row, variant: str, index: int, model_dir: Path, data_file: Path, work: Path,
                 peak: float | None) -> dict:
    overrides = {**row.settings, **parse_variant(variant)}
    out = work / f"out-{name}-v{index}"
    cfg = dict(model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
               output_dir=str(out), finetuning_type=row.mode, lora_rank=64, lora_alpha=16, lora_dropout=0.05,
               lora_target="all", per_device_train_batch_size=row.bs, max_steps=args.steps, logging_steps=1,
               learning_rate=3e-4, lr_scheduler_type="cosine", weight_decay=0.1, cutoff_len=args.maxlen,
               gradient_checkpointing=True, nproc_per_node=row.gpus, seed=1, resume_from_checkpoint="none",
               save_final=False)  # nothing of a row's output is read but its metrics; a 7B model is 30 GB to write
    cfg.update(overrides)
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    try:
        proc = subprocess.run([sys.executable, "-m", "meshtune", "train", str(path)], capture_output=True, text=True,
                              timeout=args.row_timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {args.row_timeout} s")
    output = proc.stdout + proc.stderr
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(output)  # kept beside metrics.jsonl, for a slow or odd row
    if proc.returncode != 0:
        return dict(error=(proc.stdout[-1500:] + proc.stderr[-1500:]).strip().splitlines()[-1][:300],
                    log=proc.stdout[-4000:] + proc.stderr[-4000:])
    summary = out / "profile" / "summary.txt"
    if summary.is_file():  # a variant with profile_steps=A-B: bring rank 0's operator table back
        Path(args.out, f"profile-{name}-v{index}.txt").write_text(summary.read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed, seconds = timed_records(records)
    tokens_per_s = sum(r["tokens"] for r in timed) / seconds
    flops_per_s = sum(r["tflops_per_gpu"] * 1e12 * r["tokens"] / r["tokens_per_s"] for r in timed) / seconds
    return dict(tokens_per_s=round(tokens_per_s), per_gpu=round(tokens_per_s / row.gpus),
                mfu=round(flops_per_s / peak, 4) if peak else None, step_s=round(seconds / len(timed), 4),
                peak_gib=round(max(r["peak_mem_gib"] for r in records), 2), first_loss=records[0]["loss"],
                alloc_retries=records[-1].get("alloc_retries"),
                compile_s_timed=compile_seconds_in(records),
                recompile_limit_hit="recompile_limit" in output,  # dynamo then runs eager
                final_loss=round(records[-1]["loss"], 4),
                wall_s=round(time.perf_counter() - started, 1), settings=overrides)


def compile_seconds_in(records: list[dict]) -> float | None:
    """Seconds torch.compile took inside the timed steps (after the warm-up): they count in tokens/s."""
    warm = [r for r in records if r["step"] <= WARMUP]
    if not warm or "compile_s" not in records[-1]:
        return None
    return round(records[-1]["compile_s"] - warm[-1]["compile_s"], 2)


def peer_row(args, row: Row, flops_per_token: float, peak: float | None) -> dict:
    cmd = [sys.executable, args.peer, "--size", row.size, "--mode", row.mode, "--bs", str(row.bs), "--steps",
           str(args.steps), "--minlen", str(args.minlen), "--maxlen", str(args.maxlen), "--gc", "1"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {args.row_timeout} s")
    if proc.returncode != 0:
        return dict(error=(proc.stdout + proc.stderr).strip().splitlines()[-1][:300])
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    tps = result["tokens_per_s"]
    return dict(tokens_per_s=tps, per_gpu=tps, mfu=round(tps * flops_per_token / peak, 4) if peak else None,
                step_s=result["step_s"], peak_gib=result["peak_gib"])


def mean_flops_per_token(model_dir: Path, samples) -> float:
    """FLOPs per real token over the whole sample set (the peer's batches draw from the same lengths)."""
    lengths = [len(s) for s in samples]
    return FlopCounter.of(model_skeleton(model_dir)).batch_flops(lengths) / sum(lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="default",
                   help=f"comma list of {', '.join(ROWS)}; or a preset: {', '.join(PRESETS)} (the 8-GPU issue's rows)")
    p.add_argument("--variants", default="default",
                   help="';'-separated meshtune config overrides, each run for every row, e.g. "
                        "'default;padding_free=false;gradient_checkpointing_ratio=0.5' (an ablation)")
    p.add_argument("--no-peer", action="store_true", help="meshtune only")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--minlen", type=int, default=128)
    p.add_argument("--maxlen", type=int, default=1024)
    p.add_argument("--row-timeout", type=int, default=400)
    p.add_argument("--peer", default=str(Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer_hf.py"))
    p.add_argument("--work", default="/tmp/meshtune-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--merge", nargs="+", metavar="SPEED_JSON",
                   help="render one table from the speed.json files of several invocations of this script on the same "
                        "machine (e.g. 1-GPU rows run side by side on separate GPUs, then the multi-GPU rows)")
    p.add_argument("--streams", action="store_true",
                   help="run rows side by side on disjoint GPUs of this machine (1-GPU rows one per GPU, 2-GPU rows "
                        "on GPU pairs, ...), each stream a child of this script, then merge their tables")
    args = p.parse_args()
    args.rows = ",".join(PRESETS.get(args.rows, args.rows.split(",")))
    unknown = [name for name in args.rows.split(",") if name not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}: rows are {', '.join(ROWS)}; presets {', '.join(PRESETS)}")
    if args.merge:
        return merge(args.merge, Path(args.out))
    if args.streams:
        return streams(args)

    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name() if gpus else "cpu"
    peak = measure_peak_flops(torch.device("cuda", 0)) if gpus else None
    print(f"{device} x {gpus}; bf16 matmul peak measured: {peak / 1e12:.0f} TFLOP/s" if peak else device, flush=True)
    results, prepared, started = [], {}, time.perf_counter()

    def save() -> dict:  # after every row, so a run cut short still leaves what it measured
        summary = dict(device=device, gpus=gpus, peak_tflops=round(peak / 1e12, 1) if peak else None,
                       args=vars(args), wall_s=round(time.perf_counter() - started), results=results)
        Path(args.out, "speed.json").write_text(json.dumps(summary, indent=1))
        return summary

    for name in args.rows.split(","):
        row = ROWS[name]
        skip = f"needs {row.gpus} GPUs, this machine has {gpus}" if row.gpus > max(gpus, 1) else None
        if skip:
            results.append(dict(row=name, system="meshtune", gpus=row.gpus, skipped=skip))
            save()  # before the line: a stream's parent takes the line to mean the row is on disk
            print(json.dumps(results[-1]), flush=True)
            continue
        if row.size not in prepared:
            work = Path(args.work) / row.size
            # one sample pool for every row and stream, whatever GPUs it sees: the largest global batch of any
            # row (8 GPUs) times the steps
            n = max(r.bs * r.gpus for r in ROWS.values()) * (args.steps + WARMUP)
            model_dir, data_file = prepare_workspace(row.size, work, n, args.minlen, args.maxlen)
            fpt = mean_flops_per_token(model_dir, workspace_samples(model_dir, n, args.minlen, args.maxlen))
            prepared[row.size] = (model_dir, data_file, work, fpt)
        model_dir, data_file, work, fpt = prepared[row.size]
        for index, variant in enumerate(args.variants.split(";")):
            result = meshtune_row(args, name, row, variant, index, model_dir, data_file, work, peak)
            results.append(dict(row=name, system="meshtune", variant=variant, gpus=row.gpus, bs=row.bs, **result))
            save()
            print(json.dumps({k: v for k, v in results[-1].items() if k != "log"}), flush=True)
        if row.peer and not args.no_peer:
            results.append(dict(row=name, system="hf_trainer+peft", gpus=1, bs=row.bs, **peer_row(args, row, fpt, peak)))
            save()  # before the line: a stream's parent takes the line to mean the row is on disk
            print(json.dumps(results[-1]), flush=True)
    summary = save()
    table = render(results, summary)
    Path(args.out, "speed.md").write_text(table + "\n")
    print("\n" + table)


STREAM_OWN = {"--rows", "--work", "--out", "--streams"}  # set per stream; every other option passes through


def child_argv(argv: list[str], rows: str, work: Path, out: Path) -> list[str]:
    """This script's own command line for one stream: the options given, except those the stream sets itself."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in STREAM_OWN:
            skip = "=" not in arg and name != "--streams"
            continue
        kept.append(arg)
    return [*kept, "--rows", rows, "--work", str(work), "--out", str(out)]


def echo_results(child: subprocess.Popen, log: Path, label: str) -> threading.Thread:
    """Copy a stream's output to its log, and each row's result line to this script's output as it comes: a
    call cut short by its time limit still shows every row that finished."""
    def copy() -> None:
        with log.open("w") as sink:
            for line in child.stdout:
                sink.write(line)
                if line.startswith("{"):
                    print(f"[{label}] {line}", end="", flush=True)
    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def stop_once(*_) -> None:
    """SIGTERM: leave for the merge. GNU `timeout` signals its child and then the child's whole process group, so
    a second SIGTERM follows at once; ignored, it cannot cut the merge short (session 10 lost a merge to it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit("stopped early: merging the rows that finished")


def streams(args) -> None:
    """Rows grouped by GPU count; each group dealt round-robin onto as many disjoint GPU sets as the machine has,
    one child process of this script per set (CUDA_VISIBLE_DEVICES), the groups one after another. Every stream
    shares the models built here first, and keeps its own work folder for the data and outputs. Stopped early
    (SIGTERM, e.g. from `timeout`), it stops the streams and still merges the rows they finished."""
    gpus = torch.cuda.device_count()
    names = args.rows.split(",")
    models = Path(args.work) / "models"
    runnable = [n for n in names if ROWS[n].gpus <= max(gpus, 1)]
    for size in dict.fromkeys(ROWS[n].size for n in runnable):
        build_model_dir(size, models)
    files, children = [], []
    signal.signal(signal.SIGTERM, stop_once)
    try:
        for count in sorted({ROWS[name].gpus for name in names}):
            group = [name for name in names if ROWS[name].gpus == count]
            slots = max(1, gpus // count)
            children, copiers = [], []
            for slot in range(min(slots, len(group))):
                label = f"g{count}s{slot}"
                work, out = Path(args.work) / label, Path(args.out) / label
                out.mkdir(parents=True, exist_ok=True)
                # the stream finds the shared model in its work folder
                for size in {ROWS[name].size for name in group if name in runnable}:
                    (work / size).mkdir(parents=True, exist_ok=True)
                    link = work / size / f"model-{size}"
                    if not link.exists():
                        link.symlink_to(models / f"model-{size}")
                visible = ",".join(str(slot * count + i) for i in range(count))
                rows = ",".join(group[slot::slots])
                print(f"stream {label} on GPU {visible}: {rows}", flush=True)
                child = subprocess.Popen([sys.executable, __file__, *child_argv(sys.argv[1:], rows, work, out)],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
                children.append(child)
                copiers.append(echo_results(child, out / "log", label))
                files.append(out / "speed.json")
            for child, copier in zip(children, copiers):
                child.wait()
                copier.join()
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        finished = [str(f) for f in files if f.is_file()]
        if finished:
            merge(finished, Path(args.out))


def merge(files: list[str], out: Path) -> None:
    parts = [json.loads(Path(f).read_text()) for f in files]
    first = parts[0]
    summary = dict(first, gpus=max(part["gpus"] for part in parts), results=[r for part in parts for r in part["results"]],
                   merged_from=files)
    (out / "speed.json").write_text(json.dumps(summary, indent=1))
    table = render(summary["results"], summary)
    (out / "speed.md").write_text(table + "\n")
    print(table)


def render(results: list[dict], summary: dict) -> str:
    peers = {r["row"]: r for r in results if r["system"] != "meshtune" and "tokens_per_s" in r}
    base = {(r["row"], r.get("variant")): r for r in results if r["system"] == "meshtune" and "per_gpu" in r}
    lines = [f"{summary['device']} x {summary['gpus']}, bf16 matmul peak {summary['peak_tflops']} TFLOP/s (measured), "
             f"{summary['args']['steps']} steps ({WARMUP} warm-up), lengths {summary['args']['minlen']}.."
             f"{summary['args']['maxlen']}", "",
             "| row | variant | system | GPUs | bs/GPU | tokens/s | per GPU | vs peer | MFU | peak GiB | scaling |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        variant = r.get("variant", "") or ""
        head = f"| {r['row']} | {variant} | {r['system']} | {r['gpus']} | {r.get('bs', '')} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} not run: {r.get('skipped') or r.get('error')} | | | | | |")
            continue
        peer = peers.get(r["row"])
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer and r["system"] == "meshtune" else ""
        against = ROWS[r["row"]].against
        mine = against and (base.get((against, r.get("variant"))) or base.get((against, "default")))
        if mine and r["system"] == "meshtune":  # no peer of its own: judged against our row (tokens/s, memory)
            ratio = (f"{r['tokens_per_s'] / mine['tokens_per_s']:.2f}x {against}, "
                     f"{r['peak_gib'] / mine['peak_gib']:.0%} of its memory")
        scaling = ""
        of = ROWS[r["row"]].scaling_of
        if of and (of, r.get("variant")) in base:
            scaling = f"{r['per_gpu'] / base[(of, r.get('variant'))]['per_gpu']:.1%}"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        lines.append(f"{head} {r['tokens_per_s']:,} | {r['per_gpu']:,} | {ratio} | {mfu} | {r['peak_gib']} | {scaling} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
