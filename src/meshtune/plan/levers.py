"""The speed levers: padding-free rows, recomputed blocks, compiled blocks, the fused loss, fused AdamW, Python's
collector and who reads the weights. Each is taken as set or by its default, then gives way where `CONFLICTS` says
it cannot run with the layout or the stage (`give_way`, the one reader of that table)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.plan.memory import offloads
from meshtune.plan.run_plan import MEASURE, SHARDED, Layout, Machine


@dataclass(frozen=True)
class Conflict:
    """A lever that cannot run with a part of the layout or a stage: where the lever (its config key) would be
    `clashing` and `under` holds, it is `instead`, for `reason`."""

    lever: str
    under: str
    clashing: object
    instead: object
    reason: str


UNDER: dict[str, Callable[[TrainConfig, Layout], bool]] = {
    "tensor_parallel": lambda cfg, layout: layout.tp > 1,
    "context_parallel": lambda cfg, layout: layout.cp > 1,
    "pipeline_parallel": lambda cfg, layout: layout.pp > 1,
    "stage: kto": lambda cfg, layout: cfg.stage == "kto",
}

# A lever's rows in the order they are judged: the first that holds gives the reason.
CONFLICTS = (
    Conflict("padding_free", "tensor_parallel", True, False,
             "off under tensor_parallel: rows are padded to a multiple of tensor_parallel, each process holding an "
             "equal share of their positions (sequence parallel)"),
    Conflict("padding_free", "context_parallel", True, False,
             "off under context_parallel: rows are padded to a multiple of 64 x context_parallel, each process "
             "holding two of their 2 x context_parallel chunks; the ring attention takes whole rows"),
    Conflict("padding_free", "pipeline_parallel", True, False,
             "off under pipeline_parallel: every micro-batch of a step is padded to one shape, the one the stages' "
             "sends and receives are set up for"),
    Conflict("gradient_checkpointing", "pipeline_parallel", MEASURE, 0.0,
             "not measured under pipeline_parallel (the measuring steps run the whole model on one process): set "
             "gradient_checkpointing_ratio to recompute blocks"),
    Conflict("torch_compile", "tensor_parallel", True, False,
             "off under tensor_parallel: the blocks run eagerly between their DTensor collectives"),
    Conflict("torch_compile", "pipeline_parallel", True, False,
             "off under pipeline_parallel: a stage's blocks run eagerly between its sends and receives"),
    Conflict("torch_compile", "context_parallel", True, False,
             "off under context_parallel: the ring attention swaps the blocks' attention for DTensor collectives "
             "while a micro-step runs, and the blocks run eagerly around it"),
    Conflict("fused_loss", "tensor_parallel", True, False,
             "off under tensor_parallel: the head's vocabulary is split over the tensor-parallel processes, and the "
             "loss (stage: dpo and kto: each response's log-prob) is computed across their shares of the logits "
             "(vocabulary-parallel cross-entropy), which are never gathered whole"),
    Conflict("fused_loss", "pipeline_parallel", True, False,
             "off under pipeline_parallel: the last stage's head returns the logits the schedule hands to the loss"),
    Conflict("fused_loss", "stage: kto", True, False,
             "off for stage: kto: its KL pass and losses read the policy's logits in full (the fused head returns "
             "the summed log-probs stage: dpo compares)"),
    Conflict("load_weights_on", "pipeline_parallel", True, False,
             "every_rank under pipeline_parallel: each process reads the files and keeps its stage's blocks"),
    Conflict("grad_sync", "pipeline_parallel", "ddp", "flat",
             "flat under pipeline_parallel: a stage's replicas average their gradients in one all-reduce after the "
             "schedule's last backward"),
)


Value = TypeVar("Value")


def give_way(lever: str, value: Value, cfg: TrainConfig, layout: Layout, why: dict[str, str]) -> Value:
    """`value` of `lever`, or what the first of its `CONFLICTS` that holds makes it, with that row's reason."""
    for row in CONFLICTS:
        if row.lever == lever and value == row.clashing and UNDER[row.under](cfg, layout):
            why[lever] = row.reason
            return row.instead
    return value


def resolve_levers(cfg: TrainConfig, env: DistEnv, layout: Layout, machine: Machine, why: dict[str, str]) -> dict:
    """Every speed lever of the run, with the reasons for those meshtune chose or turned off."""
    padding_free = cfg.padding_free if cfg.padding_free is not None else machine.varlen_available()
    padding_free = give_way("padding_free", padding_free, cfg, layout, why)
    recompute = give_way("gradient_checkpointing", recomputation(cfg, machine.memory_measurable(), why), cfg,
                         layout, why)
    # Q-LoRA sharded by FSDP2 with activation checkpointing: on CUDA (4 GPUs) the recompute of a compiled block saved
    # other tensors than its forward did (torch.utils.checkpoint's CheckpointError), so its blocks run uncompiled
    # there by default; on CPU the same trains one process's losses (tests/test_qlora.py), and on one GPU nothing is
    # sharded (Q-LoRA's zero3 on one process runs unwrapped and compiled)
    compile_clash = cfg.finetuning_type == "qlora" and layout.parallel in SHARDED and recompute != 0
    compile_ = cfg.torch_compile if cfg.torch_compile is not None else env.device.type == "cuda" and not compile_clash
    compile_ = give_way("torch_compile", compile_, cfg, layout, why)
    for key, value, default in (("padding_free", cfg.padding_free, "on with CUDA"),
                                ("torch_compile", cfg.torch_compile, "on with CUDA" + (
                                    "; off for Q-LoRA sharded by FSDP2 with activation checkpointing, whose "
                                    "compiled blocks fail their recompute" if compile_clash else ""))):
        if value is None and key not in why:  # a conflict's reason stands
            why[key] = f"default, {default}"
    masks = lora_dropout_masks(cfg, compile_ and recompute != 0, why)
    fused_loss = give_way("fused_loss", cfg.fused_loss, cfg, layout, why)
    if cfg.stage == "dpo" and fused_loss:
        why["fused_loss"] = ("stage: dpo: the head returns each response's summed log-prob under the policy, in row "
                             "chunks over the trained positions (their logits computed again in backward); the "
                             "reference's are summed the same way, without gradients")
    return dict(padding_free=padding_free, recompute=recompute, compile=compile_, fused_loss=fused_loss,
                lora_dropout_masks=masks,
                fused_adamw=fused_adamw(cfg, env, offloads(cfg, layout.parallel), why),
                gc_interval=gc_interval(cfg, env, why),
                weights_from_rank0=weights_from_rank0(cfg, env, layout, why))


def lora_dropout_masks(cfg: TrainConfig, recomputed_compiled: bool, why: dict[str, str]) -> str | None:
    """LoRA's dropout masks (None: no dropout). torch 2.11 cannot replay torch's dropout inside a compiled block's
    backward graph on CUDA (its partitioner fails), so such a block checkpoints in its call and runs its forward graph
    twice a step; counter masks are rebuilt from the block's seed inside the graph, so `auto` takes them there."""
    if not (cfg.is_lora and cfg.lora_dropout > 0):
        return None
    masks = cfg.lora_dropout_masks
    if masks == "auto":
        masks = "counter" if recomputed_compiled else "torch"
    if not recomputed_compiled:
        return masks
    if masks == "counter":
        reason = "counter masks: a recomputed block rebuilds lora_dropout's masks inside its compiled graph"
        why["lora_dropout_masks"] = f"auto: {reason}" if cfg.lora_dropout_masks == "auto" else reason
    else:
        why["lora_dropout_masks"] = (
            "torch's dropout: a recomputed block with lora_dropout checkpoints outside its compiled graph and runs "
            "it twice a step (torch 2.11 cannot replay torch's dropout inside one on CUDA); counter masks recompute "
            "inside")
    return masks


def memory_measurable(device: torch.device) -> bool:
    """Where a step's memory can be measured before training (the caching allocator's peaks): GPUs."""
    return device.type == "cuda"


def recomputation(cfg: TrainConfig, measurable: bool, why: dict[str, str]) -> float | str:
    """The share of blocks recomputed in backward, or MEASURE: the fewest that fit memory_budget, from steps measured
    before training. Left open, GPU runs measure (a step that fits recomputes nothing), CPU runs recompute nothing; a
    ratio given turns recomputation on; `gradient_checkpointing: false` never recomputes. `measurable`: whether
    this device's memory can be measured (`memory_measurable`)."""
    if cfg.gradient_checkpointing is False:
        return 0.0
    if cfg.gradient_checkpointing_ratio != "auto":
        return float(cfg.gradient_checkpointing_ratio)
    if cfg.gradient_checkpointing is None:
        why["gradient_checkpointing"] = ("default on GPUs: the largest step is measured before training and blocks are "
                                         "recomputed only where it would not fit memory_budget" if measurable else
                                         "default on CPU: nothing recomputed")
        return MEASURE if measurable else 0.0
    if not measurable:
        why["gradient_checkpointing"] = "ratio auto on CPU: every block (memory is measured on GPUs only)"
        return 1.0
    return MEASURE


def fused_adamw(cfg: TrainConfig, env: DistEnv, offload: bool, why: dict[str, str]) -> bool:
    """torch's fused AdamW: as `optim` says, or under auto on CUDA; master_weights: bf16 steps with its own."""
    fused = cfg.optim == "adamw_torch_fused" or (cfg.optim == "auto" and env.device.type == "cuda")
    if cfg.optim == "auto":
        why["optim"] = ("auto: fused on CUDA; the offloaded shards step in torch's fused CPU kernel" if
                        offload and fused else "auto: fused on CUDA")
    if cfg.master_weights == "bf16":
        why["optim"] = "master_weights: bf16 steps bf16 weights with stochastic rounding" + (
            "" if cfg.optim == "auto" else f", not {cfg.optim}")
    return fused


def gc_interval(cfg: TrainConfig, env: DistEnv, why: dict[str, str]) -> int:
    """Python's collector: every rank at the same steps on several processes, else automatic."""
    if cfg.gc_interval is not None:
        return cfg.gc_interval
    interval = 50 if env.world_size > 1 else 0
    why["gc_interval"] = ("default: all ranks collect at the same steps" if interval else
                          "default with one process: Python's automatic collection")
    return interval


def weights_from_rank0(cfg: TrainConfig, env: DistEnv, layout: Layout, why: dict[str, str]) -> bool:
    """Whether rank 0 reads the model files and the others receive its weights."""
    from_rank0 = env.world_size > 1 and cfg.load_weights_on == "rank0" and cfg.finetuning_type != "qlora"
    from_rank0 = give_way("load_weights_on", from_rank0, cfg, layout, why)
    if cfg.finetuning_type == "qlora":
        why["load_weights_on"] = ("qlora: each process reads the files block by block, quantizes each block and keeps "
                                  "its shard")
    return from_rank0
