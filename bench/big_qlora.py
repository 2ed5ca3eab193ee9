"""Q-LoRA of a model larger than one GPU: a random-init model of a Qwen2.5 shape (32B, 72B) trained with
`meshtune train` under zero3, each process capped at a smaller card's memory (`gpu_memory_limit`).

The model files are written directly, tensor by tensor, into 5 GB safetensors shards (building a 32B model in
memory to save it would take longer than the run). Measured: the GPU peak while loading (from the build's log
line) and while training (rank 0's, metrics.jsonl), the host memory the node's processes hold while loading (the
sum of their anonymous resident memory, sampled every 0.2 s: the memory-mapped model files in the page cache are
not the processes'), the load time, and tokens/s after the warm-up steps.

    python bench/big_qlora.py --size 32b --gpus 2 --gpu-memory-limit 24 --steps 20 --work /tmp/big-qlora
    python bench/big_qlora.py --size tiny --gpus 1 --steps 3 --work /tmp/bq   # CPU smoke run

The plan's choice against alternatives, one run each on the same model files (`default` is the plan's own; a run the
plan refuses, such as the memory fit's "does not fit", is reported with that error and the others still run):

    python bench/big_qlora.py --size 32b --gpus 1 --parallel auto --gpu-memory-limit 24 --steps 12 \
        --variants "default;gradient_checkpointing_ratio=1.0;torch_compile=false" --json results/32b.json

A variant named again runs again, so "default;compile_combo_kernels=true" repeated three times gives alternating
rounds; each variant is reported as the median of its runs with their range, and the verdict compares medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from processes import descendants, kill_tree  # noqa: E402
from workspace import (WARMUP, model_config, parse_variant, run_environment, timed_records,  # noqa: E402
                       workspace_samples, write_cached_dataset)

def write_random_model(size: str, out: Path, shard_bytes: float = 5e9) -> float:
    """config, tokenizer and bf16 safetensors shards (`shard_bytes` each at most, 5 GB as transformers writes) of
    random values (norms at 1) with their index, one tensor at a time (generated on the GPU where there is one).
    Returns the seconds it took; an existing directory is kept."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from meshtune.demo.tokenizer import write_tokenizer

    if (out / "model.safetensors.index.json").is_file():
        return 0.0
    started = time.perf_counter()
    write_tokenizer(["a small corpus for a benchmark tokenizer"] * 4, out, vocab_size=300)
    config = model_config(size)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(out))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size_of_shard = 0
    for name, param in skeleton.state_dict().items():
        nbytes = param.numel() * 2
        if shards[-1] and size_of_shard + nbytes > shard_bytes:
            shards.append([])
            size_of_shard = 0
        shards[-1].append((name, param.shape))
        size_of_shard += nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        values = {}
        for name, shape in tensors:
            if name.endswith("norm.weight"):
                value = torch.ones(shape, dtype=torch.bfloat16)
            else:
                value = (torch.randn(shape, device=device, generator=generator) * 0.02).to(torch.bfloat16).cpu()
            values[name] = value
            weight_map[name] = file
            total += value.numel() * 2
        save_file(values, str(out / file), metadata={"format": "pt"})
        print(f"wrote {file} ({sum(v.numel() for v in values.values()) * 2 / 1e9:.1f} GB)", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return time.perf_counter() - started


class HostMemory:
    """The largest sum of anonymous resident memory (RssAnon) of the processes below `pid`, sampled until stopped."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.wait(0.2):
            total = 0
            for pid in [self.pid, *descendants(self.pid)]:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                match = re.search(r"RssAnon:\s+(\d+) kB", status)
                total += int(match.group(1)) * 1024 if match else 0
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def run(args: argparse.Namespace, extra: dict | None = None) -> dict:
    """One training run of `args` with the config keys of --set and `extra`; SystemExit naming the log's end where
    meshtune fails."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else work / f"model-{args.size}"
    write_s = write_random_model(args.size, model_dir, args.shard_gb * 1e9)
    data_file = write_cached_dataset(model_dir, work, workspace_samples(model_dir, args.samples, args.minlen,
                                                                         args.maxlen), args.maxlen)
    out = work / "out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cfg = dict(model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
               output_dir=str(out), finetuning_type="qlora", lora_rank=args.rank, lora_alpha=16, lora_dropout=0.0,
               lora_target="all", parallel=args.parallel, nproc_per_node=args.gpus,
               per_device_train_batch_size=args.batch, max_steps=args.steps, logging_steps=1, learning_rate=3e-4,
               cutoff_len=args.maxlen, gradient_checkpointing=True, seed=1, resume_from_checkpoint="none",
               save_steps=0, save_final=False)
    if args.gpu_memory_limit:
        cfg["gpu_memory_limit"] = args.gpu_memory_limit
    cfg.update(yaml.safe_load(f"{{{', '.join(item.replace('=', ': ', 1) for item in args.set)}}}") or {})
    overrides, variables = run_environment(extra or {})
    cfg.update(overrides)
    config = work / "big_qlora.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log = work / "train.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(config)], stdout=sink,
                                   stderr=subprocess.STDOUT, env={**os.environ, "NCCL_NVLS_ENABLE": "0", **variables})
        memory = HostMemory(process.pid)
        loading_peak = None
        try:
            while process.poll() is None and time.perf_counter() - started < args.timeout:
                if loading_peak is None and "qlora: " in log.read_text():
                    loading_peak = memory.peak  # the build's line: loading is over
                time.sleep(0.5)
            if process.poll() is None:
                raise SystemExit(f"the run did not finish in {args.timeout} s; its log: {log}")
        finally:
            kill_tree(process.pid)
            run_peak = memory.stop()
    text = log.read_text()
    if process.returncode:
        raise SystemExit(f"meshtune train failed ({process.returncode}):\n{text[-3000:]}")
    line = next(line for line in text.splitlines() if line.startswith("qlora: "))
    records = [json.loads(row) for row in (out / "metrics.jsonl").read_text().splitlines()]
    timed, seconds = timed_records(records)
    load = re.search(r"in ([\d.]+) s", line)
    gpu_loading = re.search(r"GPU peak ([\d.]+) GiB", line)
    return dict(size=args.size, gpus=args.gpus, settings=args.set + [f"{k}={v}" for k, v in (extra or {}).items()],
                gpu_memory_limit_gib=args.gpu_memory_limit,
                parallel=args.parallel, rank=args.rank, batch=args.batch, steps=len(records), build_line=line,
                write_model_s=round(write_s, 1), load_s=float(load.group(1)) if load else None,
                gpu_peak_loading_gib=float(gpu_loading.group(1)) if gpu_loading else None,
                gpu_peak_gib=max(r["peak_mem_gib"] for r in records),
                host_peak_loading_gib=round((loading_peak or run_peak) / 2**30, 2),
                host_peak_run_gib=round(run_peak / 2**30, 2),
                tokens_per_s=round(sum(r["tokens"] for r in timed) / seconds) if timed else None,
                timed_steps=len(timed), first_loss=records[0]["loss"], last_loss=records[-1]["loss"],
                wall_s=round(time.perf_counter() - started, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="32b", help="a Qwen2.5 shape of bench/workspace.py (32b, 72b, 7b, tiny)")
    parser.add_argument("--gpus", type=int, default=2, help="processes (GPUs) on this node")
    parser.add_argument("--parallel", default="zero3", help="zero3 | hsdp | ddp | auto")
    parser.add_argument("--gpu-memory-limit", type=float, default=None,
                        help="GiB each process may use (24: a 24 GB card)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank, on every linear layer")
    parser.add_argument("--batch", type=int, default=2, help="samples per GPU per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--minlen", type=int, default=256)
    parser.add_argument("--maxlen", type=int, default=1024)
    parser.add_argument("--work", default="/tmp/big-qlora", help="model files, data and outputs go here")
    parser.add_argument("--model-dir", default=None, help="an existing model directory instead of a random one")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="size of each random safetensors file")
    parser.add_argument("--timeout", type=float, default=540, help="seconds the training run may take")
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more meshtune config keys")
    parser.add_argument("--variants", default=None,
                        help="';'-separated runs on the same model, each 'default' or KEY=VALUE,...: the plan's own "
                             "choice against alternatives (each reported, a refused one with its error); "
                             "env.NAME=VALUE sets an environment variable of that run")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        print(f"note: only steps after the first {WARMUP} are timed", file=sys.stderr)
    return args


def run_variants(args: argparse.Namespace) -> list[dict]:
    """One run per variant of --variants on the same model files; a failed run reported with meshtune's own error
    line (the last `meshtune: error` of its log, or the log's end) rather than ending the others."""
    results = []
    for variant in (v.strip() for v in args.variants.split(";")):
        try:
            result = run(args, parse_variant(variant))
        except SystemExit as failed:
            text = str(failed)
            named = [line for line in text.splitlines() if line.startswith("meshtune: error")]
            result = dict(size=args.size, gpus=args.gpus, error=(named[-1] if named else text[-1500:]))
        results.append(dict(variant=variant or "default", **result))
        print(json.dumps(results[-1]), flush=True)
    return results


def comparison(results: list[dict]) -> str:
    """The variants side by side, a variant run several times (alternating, as --variants "a;b;a;b" runs them) as
    the median of its runs that trained with their range, and whether the plan's own choice (`default`) was the
    fastest that trained, by those medians."""
    rows = ["| variant | tokens/s | GPU peak training GiB | load s |", "|---|---:|---:|---:|"]
    by_variant: dict[str, list[dict]] = {}
    for r in results:
        by_variant.setdefault(r["variant"], []).append(r)
    medians = {}
    for variant, runs in by_variant.items():
        trained = [r for r in runs if "error" not in r and r.get("tokens_per_s")]
        refused = [r for r in runs if "error" in r]
        if not trained:
            rows.append(f"| {variant} | did not train: {refused[-1]['error'] if refused else 'no figure'} | | |")
            continue
        rates = sorted(r["tokens_per_s"] for r in trained)
        medians[variant] = statistics.median(rates)
        spread = f" ({rates[0]:,}–{rates[-1]:,}, {len(rates)} runs)" if len(rates) > 1 else ""
        also = f"; {len(refused)} more did not train: {refused[-1]['error']}" if refused else ""
        peak, load = max(r["gpu_peak_gib"] for r in trained), statistics.median(r["load_s"] for r in trained)
        rows.append(f"| {variant} | {medians[variant]:,.0f}{spread}{also} | {peak:.2f} | {load} |")
    if "default" not in by_variant:
        verdict = "no default variant: the plan's own choice was not run"
    elif "default" not in medians:
        verdict = "the plan's own choice did not train"
    else:
        fastest = max(medians, key=medians.get)
        verdict = ("the plan's own choice was the fastest that trained" if medians[fastest] <= medians["default"]
                   else f"the plan's own choice was not the fastest: {fastest} ran "
                        f"{medians[fastest] / medians['default']:.2f}x its tokens/s")
    return "\n".join(rows + ["", verdict])


def main() -> None:
    args = parse_args()
    if args.variants:
        results = run_variants(args)
        print(comparison(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        return
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
