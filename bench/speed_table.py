"""meshtune's speed table: tokens/s, MFU and peak memory of meshtune beside its peer, HF Trainer + PEFT, plain and
with Liger kernels, and for Q-LoRA the same on bitsandbytes NF4 (bench/peer_hf.py), on the same card, model shape
and samples.

What a row measures. Every row trains a random-init model of a Qwen2.5 shape (weights do not change speed) on
synthetic samples (lengths uniform in --minlen..--maxlen, seed 1; bench/workspace.py) with the same batch per GPU
and gradient checkpointing on, for --steps steps. tokens/s counts real (non-padding) tokens after 5 warm-up steps.
MFU = achieved FLOP/s per GPU over a bf16 matmul measured on this card (both printed); FLOPs as torchtitan counts
them (meshtune.model.flops), for the peer too (from its tokens/s and the samples' lengths). "vs peer" and
"vs peer+Liger": meshtune's tokens/s over that peer's, and meshtune's peak memory as a share of the peer's.
Scaling = per-GPU tokens/s at N GPUs over the row it scales (1 GPU, or the fewest GPUs that hold the model).
Q-LoRA's peer is HF Trainer + PEFT on bitsandbytes NF4 with double quantization and bf16 compute, after peft's
prepare_model_for_kbit_training (the stack of Qwen's, LLaMA-Factory's and Axolotl's Q-LoRA recipes), loading the
model folder meshtune's run reads; its figure goes in "vs peer". Run without it (--no-peer, --peers without bnb,
or a peer that failed), the Q-LoRA row is judged against meshtune's LoRA row of the same model instead.
Every run starts from a fresh output folder. A row that needs more GPUs than the machine has, a run that fails,
and a run not started within --time-limit are listed as not run, with why; the other rows still run.

Set-up on a GPU machine with CUDA torch, transformers and peft, from the repository root: meshtune's other
dependencies (pydantic, ...), liger-kernel for the Liger peer, torchao for the Q-LoRA row (the release made for
the installed torch: peft and transformers import torchao wherever it is installed), bitsandbytes for its peer:
  pip install -e . liger-kernel 'torchao==<the release for your torch>' bitsandbytes
Offline, download those wheels elsewhere (pip download) and put them on the path:
  pip install --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD/src

The table (4 GPUs: the 1-GPU rows side by side, one per GPU, then the 2- and 4-GPU rows; speed.md and speed.json
in --out):
  python3 bench/speed_table.py --rows table --streams --out results
A machine held for a fixed time window: a part per window (a preset or a list of rows), then one table of the parts:
  python3 bench/speed_table.py --rows table-1gpu --streams --time-limit 540 --out results/a
  python3 bench/speed_table.py --rows full-7b-4gpu-zero3,full-7b-4gpu-hsdp --streams --time-limit 540 --out results/b
  python3 bench/speed_table.py --merge results/a/speed.json results/b/speed.json --out results
Q-LoRA 7B beside its bitsandbytes peer, then meshtune once more at the peer's memory (one GPU):
  python3 bench/speed_table.py --rows qlora-7b --out results
The same ratio at the peer's memory only, in 3 alternating rounds (peer, then meshtune):
  python3 bench/speed_table.py --rows qlora-7b --peers bnb --repeats 3 --only-at-peer-memory --out results
Long samples under context parallel (each GPU holds a quarter of every row; the zero3 row shows what fits without):
  python3 bench/speed_table.py --rows long-context --no-peer --minlen 30000 \
    --maxlen 32768 --steps 6
Tensor parallel 2 (tp 2, and tp 2 x dp 2 on 4 GPUs) beside zero3, full 7B at the same global batch:
  python3 bench/speed_table.py --rows tensor-parallel --no-peer --minlen 1024 --maxlen 1024 --steps 15
Ablations and profiles:
  python3 bench/speed_table.py --rows lora-1.5b --no-peer --variants "default;padding_free=false;fused_loss=false"
  python3 bench/speed_table.py --rows lora-1.5b-2gpu --no-peer --variants profile_steps=12-13   (rank 0's
      operator table to --out/profile-*.txt; the profiled steps run slower and count in tokens/s)
On a CPU (a smoke test of the scripts, a minute or two):
  python3 bench/speed_table.py --rows lora-tiny --steps 8 --out /tmp/speed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import kill_tree  # noqa: E402
from trace_summary import summarize_files as summarize_traces  # noqa: E402
from workspace import (WARMUP, build_model_dir, parse_variant, prepare_workspace, run_environment,  # noqa: E402
                       timed_records, timing_problem, workspace_samples)

from meshtune.hardware import measure_peak_flops  # noqa: E402
from meshtune.model.flops import FlopCounter  # noqa: E402
from meshtune.model.loading import model_skeleton  # noqa: E402

STARTED = time.monotonic()  # --time-limit counts from here


@dataclass
class Row:
    size: str
    mode: str  # lora | full | qlora
    gpus: int
    bs: int  # per GPU
    peer: bool = False  # runs the peers of its mode (MODE_PEERS) that --peers names
    settings: dict = field(default_factory=dict)
    scaling_of: str | None = None  # the row this one scales: 1 GPU, or the fewest GPUs that hold the model
    against: str | None = None  # a meshtune row this one is judged against where its peer did not run (Q-LoRA: LoRA)
    at_peer_memory: dict = field(default_factory=dict)  # settings of the run at the peers' memory, beyond memory_budget


# Checkpointing on, as the peer, with meshtune's default gradient_checkpointing_ratio (auto: the fewest recomputed
# blocks that fit 90% of the card); a row with peers runs once more within the peers' memory (--no-at-peer-memory)
LORA_15B: dict = {}
LORA_7B: dict = {}
QLORA_7B = {"gradient_checkpointing_ratio": 1.0}  # Q-LoRA's aim is memory: every block recomputed
QLORA_AT_PEER_MEMORY = {"gradient_checkpointing_ratio": "auto"}  # the fewest recomputed blocks in the peer's memory
FULL_7B_ZERO3 = {"parallel": "zero3"}  # auto recomputation: none on 4 GPUs, what 2 GPUs' memory asks for
FULL_7B_HSDP = {"parallel": "hsdp", "hsdp_shard_size": 2}  # replicas of 2 GPUs each, checkpointing on
FULL_7B_TP2 = {"parallel": "zero3", "tensor_parallel": 2}  # zero3 shards over the tp pairs (dp_shard)
FULL_15B = {}  # parallel auto: no wrapper on one GPU, zero2 on several
ROWS = {
    "lora-tiny": Row("tiny", "lora", 1, 8, peer=True),  # CPU smoke test
    "lora-1.5b": Row("1.5b", "lora", 1, 8, peer=True, settings=LORA_15B),
    "lora-7b": Row("7b", "lora", 1, 4, peer=True, settings=LORA_7B),
    # at the peers' memory, full fine-tuning trains bf16 weights as the peers do (with stochastic rounding): fp32
    # master weights alone take 16 bytes a parameter, more than the peers' whole step
    "full-1.5b": Row("1.5b", "full", 1, 8, peer=True, settings=FULL_15B, at_peer_memory={"master_weights": "bf16"}),
    "qlora-7b": Row("7b", "qlora", 1, 4, peer=True, settings=QLORA_7B, against="lora-7b",
                    at_peer_memory=QLORA_AT_PEER_MEMORY),
    # 7B full holds 16 bytes a parameter of sharded fp32 state: 30 GB a GPU over 4 (zero3) leaves room for every
    # block's activations; over 2 (zero3 on 2 GPUs, hsdp's shard) it is 61 GB, and auto recomputes what does not fit
    "full-7b-4gpu-zero3": Row("7b", "full", 4, 4, settings=FULL_7B_ZERO3, scaling_of="full-7b-2gpu-zero3"),
    "full-7b-4gpu-hsdp": Row("7b", "full", 4, 4, settings=FULL_7B_HSDP, scaling_of="full-7b-2gpu-hsdp"),
    "lora-1.5b-2gpu": Row("1.5b", "lora", 2, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "lora-1.5b-4gpu": Row("1.5b", "lora", 4, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "full-1.5b-2gpu": Row("1.5b", "full", 2, 8, settings=FULL_15B, scaling_of="full-1.5b"),
    "full-1.5b-4gpu": Row("1.5b", "full", 4, 8, settings=FULL_15B, scaling_of="full-1.5b"),
    # full 7B cannot train on one 80 GB GPU (122 GB of state): its scaling is per GPU against 2 GPUs, the fewest
    # that hold it, with the same settings at every count
    "lora-1.5b-8gpu": Row("1.5b", "lora", 8, 8, settings=LORA_15B, scaling_of="lora-1.5b"),
    "full-7b-2gpu-zero3": Row("7b", "full", 2, 4, settings=FULL_7B_ZERO3),
    "full-7b-8gpu-zero3": Row("7b", "full", 8, 4, settings=FULL_7B_ZERO3, scaling_of="full-7b-2gpu-zero3"),
    "full-7b-2gpu-hsdp": Row("7b", "full", 2, 4, settings=FULL_7B_HSDP),
    # long samples (run with --minlen / --maxlen in the tens of thousands): each GPU holds 1/cp of every row
    "full-7b-4gpu-cp4": Row("7b", "full", 4, 1, settings={"parallel": "zero3", "context_parallel": 4}),
    "lora-7b-4gpu-cp4": Row("7b", "lora", 4, 1, settings={"context_parallel": 4}),
    "full-7b-8gpu-hsdp": Row("7b", "full", 8, 4, settings=FULL_7B_HSDP, scaling_of="full-7b-2gpu-hsdp"),
    # tensor parallel 2 beside zero3 at the same global batch: a tp pair takes one micro-batch of 8 rows (4 a GPU)
    "full-7b-2gpu-tp2": Row("7b", "full", 2, 8, settings=FULL_7B_TP2),
    "full-7b-4gpu-tp2": Row("7b", "full", 4, 8, settings=FULL_7B_TP2, scaling_of="full-7b-2gpu-tp2"),
}
TABLE_1GPU = ["lora-1.5b", "full-1.5b", "lora-7b", "qlora-7b"]
SCALING_2GPU = ["lora-1.5b", "full-1.5b", "lora-1.5b-2gpu", "full-1.5b-2gpu"]
# the speed table: every peer row, Q-LoRA, and scaling to 4 GPUs (the 7B rows' 2-GPU bases are in scaling-8gpu)
DEFAULT_ROWS = ["lora-1.5b", "lora-7b", "full-1.5b", "qlora-7b", "full-7b-4gpu-zero3", "full-7b-4gpu-hsdp",
                "lora-1.5b-2gpu", "lora-1.5b-4gpu", "full-1.5b-2gpu", "full-1.5b-4gpu"]
SCALING_8GPU = ["lora-1.5b", "lora-1.5b-2gpu", "lora-1.5b-4gpu", "lora-1.5b-8gpu", "full-7b-2gpu-zero3",
                "full-7b-4gpu-zero3", "full-7b-8gpu-zero3", "full-7b-2gpu-hsdp", "full-7b-4gpu-hsdp",
                "full-7b-8gpu-hsdp"]
LONG_CONTEXT = ["full-7b-4gpu-zero3", "full-7b-4gpu-cp4", "lora-7b-4gpu-cp4"]  # with --minlen / --maxlen ~32k
TENSOR_PARALLEL = ["full-7b-2gpu-zero3", "full-7b-2gpu-tp2", "full-7b-4gpu-zero3", "full-7b-4gpu-tp2"]
PRESETS = {"table": DEFAULT_ROWS, "table-1gpu": TABLE_1GPU, "scaling-2gpu": SCALING_2GPU,
           "scaling-8gpu": SCALING_8GPU, "long-context": LONG_CONTEXT, "tensor-parallel": TENSOR_PARALLEL}
PEERS = {"plain": ("hf_trainer+peft", []), "liger": ("hf_trainer+peft+liger", ["--liger", "1"]),
         "bnb": ("hf_trainer+peft+bnb", [])}  # bnb: peer_hf.py --mode qlora, bitsandbytes NF4
# the peers of a row with peers, by its mode; the first is the one in the table's "vs peer" column
MODE_PEERS = {"lora": ("plain", "liger"), "full": ("plain", "liger"), "qlora": ("bnb",)}


def row_peers(row: Row, kinds: list[str]) -> list[str]:
    """The peer runs of a row: those of `kinds` (--peers) that its mode has, none for a row without peers."""
    return [kind for kind in kinds if kind in MODE_PEERS[row.mode]] if row.peer else []


def row_runs(row: Row, variants: list[str], peer_kinds: list[str], at_peer_memory: bool,
             only_at_peer_memory: bool = False) -> list[tuple]:
    """A row's runs in a round, in order, as (system, variant index, variant): meshtune's variants (on one process,
    those that train differently), the peers of its mode that --peers names, then meshtune at their memory; with
    `only_at_peer_memory`, a row that has peers runs them and that last run alone (a round: peer, then meshtune)."""
    peers = row_peers(row, peer_kinds)
    runs = [("meshtune", index, variant) for index, variant in enumerate(variants)
            if (row.gpus > 1 or one_process_equivalent(variant, variants) == variant)
            and not (only_at_peer_memory and peers)]
    runs += [(kind, None, None) for kind in peers]
    if at_peer_memory and peers:
        runs.append(("at-peer-memory", None, None))
    return runs


def expand_rows(text: str) -> list[str]:
    """--rows: a preset name, or a comma list of row names and presets; ValueError names the choices."""
    names = [n for item in text.split(",") if item.strip() for n in PRESETS.get(item.strip(), [item.strip()])]
    unknown = [name for name in names if name not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown row(s) {', '.join(unknown) or repr(text)}: rows are {', '.join(ROWS)}; "
                         f"presets {', '.join(f'{k} ({len(v)} rows)' for k, v in PRESETS.items())}")
    return names


def parse_peers(text: str, no_peer: bool) -> list[str]:
    """--peers as a list of PEERS keys (none with --no-peer); ValueError names the choices."""
    kinds = [] if no_peer else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}: peers are {', '.join(PEERS)}")
    return kinds


# Keys that change nothing on one process: how gradients cross processes and how FSDP2 shards over them (one process
# runs no wrapper). A 1-GPU row runs a variant that differs from an earlier one only in these once, and a scaling row
# of that variant is judged against the run it stands for.
CROSS_PROCESS_KEYS = {"parallel", "grad_reduce_dtype", "grad_sync", "fsdp_blocks_per_unit", "fsdp_prefetch",
                      "hsdp_shard_size", "gc_interval"}


def one_process_equivalent(variant: str, variants: list[str]) -> str:
    """The first of `variants` that trains as `variant` does on one process."""
    alone = {k: v for k, v in parse_variant(variant).items() if k not in CROSS_PROCESS_KEYS}
    return next(v for v in variants
                if {k: x for k, x in parse_variant(v).items() if k not in CROSS_PROCESS_KEYS} == alone)


class Deadline:
    """--time-limit: seconds left from the script's start (None: no limit)."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit

    def left(self) -> float | None:
        return None if self.limit is None else self.limit - (time.monotonic() - STARTED)

    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def timeout(self, row_timeout: float) -> tuple[float, str]:
        """A run's timeout: its own limit, or the time left if sooner; and what to call being stopped by it."""
        left = self.left()
        if left is not None and left < row_timeout:
            return max(left, 1.0), "stopped at the time limit"
        return row_timeout, f"timed out after {row_timeout} s"


ROW_TIMEOUT, ROW_TIMEOUT_7B = 400, 900


def row_timeout(args, row: Row) -> float:
    return args.row_timeout or (ROW_TIMEOUT_7B if row.size == "7b" else ROW_TIMEOUT)


def run_captured(cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None
                 ) -> tuple[int | None, str]:
    """Run a command; (exit code or None when the timeout stopped it, its stdout and stderr interleaved). With
    `log`, each line is written there as it comes, after the seconds since the start, so that a run stopped by the
    timeout, or by a kill of this script, still shows where its time went. On timeout the whole tree goes:
    torchrun's workers live in their own sessions and would keep their GPUs."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    sink = open(log, "w") if log else None

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if sink:
                sink.write(f"[{time.perf_counter() - started:7.1f} s] {line}")
                sink.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        code = None
    reader.join(timeout=30)
    if sink:
        sink.close()
    return code, "".join(lines)


def last_line(text: str) -> str:
    """A failed run's last output line: the error meshtune or Python ends with."""
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def fresh(folder: Path) -> Path:
    """An empty output folder: a run must never resume, or read the metrics of, an earlier run in it."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def meshtune_row(args, name: str, row: Row, variant: str, index: int, model_dir: Path, data_file: Path, work: Path,
                 peak: float | None, deadline: Deadline) -> dict:
    overrides, variables = run_environment({**row.settings, **parse_variant(variant)})
    out = fresh(work / f"out-{name}-v{index}")
    cfg = dict(model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
               output_dir=str(out), finetuning_type=row.mode, lora_rank=64, lora_alpha=16, lora_dropout=0.05,
               lora_target="all", per_device_train_batch_size=row.bs, max_steps=args.steps,
               logging_steps=args.logging_steps,
               learning_rate=3e-4, lr_scheduler_type="cosine", weight_decay=0.1, cutoff_len=args.maxlen,
               gradient_checkpointing=True, nproc_per_node=row.gpus, seed=1, resume_from_checkpoint="none",
               save_final=False)  # nothing of a row's output is read but its metrics; a 7B model is 30 GB to write
    cfg.update(overrides)
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    timeout, stopped = deadline.timeout(row_timeout(args, row))
    out.mkdir(parents=True, exist_ok=True)
    # train.log, beside metrics.jsonl, for a slow or odd row: written as the run goes
    code, output = run_captured([sys.executable, "-m", "meshtune", "train", str(path)], timeout,
                                env={**os.environ, "NCCL_NVLS_ENABLE": "0", **variables}, log=out / "train.log")
    if code is None:  # where the run was when stopped: loading, compiling, the memory probe or the steps
        return dict(error=stopped, log=output[-8000:])
    if code != 0:
        return dict(error=f"{last_line(output[-3000:])} (exit code {code})", log=output[-8000:])
    summary = out / "profile" / "summary.txt"
    if summary.is_file():  # a variant with profile_steps=A-B: bring rank 0's operator table back
        Path(args.out, f"profile-{name}-v{index}.txt").write_text(summary.read_text())
        try:  # and the GPU time of every rank: compute, NCCL, idle, and the host at the longest idle gaps
            ranks = summarize_traces(sorted((out / "profile").glob("rank*.json")))
            Path(args.out, f"profile-{name}-v{index}-ranks.md").write_text(ranks)
        except ValueError:  # a CPU run: no GPU events
            pass
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed, seconds = timed_records(records, args.warmup)
    tokens_per_s = sum(r["tokens"] for r in timed) / seconds
    flops_per_s = sum(r["tflops_per_gpu"] * 1e12 * r["tokens"] / r["tokens_per_s"] for r in timed) / seconds
    return dict(tokens_per_s=round(tokens_per_s), per_gpu=round(tokens_per_s / row.gpus),
                mfu=round(flops_per_s / peak, 4) if peak else None,
                step_s=round(seconds / (timed[-1]["step"] - args.warmup), 4),  # the steps the timed records cover
                peak_gib=round(max(r["peak_mem_gib"] for r in records), 2), first_loss=records[0]["loss"],
                peak_reserved_gib=max((r.get("peak_reserved_gib", 0) for r in records), default=None),
                trained_tokens=sum(r["tokens"] for r in records), alloc_retries=records[-1].get("alloc_retries"),
                compile_s_timed=compile_seconds_in(records, args.warmup),
                recompile_limit_hit="recompile_limit" in output,  # dynamo then runs eager
                final_loss=round(records[-1]["loss"], 4),
                wall_s=round(time.perf_counter() - started, 1), settings=overrides)


def compile_seconds_in(records: list[dict], warmup: int = WARMUP) -> float | None:
    """Seconds torch.compile took inside the timed steps (after the warm-up): they count in tokens/s."""
    warm = [r for r in records if r["step"] <= warmup]
    if not warm or "compile_s" not in records[-1]:
        return None
    return round(records[-1]["compile_s"] - warm[-1]["compile_s"], 2)


def peer_command(args, row: Row, kind: str, pool: int, model_dir: Path) -> list[str]:
    """The peer script's command line for a row; Q-LoRA's peer quantizes the model folder meshtune's run reads."""
    model = ["--model-dir", str(model_dir)] if row.mode == "qlora" else []
    return [sys.executable, args.peer, "--size", row.size, "--mode", row.mode, "--bs", str(row.bs), "--steps",
            str(args.steps), "--minlen", str(args.minlen), "--maxlen", str(args.maxlen), "--samples", str(pool),
            "--gc", "1", *model, *PEERS[kind][1]]


def peer_row(args, row: Row, kind: str, pool: int, model_dir: Path, flops_per_token: float, peak: float | None,
             deadline: Deadline) -> dict:
    """One peer run on this row's shape, batch and samples (the same pool of samples as meshtune's rows)."""
    timeout, stopped = deadline.timeout(row_timeout(args, row))
    code, output = run_captured(peer_command(args, row, kind, pool, model_dir), timeout)
    if code is None:
        return dict(error=stopped)
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        return dict(error=last_line(output))
    result = json.loads(lines[-1])
    tps = result["tokens_per_s"]
    return dict(tokens_per_s=tps, per_gpu=tps, mfu=round(tps * flops_per_token / peak, 4) if peak else None,
                step_s=result["step_s"], peak_gib=result["peak_gib"], reported=result)  # the peer's line, as printed


def at_peer_memory(results: list[dict], row: str) -> str | None:
    """The variant of the run at the peers' memory: meshtune's defaults, memory_budget the lowest peak (GiB) of the
    row's peers that ran, and the row's own settings for that run; None where no peer measured its peak."""
    peaks = [r["peak_gib"] for r in results if r["row"] == row and r["system"] != "meshtune" and r.get("peak_gib")]
    if not peaks:
        return None
    extra = "".join(f",{key}={value}" for key, value in ROWS[row].at_peer_memory.items())
    return f"memory_budget={min(peaks)}{extra}"


def mean_flops_per_token(model_dir: Path, samples) -> float:
    """FLOPs per real token over the whole sample set (the peer's batches draw from the same lengths)."""
    lengths = [len(s) for s in samples]
    return FlopCounter.of(model_skeleton(model_dir)).batch_flops(lengths) / sum(lengths)


def prepare(args, size: str) -> tuple[Path, Path, Path, float]:
    """A size's model, cached samples and work folder, and the samples' mean FLOPs per token."""
    work = Path(args.work) / size
    n = pool_size(args.steps)
    model_dir, data_file = prepare_workspace(size, work, n, args.minlen, args.maxlen)
    return model_dir, data_file, work, mean_flops_per_token(model_dir, workspace_samples(model_dir, n, args.minlen,
                                                                                          args.maxlen))


def pool_size(steps: int) -> int:
    """One sample pool for every row, stream and peer, whatever GPUs it sees: the largest global batch of any row
    times the steps."""
    return max(r.bs * r.gpus for r in ROWS.values()) * (steps + WARMUP)  # more than any run trains


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="table",
                   help=f"a preset ({', '.join(PRESETS)}) or a comma list of rows and presets; rows: {', '.join(ROWS)}")
    p.add_argument("--variants", default="default",
                   help="';'-separated meshtune config overrides, each run for every row, e.g. "
                        "'default;padding_free=false;gradient_checkpointing_ratio=0.5' (an ablation); "
                        "env.NAME=VALUE sets an environment variable of that run instead "
                        "(e.g. env.TORCHINDUCTOR_CPP_WRAPPER=1)")
    p.add_argument("--peers", default="plain,liger,bnb",
                   help="the peer runs of a row that has peers, each where the row's mode has it: plain (HF Trainer "
                        "+ PEFT) and liger (the same with Liger kernels) for lora and full rows, bnb (HF Trainer + "
                        "PEFT on bitsandbytes NF4) for qlora rows")
    p.add_argument("--no-peer", action="store_true", help="meshtune only")
    p.add_argument("--no-at-peer-memory", dest="at_peer_memory", action="store_false",
                   help="skip the run that follows a row's peers by default: meshtune's defaults with memory_budget "
                        "set to the lowest peak memory of those peers (gradient_checkpointing_ratio auto then fits the "
                        "step into it), the comparison at no more memory than the peer")
    p.add_argument("--only-at-peer-memory", action="store_true",
                   help="a row with peers runs only its peers and then meshtune at their memory (each round: peer, "
                        "then meshtune), not meshtune's own variants: with --repeats 3, the ratio at the peer's memory "
                        "in alternating rounds in the least time")
    p.add_argument("--peer", default=str(Path(__file__).resolve().parent / "peer_hf.py"),
                   help="the peer script (its arguments and JSON line as bench/peer_hf.py's)")
    p.add_argument("--steps", type=int, default=25, help=f"optimizer steps a run, the first {WARMUP} not timed")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help=f"steps not timed (default {WARMUP}): compilation, first allocations, cache warm-up")
    p.add_argument("--logging-steps", type=int, default=WARMUP, choices=[1, WARMUP],
                   help=f"meshtune's logging_steps in every run: tokens/s is timed over the logging intervals after "
                        f"the warm-up. {WARMUP} (default): one host sync for the metrics every {WARMUP} steps, nearer "
                        f"meshtune's own default of 10 | 1: every step timed, at the cost of a sync after each")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds: every row (its variants and peers) runs once a round, in the order given, so a "
                        "scaling row alternates with its base row; the table shows each figure's median with the "
                        "lowest and highest run, and a scaling's spread from the rounds' own ratios")
    p.add_argument("--minlen", type=int, default=128)
    p.add_argument("--maxlen", type=int, default=1024)
    p.add_argument("--row-timeout", type=int, default=None,
                   help=f"seconds one run may take; default {ROW_TIMEOUT} s, {ROW_TIMEOUT_7B} s for the 7B rows (the "
                        f"model read and broadcast from rank 0, and every block compiled, before the first step)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds from this script's start: no run starts after it, a run still going is stopped "
                        "at it, and the table is written with the rest listed as not run")
    p.add_argument("--work", default="/tmp/meshtune-bench", help="models, samples and run outputs")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="speed.json and speed.md (created if missing)")
    p.add_argument("--merge", nargs="+", metavar="SPEED_JSON",
                   help="render one table from the speed.json files of several invocations of this script on the same "
                        "machine (e.g. 1-GPU rows run side by side on separate GPUs, then the multi-GPU rows)")
    p.add_argument("--streams", action="store_true",
                   help="run rows side by side on disjoint GPUs of this machine (1-GPU rows one per GPU, 2-GPU rows "
                        "on GPU pairs, ...), each stream a child of this script, then merge their tables")
    args = p.parse_args(argv)
    try:
        args.rows = ",".join(expand_rows(args.rows))
        args.peer_kinds = parse_peers(args.peers, args.no_peer)
    except ValueError as error:
        p.error(str(error))
    if args.peer_kinds and not Path(args.peer).is_file():
        p.error(f"--peer {args.peer}: no such file (or --no-peer)")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    if args.only_at_peer_memory and not (args.at_peer_memory and args.peer_kinds):
        p.error("--only-at-peer-memory needs the peers and the run at their memory (drop --no-peer and "
                "--no-at-peer-memory)")
    if wrong := timing_problem(args.steps, args.warmup, args.logging_steps):
        p.error(wrong)
    return args


def main() -> None:
    args = parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, Path(args.out))
    if args.streams:
        return streams(args)
    run_rows(args)


def run_rows(args) -> None:
    """Every row in this process, one after another, on the GPUs this process sees."""
    deadline = Deadline(args.time_limit)
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name() if gpus else "cpu"
    peak = measure_peak_flops(torch.device("cuda", 0)) if gpus else None
    print(f"{device} x {gpus}; bf16 matmul peak measured: {peak / 1e12:.0f} TFLOP/s" if peak else device, flush=True)
    results, prepared, started = [], {}, time.perf_counter()

    def save() -> dict:  # after every run, so a run cut short still leaves what it measured
        summary = dict(device=device, gpus=gpus, peak_tflops=round(peak / 1e12, 1) if peak else None,
                       args=vars(args), wall_s=round(time.perf_counter() - started), results=results)
        Path(args.out, "speed.json").write_text(json.dumps(summary, indent=1))
        return summary

    def add(result: dict) -> None:
        results.append(result)
        save()  # before the line: a stream's parent takes the line to mean the row is on disk
        print(json.dumps({k: v for k, v in result.items() if k != "log"}), flush=True)

    for round_, name in ((r, name) for r in range(args.repeats) for name in args.rows.split(",")):
        row = ROWS[name]
        runs = row_runs(row, args.variants.split(";"), args.peer_kinds, args.at_peer_memory, args.only_at_peer_memory)
        if row.gpus > max(gpus, 1):
            if round_ == 0:
                add(dict(row=name, system="meshtune", gpus=row.gpus,
                         skipped=f"needs {row.gpus} GPUs, this machine has {gpus}"))
            continue
        if row.size not in prepared and not deadline.passed():
            prepared[row.size] = prepare(args, row.size)
        for system, index, variant in runs:
            if system == "at-peer-memory":
                variant = at_peer_memory([r for r in results if r.get("round", 0) == round_], name)
                if variant is None:  # no peer measured its memory (no CUDA, or the peers failed)
                    continue
                system, index = "meshtune", len(runs)
            bs = parse_variant(variant or "").get("per_device_train_batch_size", row.bs)  # a variant may set it
            head = (dict(row=name, system="meshtune", variant=variant, gpus=row.gpus, bs=bs) if system == "meshtune"
                    else dict(row=name, system=PEERS[system][0], gpus=1, bs=row.bs))
            head["round"] = round_
            if deadline.passed():
                add(dict(head, skipped="time limit"))
                continue
            model_dir, data_file, work, fpt = prepared[row.size]
            if system == "meshtune":
                add(dict(head, **meshtune_row(args, name, row, variant, index, model_dir, data_file, work, peak,
                                              deadline)))
            else:
                add(dict(head, **peer_row(args, row, system, pool_size(args.steps), model_dir, fpt, peak,
                                          deadline)))
    summary = save()
    table = render(results, summary)
    Path(args.out, "speed.md").write_text(table + "\n")
    print("\n" + table)


STREAM_OWN = {"--rows", "--work", "--out", "--streams", "--time-limit"}  # set per stream; the rest passes through


def child_argv(argv: list[str], rows: str, work: Path, out: Path, time_limit: float | None = None) -> list[str]:
    """This script's own command line for one stream: the options given, except those the stream sets itself
    (its rows, folders, and the time left of this script's limit)."""
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
    limit = [] if time_limit is None else ["--time-limit", f"{max(time_limit, 0):.0f}"]
    return [*kept, "--rows", rows, "--work", str(work), "--out", str(out), *limit]


def echo_results(child: subprocess.Popen, log: Path, label: str) -> threading.Thread:
    """Copy a stream's output to its log, and each row's result line to this script's output as it comes: a
    run cut short by a time limit still shows every row that finished."""
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
    a second SIGTERM follows at once; ignored, it cannot cut the merge short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit("stopped early: merging the rows that finished")


def link_models(work: Path, models: Path, sizes: set[str]) -> None:
    """A stream finds the models built once by the parent in its own work folder."""
    for size in sizes:
        (work / size).mkdir(parents=True, exist_ok=True)
        link = work / size / f"model-{size}"
        if not link.exists():
            link.symlink_to(models / f"model-{size}")


def streams(args) -> None:
    """Rows grouped by GPU count; each group dealt round-robin onto as many disjoint GPU sets as the machine has,
    one child process of this script per set (CUDA_VISIBLE_DEVICES), the groups one after another. Every stream
    shares the models built here first, and keeps its own work folder for the data and outputs. Stopped early
    (SIGTERM, e.g. from `timeout`), it stops the streams and still merges the rows they finished."""
    deadline = Deadline(args.time_limit)
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
                link_models(work, models, {ROWS[name].size for name in group if name in runnable})
                visible = ",".join(str(slot * count + i) for i in range(count))
                rows = ",".join(group[slot::slots])
                print(f"stream {label} on GPU {visible}: {rows}", flush=True)
                argv = child_argv(sys.argv[1:], rows, work, out, deadline.left())
                child = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
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
                kill_tree(child.pid)
        finished = [str(f) for f in files if f.is_file()]
        if finished:
            merge(finished, Path(args.out))


def merge(files: list[str], out: Path) -> None:
    parts = [json.loads(Path(f).read_text()) for f in files]
    first = parts[0]
    summary = dict(first, gpus=max(part["gpus"] for part in parts),
                   results=[r for part in parts for r in part["results"]], merged_from=files)
    (out / "speed.json").write_text(json.dumps(summary, indent=1))
    table = render(summary["results"], summary)
    (out / "speed.md").write_text(table + "\n")
    print(table)


def versus(ours: dict, theirs: dict | None, label: str = "") -> str:
    """'1.23x' ours over theirs in tokens/s, with our peak memory as a share of theirs where both are known."""
    if not theirs:
        return ""
    text = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x{' ' + label if label else ''}"
    if ours.get("peak_gib") and theirs.get("peak_gib"):
        text += f", {ours['peak_gib'] / theirs['peak_gib']:.0%} of its memory"
    return text


COLUMNS = ["row", "variant", "system", "GPUs", "bs/GPU", "tokens/s", "per GPU", "vs peer", "vs peer+Liger", "MFU",
           "peak GiB", "scaling"]


def aggregate(results: list[dict]) -> list[dict]:
    """The runs of one (row, variant, system) as one figure: medians of tokens/s, per GPU and MFU, the highest peak
    memory, the lowest and highest tokens/s (`spread`) and per-GPU tokens/s by round (`rounds`), in the order the
    figures first appear. Runs not run stay as they are, one line each."""
    groups: dict[tuple, list[dict]] = {}
    out: list[dict | tuple] = []
    for r in results:
        if "tokens_per_s" not in r:
            out.append(r)
            continue
        key = (r["row"], r.get("variant"), r["system"])
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(r)
    figures = []
    for item in out:
        if isinstance(item, dict):
            figures.append(item)
            continue
        runs = groups[item]
        figure = dict(runs[0], tokens_per_s=round(median([r["tokens_per_s"] for r in runs])),
                      per_gpu=round(median([r["per_gpu"] for r in runs])), runs=len(runs),
                      spread=(min(r["tokens_per_s"] for r in runs), max(r["tokens_per_s"] for r in runs)),
                      rounds={r.get("round", 0): r["per_gpu"] for r in runs},
                      recompile_limit_hit=any(r.get("recompile_limit_hit") for r in runs))
        mfus = [r["mfu"] for r in runs if r.get("mfu") is not None]
        figure["mfu"] = median(mfus) if mfus else None
        peaks = [r["peak_gib"] for r in runs if r.get("peak_gib") is not None]
        figure["peak_gib"] = max(peaks) if peaks else None
        figures.append(figure)
    return figures


def median(values: list[float]) -> float:
    return statistics.median(values)


def scaling_text(figure: dict, base: dict) -> str:
    """Per-GPU tokens/s over the base row's, medians; with several rounds, the lowest and highest of the rounds'
    own ratios (each scaling run over its base run of the same round)."""
    text = f"{figure['per_gpu'] / base['per_gpu']:.1%}"
    paired = [figure["rounds"][k] / base["rounds"][k] for k in figure.get("rounds", {}) if k in base.get("rounds", {})]
    if len(paired) > 1:
        text += f" ({min(paired):.1%}–{max(paired):.1%})"
    return text


def tokens_text(figure: dict) -> str:
    text = f"{figure['tokens_per_s']:,}"
    if figure.get("runs", 1) > 1:
        low, high = figure["spread"]
        text += f" ({low:,}–{high:,}, {figure['runs']} runs)"
    if figure.get("recompile_limit_hit"):  # not the compiled speed: say so where the figure is read
        text += " (dynamo's recompile limit hit: some graphs ran uncompiled)"
    return text


def render(results: list[dict], summary: dict) -> str:
    figures = aggregate(results)
    peers = {(r["row"], r["system"]): r for r in figures if r["system"] != "meshtune" and "tokens_per_s" in r}
    base = {(r["row"], r.get("variant")): r for r in figures if r["system"] == "meshtune" and "per_gpu" in r}
    args = summary["args"]
    lines = [f"{summary['device']} x {summary['gpus']}, bf16 matmul peak {summary['peak_tflops']} TFLOP/s (measured), "
             f"{args['steps']} steps ({args.get('warmup', WARMUP)} warm-up), lengths {args['minlen']}..{args['maxlen']}"
             + (f", {args['repeats']} rounds: medians (lowest–highest)" if args.get("repeats", 1) > 1 else ""), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in figures:
        variant = r.get("variant", "") or ""
        head = f"| {r['row']} | {variant} | {r['system']} | {r['gpus']} | {r.get('bs', '')} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} not run: {r.get('skipped') or r.get('error')} |" + " |" * (len(COLUMNS) - 6))
            continue
        plain = liger = scaling = ""
        if r["system"] == "meshtune":
            kinds = MODE_PEERS[ROWS[r["row"]].mode]
            plain = versus(r, peers.get((r["row"], PEERS[kinds[0]][0])))
            liger = versus(r, peers.get((r["row"], PEERS["liger"][0]))) if "liger" in kinds else ""
            against = ROWS[r["row"]].against  # its peer did not run: judged against our row (tokens/s, memory)
            if against and not plain:
                plain = versus(r, base.get((against, r.get("variant"))) or base.get((against, "default")), against)
            of = ROWS[r["row"]].scaling_of
            if of and ROWS[of].gpus == 1 and r.get("variant") is not None:
                variant = one_process_equivalent(r["variant"], args.get("variants", "default").split(";"))
            else:
                variant = r.get("variant")
            if of and (of, variant) in base:
                scaling = scaling_text(r, base[(of, variant)])
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        peak = r["peak_gib"] if r.get("peak_gib") is not None else ""
        cells = [tokens_text(r), f"{r['per_gpu']:,}", plain, liger, mfu, peak, scaling]
        lines.append(f"{head} " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
