"""What a config moves between the nodes each optimizer step, and how long that takes on a measured link.

The bytes and the overlap are meshtune.crossing's arithmetic (its docstring says what crosses in each mode); this
module fills it in from a config, the model built on the meta device and the doctor's facts, and judges the
crossing's seconds at the measured busbw against an estimated step. Weights cross in bf16 on GPUs (FSDP2's
parameter dtype; Q-LoRA's blocks as NF4), gradients in `grad_reduce_dtype`. Compute is estimated for a step of
full-length samples (cutoff_len tokens) at MFU_ASSUMED of the bf16 matmul rate measured on node 0's GPU; on CPU the
step is not judged, but with link_gbps the mode is chosen as the plan chooses it, from a process's fp32 rate on its
share of node 0's cores. Communication overlaps compute at best (DDP's buckets during backward, FSDP2's
prefetch): above the compute time it sets the step time.
"""

from __future__ import annotations

from meshtune.crossing import (MFU_ASSUMED, Collective, ModelFacts, ModelSize, collective_seconds, compute_seconds,
                               full_model_facts)
from meshtune.crossing import step_collectives as crossing_collectives
from meshtune.doctor.bandwidth import duration_text
from meshtune.hardware import host_bytes_a_process
from meshtune.plan import (EACH, LINK_EFFICIENCY, SHARDED, gradient_reduction, link_applies, parallel_for,
                           pick_by_link)
from meshtune.units import byte_size

SLOW_RATIO = 0.5    # communication above half the compute time: the network sets the pace


def model_facts(cfg) -> ModelFacts:
    """The model built on the meta device (with LoRA's adapters when the config adds them) and counted."""
    from meshtune.model.flops import FlopCounter
    from meshtune.model.loading import model_size, model_skeleton
    from meshtune.model.lora import add_lora

    model = model_skeleton(cfg.model_name_or_path)
    counter = FlopCounter.of(model)
    size = model_size(cfg.model_name_or_path)  # as the plan reads it
    trainable = size.parameters
    if cfg.is_lora:
        trainable = sum(p.numel() for p in add_lora(model, cfg).parameters() if p.requires_grad)
    return ModelFacts(size, trainable, counter.dense_params, counter.layers, counter.heads * counter.head_dim,
                      model.config.hidden_size)


def parallel_mode(cfg, processes: int, per_node: int, gpus: bool, gpu_bytes: float | None,
                  size: ModelSize) -> tuple[str, str]:
    """The parallel mode the run plan will choose (plan.parallel_for, from the doctor's facts), and how."""
    mode, _ = parallel_for(cfg, processes, per_node, gpus and gpu_bytes is not None, lambda: gpu_bytes, lambda: size)
    return mode, " (auto)" if cfg.named_parallel is None else ""


def step_collectives(cfg, mode: str, model: ModelFacts, bf16: bool, hsdp_in_node: bool, processes: int = 1,
                     gpu_bytes: float | None = None, per_node: int = 1, gloo: bool = False,
                     pipeline: int | None = None, micro: int | None = None) -> list[Collective]:
    """The collectives that cross the nodes in one optimizer step of this config (meshtune.crossing's), over
    `processes` of `per_node` a node, with the gradients reduced when the plan would reduce them; `gloo`:
    reduce-scatters move an all-reduce's bytes; `pipeline` stages over `micro` micro-batches where the plan sets
    them (default: the config's)."""
    micro = micro or cfg.gradient_accumulation_steps
    each = mode in ("zero2", "zero3") and gradient_reduction(cfg, processes, mode, micro, lambda: model.size,
                                                             lambda: gpu_bytes, {}) == EACH
    return crossing_collectives(cfg, mode, model, bf16, hsdp_in_node, processes, per_node, gloo, each, pipeline,
                                micro)


def describe(collectives: list[Collective]) -> str:
    parts = []
    for c in collectives:
        times = f"{c.times} x " if c.times > 1 else ""
        parts.append(f"{times}{c.kind} of the {c.what} ({byte_size(c.bytes)})")
    return " + ".join(parts)


def verdict(cfg, nodes: int, nproc: int, gpus: bool, gpu_bytes: float | None, busbw: float,
            peak_flops: float | None, model: ModelFacts) -> dict:
    """The communication a step of this config needs across `nodes` at `busbw`, against its compute; `slow` when
    it would set the step time, with the modes that would move less."""
    processes = nodes * nproc
    mode, how = parallel_mode(cfg, processes, nproc, gpus, gpu_bytes, model.size)
    stages = 1
    # the plan's choice by link_gbps: a GPU's compute from node 0's bf16 rate; a CPU process's from the fp32 rate of
    # one process on its share of node 0's cores, its state against its share of the host's memory
    card = gpu_bytes if gpus else host_bytes_a_process(nproc)
    if link_applies(cfg, nodes) and card and peak_flops:
        choice, _, _ = pick_by_link(cfg, processes, nproc, model.size, card,
                                    compute_seconds(cfg, full_model_facts(model.size), peak_flops, gpus), gpus)
        mode, stages = choice.mode, choice.pipeline
        if choice.schedule:  # the pipeline's schedule sets how often its activations cross
            cfg = cfg.model_copy(update={"pipeline_schedule": choice.schedule})
        how = (f" inside pipeline_parallel {stages}" if stages > 1 else "") + f" (auto by link_gbps {cfg.link_gbps:g})"
    bf16 = gpus and cfg.bf16 is not False
    hsdp_in_node = (cfg.hsdp_shard_size or nproc) <= nproc
    collectives = step_collectives(cfg, mode, model, bf16, hsdp_in_node, processes, gpu_bytes, nproc, not gpus,
                                   stages, cfg.gradient_accumulation_steps * stages)
    seconds = collective_seconds(collectives, busbw, nodes)
    compute = compute_seconds(cfg, model, peak_flops) if gpus else None  # a CPU job's step is not judged
    ratio = seconds / compute if compute else None
    others = {other: collective_seconds(step_collectives(cfg, other, model, bf16, True, processes, gpu_bytes, nproc,
                                                         not gpus), busbw, nodes)
              for other in ("ddp", "zero2", "hsdp", "zero3") if other != mode}
    return {"parallel": mode, "auto": bool(how), "collectives": [c.__dict__ for c in collectives],
            "comm_s": seconds, "compute_s": compute, "ratio": ratio, "busbw": busbw, "nodes": nodes,
            "slow": ratio is not None and ratio > SLOW_RATIO,
            "text": explain(cfg, mode + how, collectives, seconds, compute, busbw, nodes),
            "advice": advice(cfg, mode, seconds, others, busbw) if ratio is not None and ratio > SLOW_RATIO else None}


def explain(cfg, mode: str, collectives: list[Collective], seconds: float, compute: float | None, busbw: float,
            nodes: int) -> str:
    text = (f"{cfg.finetuning_type} fine-tuning under {mode} moves {describe(collectives)} across the {nodes} nodes "
            f"each optimizer step ({cfg.gradient_accumulation_steps} micro-step(s)): ~{duration_text(seconds)} at "
            f"{busbw / 1e9:.3g} GB/s busbw")
    if compute is None:
        return text + "; no compute estimate without GPUs"
    return (text + f", {seconds / compute:.2g}x the ~{duration_text(compute)} a step of full-length samples "
                   f"({cfg.cutoff_len} tokens) computes at {MFU_ASSUMED:.0%} of the measured bf16 peak")


def advice(cfg, mode: str, seconds: float, others: dict[str, float], busbw: float | None = None) -> str:
    tips = []
    if busbw and not cfg.is_lora and cfg.link_gbps is None and cfg.named_parallel is None:
        tips.append(f"link_gbps: {link_gbps_of(busbw):.3g} (this link) lets parallel: auto choose by the bytes, a "
                    f"pipeline stage a node among them")
    if cfg.is_lora and mode in SHARDED:
        tips.append(f"parallel: ddp moves only the adapters' gradients (~{duration_text(others['ddp'])})")
    elif mode in ("zero3", "zero2"):
        tips.append(f"parallel: hsdp shards inside each node, so only the gradient all-reduce crosses nodes "
                    f"(~{duration_text(others['hsdp'])}, if the model's state fits one node)")
        if mode == "zero3":
            tips.append(f"zero2 gathers the weights once a step, not twice a micro-step "
                        f"(~{duration_text(others['zero2'])})")
    if not cfg.is_lora:
        tips.append("LoRA (finetuning_type: lora) moves only the adapters' gradients")
    if cfg.grad_reduce_dtype == "fp32":
        tips.append("grad_reduce_dtype: bf16 halves the gradients' bytes")
    if mode in ("ddp", "hsdp"):
        tips.append("more gradient_accumulation_steps gives each crossing of the gradients more compute to hide behind")
    return f"the network sets the pace (~{duration_text(seconds)} a step): " + "; ".join(tips)


def link_gbps_of(busbw: float) -> float:
    """The line rate a measured all-reduce busbw (bytes/s) stands for, as the plan reads link_gbps."""
    return busbw * 8 / 1e9 / LINK_EFFICIENCY
