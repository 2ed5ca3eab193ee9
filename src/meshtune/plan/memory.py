"""The one estimate of what a GPU holds of the model's state (`full_state_bytes`; Q-LoRA's 4-bit base is
crossing.py's `qlora_weight_bytes`, the bytes its gathers move), and the choices that read it: the sharding mode
`auto` picks, FSDP2's units and resharding, cpu_offload, and when gradients cross under accumulation. The doctor and
bench/scaling_model.py read the same estimate."""

from __future__ import annotations

from collections.abc import Callable

from meshtune.config import TrainConfig
from meshtune.crossing import MAX_BLOCKS_PER_UNIT, ModelSize, default_blocks_per_unit, qlora_weight_bytes
from meshtune.distributed import DistEnv
from meshtune.plan.run_plan import EACH, ONCE, SHARD_EACH, SHARDED, Layout, Machine


def full_state_bytes(cfg: TrainConfig, n_params: int, shards: int, whole_weights: bool,
                     unsharded_grads: bool = False) -> float:
    """One GPU's bytes of full fine-tuning's model state, the one estimate every choice of the plan reads: the bf16
    weights where they stay whole (zero2, hsdp keeping them from forward to backward), the process's shard of the
    state (16 bytes a parameter in fp32: weights, gradients, two AdamW moments; 8 with `master_weights: bf16`), and
    gradients held unsharded under accumulation without sync (4 bytes a parameter, as FSDP2 accumulates them)."""
    state = 8 if cfg.master_weights == "bf16" else 16
    return (2 * n_params if whole_weights else 0) + state * n_params / shards + (4 * n_params if unsharded_grads else 0)


def sharding_for_full(cfg: TrainConfig, n_params: int, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """zero2 unless its whole bf16 weights plus its share of the state (`full_state_bytes`) would take over half of
    a GPU's memory."""
    zero2_bytes = full_state_bytes(cfg, n_params, world_size, whole_weights=True)
    share = f"{zero2_bytes / 2**30:.1f} GiB of weights and state per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if zero2_bytes <= 0.5 * gpu_bytes:
        return "zero2", f"full fine-tuning on {world_size} GPUs, {share}"
    return "zero3", f"full fine-tuning on {world_size} GPUs; zero2 would hold {share}"


def sharding_for_qlora(size: ModelSize, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """Q-LoRA under ddp keeps the whole 4-bit model on every GPU: its block weights in NF4, embeddings and head in
    bf16. Where that would take over half of the smallest GPU (activations and the adapters' state need the rest),
    zero3 shards it over the processes, as zero3 does for full fine-tuning."""
    whole = qlora_weight_bytes(size)
    held = f"{whole / 2**30:.1f} GiB of 4-bit model per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if whole <= 0.5 * gpu_bytes:
        return "ddp", f"Q-LoRA: {held}; only the adapters' gradients are all-reduced"
    return "zero3", (f"Q-LoRA: ddp would hold {held}; zero3 shards it, "
                     f"{whole / world_size / 2**30:.1f} GiB per GPU over {world_size}")


def reshard_after_forward(cfg: TrainConfig, parallel: str, shard: int | None, model_size: Callable[[], ModelSize],
                          gpu_bytes: Callable[[], float | None], why: dict[str, str]) -> bool | None:
    """Whether FSDP2 frees each unit's gathered weights after its forward and gathers them again for backward: zero3
    does (least memory), zero2 does not (one gather a micro-step). hsdp gathers inside a node, over its fast links:
    for full fine-tuning it keeps the weights like zero2 where the node's GPUs hold them with the state, else
    reshards like zero3; LoRA and Q-LoRA reshard (their point is memory). Whatever the mode, the last unit, the head
    and the root keep theirs: backward needs them first (model/parallel.py). Weights kept from forward to backward
    also stay whole from one micro-step to the next under gradient accumulation (parallel.py's gradient_sync)."""
    if parallel not in SHARDED:
        return None
    if parallel != "hsdp":
        return parallel == "zero3"
    if cfg.is_lora:
        return True
    card = gpu_bytes()
    keep = ("hsdp, full fine-tuning: each replica's processes keep every unit's weights from forward to backward, "
            "as zero2")
    if card is None:
        why["reshard_after_forward"] = keep
        return False
    n_params = model_size().parameters
    held = full_state_bytes(cfg, n_params, shard, whole_weights=True)
    if held <= 0.5 * card:
        why["reshard_after_forward"] = (f"{keep} ({held / 2**30:.1f} GiB of weights and state per GPU of "
                                        f"{card / 2**30:.0f} GiB)")
        return False
    why["reshard_after_forward"] = (f"hsdp, full fine-tuning: whole weights and state would take {held / 2**30:.1f} "
                                    f"GiB per GPU of {card / 2**30:.0f} GiB; gathered again for backward, as zero3")
    return True


def reshard_to_node(cfg: TrainConfig, parallel: str, reshard: bool | None, procs: DistEnv, model_parallel: int,
                    why: dict[str, str]) -> bool | int | None:
    """`zero3_reshard_to_node`: zero3's units resharded after forward to the processes of one node (FSDP2's
    reshard_after_forward as an int), so that backward gathers them inside the node; the ranks of a node are
    consecutive, which is how FSDP2 groups them."""
    if not cfg.zero3_reshard_to_node:
        return reshard
    per_node = procs.local_world_size
    if parallel != "zero3":
        why["zero3_reshard_to_node"] = (f"{parallel}: not applied; it reshards zero3's units" + (
            " (hsdp gathers inside a node already)" if parallel == "hsdp" else ""))
    elif model_parallel > 1:
        why["zero3_reshard_to_node"] = "not applied under tensor or context parallel: FSDP2 shards over a sub-mesh"
    elif procs.world_size == per_node:
        why["zero3_reshard_to_node"] = "one node: every gather stays inside it already; resharded as zero3"
    elif per_node == 1:
        why["zero3_reshard_to_node"] = "one process a node: a node's share is the process's own; resharded as zero3"
    else:
        why["reshard_after_forward"] = (f"zero3_reshard_to_node: after forward each unit keeps the weights of its "
                                        f"node's {per_node} processes, so backward's all-gathers stay inside the node")
        return per_node
    return reshard


def gradient_reduction(cfg: TrainConfig, world_size: int, parallel: str, accumulation: int,
                       model_size: Callable[[], ModelSize], gpu_bytes: Callable[[], float | None],
                       why: dict[str, str]) -> str:
    """When gradients cross the processes under gradient accumulation. Once an optimizer step where memory allows:
    each process accumulates its own until the last micro-step (DDP's no_sync; FSDP2 without gradient sync, which
    holds them unsharded in fp32, 4 bytes a trainable parameter). hsdp reduce-scatters inside each replica every
    micro-step (a node's fast links) and all-reduces across the replicas, the slow links, once. zero2 (or zero3)
    full fine-tuning reduce-scatters every micro-step unless the unsharded gradients fit beside its weights and
    state: zero2 unless the GPU is known too small, zero3 only where it is known large enough."""
    if accumulation == 1 or world_size == 1:
        return ONCE
    if parallel == "ddp":
        why["gradient_reduction"] = "ddp: all-reduced on the last micro-step only (no_sync before it)"
        return ONCE
    if parallel == "hsdp":
        why["gradient_reduction"] = ("hsdp: reduce-scattered inside each replica every micro-step, all-reduced "
                                     "across the replicas on the last only")
        return SHARD_EACH
    if cfg.is_lora:
        why["gradient_reduction"] = f"{parallel}: reduced on the last micro-step only (the adapters' gradients)"
        return ONCE
    card = gpu_bytes()
    if card is None:
        once = parallel == "zero2"
        verdict = "no GPU to hold"
    else:
        n_params = model_size().parameters
        held = full_state_bytes(cfg, n_params, world_size, whole_weights=parallel == "zero2", unsharded_grads=True)
        once = held <= 0.5 * card
        verdict = f"{held / 2**30:.1f} GiB per GPU of {card / 2**30:.0f} GiB with unsharded fp32 gradients"
    if once:
        why["gradient_reduction"] = f"{parallel}: reduced on the last micro-step only ({verdict})"
        return ONCE
    why["gradient_reduction"] = f"{parallel}: reduce-scattered every micro-step, so gradients stay sharded ({verdict})"
    return EACH


def offload_reason(cfg: TrainConfig, n_params: int, shards: int, env: DistEnv) -> str:
    """What cpu_offload moves to host memory, and how much of it one node holds: each process keeps its shard
    (1 / `shards` of the model) of the fp32 weights, and for full fine-tuning their gradients and two Adam moments
    too (`full_state_bytes`; LoRA's frozen base 4 bytes a parameter, its adapters a few MB). The GPU keeps the
    gathered units and the activations only."""
    shard_bytes = 4 * n_params / shards if cfg.is_lora else full_state_bytes(cfg, n_params, shards, whole_weights=False)
    node_bytes = shard_bytes * env.local_world_size
    size = f"{node_bytes / 2**30:.1f} GiB" if node_bytes >= 2**30 else f"{node_bytes / 2**20:.1f} MiB"
    if env.device.type != "cuda":
        return (f"CPU processes: every tensor is in host memory already (~{size} of shards a node); FSDP2's "
                f"offload path runs unpinned and saves nothing")
    held = "weights" if cfg.is_lora else "weights, gradients and optimizer state"
    return (f"FSDP2 CPUOffloadPolicy: the shards' {held} in pinned host memory, ~{size} a node, copied to the GPU "
            f"for each all-gather; the optimizer steps on the CPU")


def offloads(cfg: TrainConfig, parallel: str) -> bool:
    """FSDP2's offload: a mode that runs as ddp (LoRA's zero2) has no shards to keep in host memory."""
    return cfg.cpu_offload and parallel in SHARDED


def blocks_per_unit(cfg: TrainConfig, parallel: str, model_size: Callable[[], ModelSize],
                    why: dict[str, str]) -> int | None:
    """Consecutive blocks per FSDP2 unit: the config's, or up to MAX_BLOCKS_PER_UNIT within ~1B parameters."""
    if parallel not in SHARDED:
        return None
    if cfg.fsdp_blocks_per_unit is None:
        why["fsdp_blocks_per_unit"] = f"default: up to {MAX_BLOCKS_PER_UNIT} blocks within ~1B parameters a unit"
    return cfg.fsdp_blocks_per_unit or default_blocks_per_unit(model_size().block_parameters)


def resolve_memory(cfg: TrainConfig, layout: Layout, accumulation: int, machine: Machine,
                   why: dict[str, str]) -> dict:
    """What a GPU holds and when it lets go of it, each judged by `full_state_bytes`: FSDP2's units, whether they
    reshard after forward (to a node's processes with zero3_reshard_to_node), what cpu_offload keeps in host
    memory, and when gradients are reduced under accumulation."""
    parallel, procs = layout.parallel, layout.procs
    units = blocks_per_unit(cfg, parallel, machine.model_size, why)
    reshard = False if layout.replicas_only else reshard_after_forward(
        cfg, parallel, layout.hsdp_shard, machine.model_size, machine.gpu_bytes, why)
    offload = offloads(cfg, parallel)
    if offload:  # the config allows it with zero2 / zero3 / hsdp only
        why["cpu_offload"] = offload_reason(cfg, machine.model_size().parameters,
                                            layout.hsdp_shard or procs.world_size, procs)
    elif cfg.cpu_offload:
        why["cpu_offload"] = (f"{cfg.parallel} with {cfg.finetuning_type} runs as {parallel}, where FSDP2's offload "
                              f"has no shards to move: the frozen base stays on the GPU, as under DeepSpeed's ZeRO-2, "
                              f"and what ZeRO-2's offload would move, the adapters' gradients and AdamW moments, is "
                              f"a few MB")
    reduction = gradient_reduction(cfg, procs.world_size, parallel, accumulation, machine.model_size,
                                   machine.gpu_bytes, why)
    reshard = reshard_to_node(cfg, parallel, reshard, procs, layout.model_parallel, why)
    return dict(blocks_per_unit=units, reshard_after_forward=reshard, cpu_offload=offload,
                gradient_reduction=reduction)
