"""The run plan: every setting the config leaves open (`auto`, or unset) made concrete once, with the reason.

`resolve` reads the config, the processes and their devices, and the checkpoint being resumed. The model builder,
the data plan and the loop read the plan and never an `auto`; the config stays what the user wrote (its hash is
the run's identity across nodes and checkpoints) and is never changed. The plan is logged once, as one block,
and written to output_dir/run_plan.json.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.hardware import bf16_supported, smallest_gpu_memory, varlen_available

SHARDED = ("zero2", "zero3", "hsdp")
UNIT_PARAMS = 1_000_000_000  # an FSDP2 unit's parameters, at most, when the config leaves blocks per unit open
MAX_BLOCKS_PER_UNIT = 4       # the largest unit measured (docs/benchmarks.md)


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs to know of the model, read from its config alone (no weights)."""

    parameters: int
    block_parameters: int  # one transformer block's
    blocks: int = 1        # transformer blocks


@dataclass(frozen=True)
class RunPlan:
    parallel: str                # ddp | zero2 | zero3 | hsdp
    bf16: bool                   # compute in bf16 (fp32 master weights)
    frozen_bf16: bool            # the frozen base stored in bf16 (LoRA under ddp, Q-LoRA): only adapters are master weights
    bf16_weights: bool           # master_weights bf16: full fine-tuning's weights, gradients and AdamW moments in bf16
    padding_free: bool           # a micro-batch's samples end to end in one row, varlen attention
    fused_loss: bool             # the head computes the loss in chunks (where the head is a bias-free linear layer)
    compile: bool                # torch.compile each transformer block and the loss chunks
    blocks_per_unit: int | None  # consecutive blocks per FSDP2 unit; None under ddp
    hsdp_shard_size: int | None  # processes sharding one replica; None unless hsdp
    cpu_offload: bool            # FSDP2's shards (weights, gradients, optimizer state) in host memory
    gradient_accumulation_steps: int  # the config's, or what keeps a resumed checkpoint's global batch
    fused_adamw: bool
    gc_interval: int             # 0: Python's automatic garbage collection
    weights_from_rank0: bool     # rank 0 reads the model files, the others receive its weights
    why: dict[str, str] = field(default_factory=dict)  # the reason for each setting meshtune chose
    fp16: bool = False           # fp16 compute through autocast and a dynamic loss scale, fp32 master weights (GPUs)

    @property
    def load_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.frozen_bf16 or self.bf16_weights else torch.float32

    @property
    def autocast_bf16(self) -> bool:
        """DDP computes in bf16 through autocast; FSDP2's mixed-precision policy casts by itself."""
        return self.bf16 and self.parallel == "ddp"

    def describe(self) -> str:
        precision = ("fp16 compute (autocast), dynamic loss scale, fp32 master weights" if self.fp16 else
                     "bf16 compute, frozen base in bf16, fp32 adapters" if self.frozen_bf16 else
                     "bf16 weights, gradients and AdamW moments, stochastic rounding" if self.bf16_weights else
                     "bf16 compute, fp32 master weights" if self.bf16 else "fp32")
        rows = [("parallel", self.parallel), ("precision", precision),
                ("padding_free", on(self.padding_free)), ("fused_loss", on(self.fused_loss)),
                ("torch_compile", on(self.compile))]
        if self.blocks_per_unit is not None:
            rows.append(("fsdp_blocks_per_unit", str(self.blocks_per_unit)))
        if self.hsdp_shard_size is not None:
            rows.append(("hsdp_shard_size", str(self.hsdp_shard_size)))
        if self.cpu_offload:
            rows.append(("cpu_offload", "on"))
        rows += [("gradient_accumulation_steps", str(self.gradient_accumulation_steps)),
                 ("optim", "meshtune bf16 AdamW, stochastic rounding" if self.bf16_weights else
                  "adamw_torch_fused" if self.fused_adamw else "adamw_torch"),
                 ("gc_interval", str(self.gc_interval)),
                 ("load_weights_on", "rank0" if self.weights_from_rank0 else "every_rank")]
        lines = ["run plan (also in output_dir/run_plan.json):"]
        for key, value in rows:
            reason = self.why.get(key)
            lines.append(f"  {key:<28} {value}{f'  ({reason})' if reason else ''}")
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


def on(flag: bool) -> str:
    return "on" if flag else "off"


def resolve(cfg: TrainConfig, env: DistEnv, resume_manifest: dict | None,
            model_size: Callable[[], ModelSize]) -> RunPlan:
    """The plan of this run, the same on every rank. `model_size` is called only where a choice depends on it
    (full fine-tuning on several GPUs, FSDP2 units); choosing the parallel mode may be a collective."""
    why: dict[str, str] = {}
    model_size = functools.cache(model_size)  # builds a model without weights: once, and only if a choice needs it
    parallel = choose_parallel(cfg, env, model_size, why)
    bf16 = not cfg.fp16 and (bf16_supported(env.device) if cfg.bf16 is None else
                             cfg.bf16 and env.device.type == "cuda")
    if cfg.bf16 and env.device.type != "cuda":
        why["precision"] = "bf16 is ignored on CPU"
    fp16 = cfg.fp16 and env.device.type == "cuda"  # fp16: true, for GPUs without bf16, in bf16's place
    if cfg.fp16 and not fp16:
        why["precision"] = "fp16 is ignored on CPU"
    # Q-LoRA's frozen base, NF4 apart, stays bf16 under FSDP2 too: its embeddings and head are a 72B model's largest
    # tensors left, and FSDP2 would only cast fp32 copies of them down to bf16 for every forward
    frozen_bf16 = bf16 and cfg.is_lora and (parallel == "ddp" or cfg.finetuning_type == "qlora")
    padding_free = cfg.padding_free if cfg.padding_free is not None else varlen_available(env.device)
    # Q-LoRA sharded by FSDP2 with activation checkpointing: on CUDA the recompute of a compiled block saves other
    # tensors than its forward did (torch.utils.checkpoint's CheckpointError), so its blocks run uncompiled
    compile_clash = cfg.finetuning_type == "qlora" and parallel in SHARDED and cfg.gradient_checkpointing
    compile_ = cfg.torch_compile if cfg.torch_compile is not None else env.device.type == "cuda" and not compile_clash
    for key, value, default in (("padding_free", cfg.padding_free, "on with CUDA"),
                                ("torch_compile", cfg.torch_compile, "on with CUDA" + (
                                    "; off for Q-LoRA sharded by FSDP2 with activation checkpointing, whose "
                                    "compiled blocks fail their recompute" if compile_clash else ""))):
        if value is None:
            why[key] = f"default, {default}"
    fused_adamw = cfg.optim == "adamw_torch_fused" or (cfg.optim == "auto" and env.device.type == "cuda")
    if cfg.optim == "auto":
        why["optim"] = ("auto: fused on CUDA; the offloaded shards step in torch's fused CPU kernel" if
                        cfg.cpu_offload and fused_adamw else "auto: fused on CUDA")
    gc_interval = cfg.gc_interval if cfg.gc_interval is not None else (50 if env.world_size > 1 else 0)
    if cfg.gc_interval is None:
        why["gc_interval"] = ("default: all ranks collect at the same steps" if gc_interval else
                              "default with one process: Python's automatic collection")
    weights_from_rank0 = env.world_size > 1 and cfg.load_weights_on == "rank0" and cfg.finetuning_type != "qlora"
    if cfg.finetuning_type == "qlora":
        why["load_weights_on"] = ("qlora: each process reads the files block by block, quantizes each block and keeps "
                                  "its shard")
    blocks_per_unit = None
    if parallel in SHARDED:
        blocks_per_unit = cfg.fsdp_blocks_per_unit or default_blocks_per_unit(model_size().block_parameters)
        if cfg.fsdp_blocks_per_unit is None:
            why["fsdp_blocks_per_unit"] = f"default: up to {MAX_BLOCKS_PER_UNIT} blocks within ~1B parameters a unit"
    hsdp_shard = hsdp_shard_size(cfg, env, parallel, why)
    if cfg.finetuning_type == "qlora" and parallel == "hsdp" and hsdp_shard == 1:
        raise ConfigError("parallel: hsdp with a shard of 1 process shards nothing, and torchao's NF4 weights cannot "
                          "be sharded over one: for qlora set hsdp_shard_size above 1, or parallel: ddp")
    if cfg.cpu_offload:  # the config allows it with zero2 / zero3 / hsdp only
        why["cpu_offload"] = offload_reason(cfg.is_lora, model_size().parameters, hsdp_shard or env.world_size, env)
    accumulation = keep_global_batch(cfg, resume_manifest, env.world_size, why)
    check_train_batch_size(cfg, accumulation, env.world_size)
    bf16_weights = cfg.master_weights == "bf16"
    if bf16_weights:
        why["optim"] = "master_weights: bf16 steps bf16 weights with stochastic rounding" + (
            "" if cfg.optim == "auto" else f", not {cfg.optim}")
    return RunPlan(parallel=parallel, bf16=bf16, frozen_bf16=frozen_bf16, bf16_weights=bf16_weights,
                   padding_free=padding_free,
                   fused_loss=cfg.fused_loss, compile=compile_, blocks_per_unit=blocks_per_unit,
                   hsdp_shard_size=hsdp_shard, cpu_offload=cfg.cpu_offload,
                   gradient_accumulation_steps=accumulation, fused_adamw=fused_adamw, gc_interval=gc_interval,
                   weights_from_rank0=weights_from_rank0, why=why, fp16=fp16)


def choose_parallel(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize], why: dict[str, str]) -> str:
    """`parallel: auto` made concrete; other values pass through.

    LoRA trains a few million parameters: ddp all-reduces only theirs and keeps the frozen base in bf16. Full
    fine-tuning on several GPUs: zero2 reduce-scatters the gradients and steps the optimizer on a shard, faster than
    ddp at a fraction of its memory. zero2 keeps every block's bf16 weights whole from forward to backward; where
    those plus its 16-byte-per-parameter share of the fp32 state would take over half the smallest GPU, zero3
    (reshard after forward) leaves room for activations.
    """
    if cfg.finetuning_type == "qlora" and env.world_size == 1 and cfg.parallel in SHARDED:
        why["parallel"] = (f"{cfg.parallel} on one process: nothing to shard (and torchao's NF4 weights cannot be "
                           f"sharded over one)")
        return "ddp"
    if cfg.parallel != "auto":
        return cfg.parallel
    if cfg.finetuning_type == "qlora" and env.world_size > 1 and env.device.type == "cuda":
        mode, reason = sharding_for_qlora(model_size(), env.world_size, smallest_gpu_memory(env.device, cfg.gpu_memory_limit))
    elif cfg.is_lora:
        mode, reason = "ddp", "LoRA: only the adapters' gradients are all-reduced"
    elif env.world_size == 1:
        mode, reason = "ddp", "one process"
    elif env.device.type != "cuda":
        mode, reason = "ddp", "CPU processes"
    else:
        mode, reason = sharding_for_full(model_size().parameters, env.world_size, smallest_gpu_memory(env.device, cfg.gpu_memory_limit),
                                         state_bytes=8 if cfg.master_weights == "bf16" else 16)
    why["parallel"] = f"auto: {reason}"
    return mode


def sharding_for_full(n_params: int, world_size: int, gpu_bytes: float, state_bytes: int = 16) -> tuple[str, str]:
    """zero2 unless its whole bf16 weights plus its share of the state (16 bytes a parameter in fp32: weights,
    gradients, two Adam moments; 8 with bf16 master weights) would take over half of a GPU's memory."""
    zero2_bytes = 2 * n_params + state_bytes * n_params / world_size
    share = f"{zero2_bytes / 2**30:.1f} GiB of weights and state per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if zero2_bytes <= 0.5 * gpu_bytes:
        return "zero2", f"full fine-tuning on {world_size} GPUs, {share}"
    return "zero3", f"full fine-tuning on {world_size} GPUs; zero2 would hold {share}"


NF4_BYTES = 0.5 + 1 / 64  # a 4-bit value, and an 8-bit scale per 64 of them (the scales' own scales are negligible)


def sharding_for_qlora(size: ModelSize, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """Q-LoRA under ddp keeps the whole 4-bit model on every GPU: its block weights in NF4, embeddings and head in
    bf16. Where that would take over half of the smallest GPU (activations and the adapters' state need the rest),
    zero3 shards it over the processes, as zero3 does for full fine-tuning."""
    block_params = size.block_parameters * size.blocks
    whole = NF4_BYTES * block_params + 2 * (size.parameters - block_params)
    held = f"{whole / 2**30:.1f} GiB of 4-bit model per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if whole <= 0.5 * gpu_bytes:
        return "ddp", f"Q-LoRA: {held}; only the adapters' gradients are all-reduced"
    return "zero3", (f"Q-LoRA: ddp would hold {held}; zero3 shards it, "
                     f"{whole / world_size / 2**30:.1f} GiB per GPU over {world_size}")


def offload_reason(is_lora: bool, n_params: int, shards: int, env: DistEnv) -> str:
    """What cpu_offload moves to host memory, and how much of it one node holds: each process keeps its shard
    (1 / `shards` of the model) of the fp32 weights, and for full fine-tuning their gradients and two Adam moments
    too (16 bytes a parameter; LoRA's frozen base 4, its adapters a few MB). The GPU keeps the gathered units and
    the activations only."""
    per_param = 4 if is_lora else 16
    node_bytes = per_param * n_params / shards * env.local_world_size
    size = f"{node_bytes / 2**30:.1f} GiB" if node_bytes >= 2**30 else f"{node_bytes / 2**20:.1f} MiB"
    if env.device.type != "cuda":
        return (f"CPU processes: every tensor is in host memory already (~{size} of shards a node); FSDP2's "
                f"offload path runs unpinned and saves nothing")
    held = "weights" if is_lora else "weights, gradients and optimizer state"
    return (f"FSDP2 CPUOffloadPolicy: the shards' {held} in pinned host memory, ~{size} a node, copied to the GPU "
            f"for each all-gather; the optimizer steps on the CPU")


def default_blocks_per_unit(block_parameters: int) -> int:
    """Blocks per FSDP2 unit when the config leaves it open: each unit's hooks and collectives cost host time, and
    the ranks wait for the slowest host at every collective, so fewer, larger units run faster. The cap keeps what
    zero3 gathers at once (a unit, and the next one prefetched) small beside the GPU: 72B's 0.9B-parameter blocks
    stay one a unit."""
    return max(1, min(MAX_BLOCKS_PER_UNIT, UNIT_PARAMS // max(block_parameters, 1)))


def hsdp_shard_size(cfg: TrainConfig, env: DistEnv, parallel: str, why: dict[str, str]) -> int | None:
    """hsdp shards each replica over the processes of one node unless told otherwise; the size must divide the job."""
    if parallel != "hsdp":
        return None
    shard = cfg.hsdp_shard_size or env.local_world_size
    if cfg.hsdp_shard_size is None:
        why["hsdp_shard_size"] = "default: the processes of one node"
    if env.world_size % shard:
        raise ConfigError(f"hsdp_shard_size: {shard} does not divide the {env.world_size} processes; use a divisor "
                          f"(by default the processes of one node: {env.local_world_size})")
    return shard


def check_train_batch_size(cfg: TrainConfig, accumulation: int, world_size: int) -> None:
    """`train_batch_size` (DeepSpeed's) is what the user expects the global batch to be: a different one is an error
    before the first step, not a run with another learning dynamic."""
    actual = cfg.per_device_train_batch_size * accumulation * world_size
    if cfg.train_batch_size is not None and cfg.train_batch_size != actual:
        raise ConfigError(
            f"train_batch_size {cfg.train_batch_size} is not the global batch this job makes: "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{accumulation} x {world_size} processes = {actual}; change one of them, or set train_batch_size to "
            f"{actual} (\"auto\" in a DeepSpeed JSON)")


def keep_global_batch(cfg: TrainConfig, manifest: dict | None, world_size: int, why: dict[str, str]) -> int:
    """Resuming on another world size: the same global batch (so the same data order and math) through another
    gradient accumulation, or a clear error when no whole number of micro-steps gives it."""
    configured = cfg.gradient_accumulation_steps
    saved = (manifest or {}).get("global_batch")
    per_step = cfg.per_device_train_batch_size * world_size
    if not saved or per_step * configured == saved:
        return configured
    if saved % per_step:
        raise ConfigError(
            f"the checkpoint was trained with a global batch of {saved}, which {world_size} processes x "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} cannot make up; choose a process count "
            f"or batch size that divides {saved}, or resume_from_checkpoint: none to start over")
    accumulation = saved // per_step
    why["gradient_accumulation_steps"] = (f"resuming on {world_size} processes: gradient_accumulation_steps "
                                          f"{configured} -> {accumulation} keeps the checkpoint's global batch of {saved}")
    return accumulation
