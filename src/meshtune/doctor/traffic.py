"""What a config moves between the nodes each optimizer step, and how long that takes on a measured link.

The link between nodes is taken as the bottleneck (the GPUs of one node talk over NVLink or shared memory, far
faster), and a collective over p ranks as a ring, as nccl-tests models it: each node sends an all-reduce's S bytes
x 2(p-1)/p, an all-gather's or reduce-scatter's (the whole buffer) S x (p-1)/p, which takes that over busbw, the
all-reduce's measured bus bandwidth. A ring over every process of the job enters and leaves each node once a ring,
however many processes a node holds, so p is the collective's processes, not the nodes: ddp's all-reduce over
2 nodes x 8 GPUs sends 1.9 S out of each node, hsdp's all-reduce between the 2 replicas (each shard group its own
S / 8) S. On gloo (CPU) a reduce-scatter is an all-reduce on the wire (measured: bench/shaped_link.py). Per
optimizer step of A micro-steps (gradients cross once, on the last micro-step):

- ddp: one all-reduce of the trainable gradients (LoRA: the adapters only);
- zero2: one all-gather of the weights (in the first micro-step's forward; kept whole until the last micro-step's
  backward) + one reduce-scatter of the trainable gradients;
- zero3: A all-gathers for forward, A again for backward of all but what stays gathered in between (the last unit
  of blocks and the head; none with zero3_reshard_to_node, whose backward gathers inside the node) + one
  reduce-scatter;
- hsdp: sharded inside a node, only the all-reduce of the gradients between the replicas crosses nodes;
- pipeline_parallel (stages outermost, ddp replicas inside a stage): at a stage boundary between nodes each
  process's pipeline sends its micro-batches' activations forward (rows x length x hidden) and receives their
  gradients back, the same bytes; a node inside the pipeline sends both ways. With v stages a process
  (interleaved_1f1b) a micro-batch passes each node v times, the last node's forward and the first's backward
  v - 1 of them; zbv's V passes each boundary twice, down and back. Where a stage spans nodes, its replicas'
  all-reduce of the stage's gradients crosses them too.
PowerSGD (powersgd_rank) is not modelled: its factors depend on each matrix's shape.

Weights cross in bf16 on GPUs (FSDP2's parameter dtype; Q-LoRA's blocks as NF4), gradients in `grad_reduce_dtype`.
Compute is estimated for a step of full-length samples (cutoff_len tokens) at MFU_ASSUMED of the bf16 matmul rate
measured on node 0's GPU; on CPU no compute time is estimated. Communication overlaps compute at best (DDP's
buckets during backward, FSDP2's prefetch): above the compute time it sets the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtune.doctor.bandwidth import duration_text
from meshtune.plan import (EACH, NF4_BYTES, SHARDED, ModelSize, default_blocks_per_unit, gradient_reduction,
                           parallel_for, virtual_stages)
from meshtune.units import byte_size

MFU_ASSUMED = 0.4   # measured 36% for full 7B zero3 on 4 H100 (docs/benchmarks/one-gpu.md, 7B models)
SLOW_RATIO = 0.5    # communication above half the compute time: the network sets the pace


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of the model, from its config alone (no weights)."""

    size: ModelSize
    trainable: int        # the parameters whose gradients cross (LoRA: the adapters)
    dense: int            # parameters outside the input embedding (FLOPs per token)
    layers: int
    attention_width: int  # heads x head_dim
    hidden: int = 0       # the residual stream's width: what a pipeline stage sends the next, a token


@dataclass(frozen=True)
class Collective:
    kind: str      # all-reduce | all-gather | reduce-scatter
    what: str
    bytes: float
    times: int
    ranks: int = 0  # the processes of its ring; 0: one a node (the nodes)


def model_facts(cfg) -> ModelFacts:
    """The model built on the meta device (with LoRA's adapters when the config adds them) and counted."""
    from meshtune.model.flops import FlopCounter
    from meshtune.model.loading import model_skeleton, transformer_blocks
    from meshtune.model.lora import add_lora

    model = model_skeleton(cfg.model_name_or_path)
    counter = FlopCounter.of(model)
    blocks = transformer_blocks(model)
    size = ModelSize(sum(p.numel() for p in model.parameters()), sum(p.numel() for p in blocks[0].parameters()),
                     len(blocks))
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
                     gpu_bytes: float | None = None, per_node: int = 1, gloo: bool = False) -> list[Collective]:
    """The collectives that cross the nodes in one optimizer step (see the module's docstring), over `processes`
    of `per_node` a node; `gloo`: reduce-scatters move an all-reduce's bytes."""
    grad_bytes = 2 if cfg.grad_reduce_dtype == "bf16" else 4
    gradients = model.trainable * grad_bytes
    block_params = model.size.block_parameters * model.size.blocks
    if cfg.finetuning_type == "qlora":
        weights = NF4_BYTES * block_params + 2 * (model.size.parameters - block_params)
    else:
        weights = model.size.parameters * (2 if bf16 else 4)
    micro = cfg.gradient_accumulation_steps
    ranks = processes if processes > 1 else 0
    if getattr(cfg, "pipeline_parallel", 1) > 1:
        return pipeline_collectives(cfg, model, bf16, gradients, processes, per_node)
    if mode == "hsdp" and hsdp_in_node:
        return [Collective("all-reduce", "gradients", gradients, 1, ranks // per_node if ranks else 0)]
    if mode == "ddp":
        return [Collective("all-reduce", "gradients", gradients, 1, ranks)]
    reduction = gradient_reduction(cfg, processes, mode, micro, lambda: model.size, lambda: gpu_bytes, {})
    scatter = Collective("all-reduce" if gloo else "reduce-scatter", "gradients", gradients,
                         micro if reduction == EACH else 1, ranks)
    if mode == "zero2":  # the weights stay whole across the micro-steps
        return [Collective("all-gather", "weights", weights, 1, ranks), scatter]
    gathers = [Collective("all-gather", "weights", weights, micro, ranks)]
    if not (getattr(cfg, "zero3_reshard_to_node", False) and per_node > 1):  # else backward gathers inside the node
        again = weights * (1 - kept_for_backward(cfg, model.size))
        gathers.append(Collective("all-gather", "weights again for backward", again, micro, ranks))
    return [*gathers, scatter]


def pipeline_collectives(cfg, model: ModelFacts, bf16: bool, gradients: float, processes: int,
                         per_node: int) -> list[Collective]:
    """What crosses the nodes a step under pipeline_parallel (see the module's docstring): each process's pipeline
    carries per_device_train_batch_size x gradient_accumulation_steps rows of (at most) cutoff_len tokens."""
    pp = cfg.pipeline_parallel
    per_stage = max(processes // pp, 1)
    nodes = max(processes // max(per_node, 1), 1)
    if nodes == 1:
        return []
    tokens = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.cutoff_len
    activations = tokens * model.hidden * (2 if bf16 else 4) * min(per_node, per_stage)
    sent = [Collective("send", "activations forward and their gradients back", activations,
                       pipeline_crossings(cfg, min(pp, nodes)))]
    if per_stage > per_node:  # a stage's replicas on several nodes
        sent.append(Collective("all-reduce", "a stage's gradients", gradients / pp, 1, per_stage))
    return sent


def pipeline_crossings(cfg, nodes: int) -> int:
    """How many times the busiest of `nodes` pipeline nodes sends a micro-batch's activations or their gradients:
    a node between two others sends both ways (one stage a process: 2, the two end nodes 1 each); with v stages a
    process each direction v times, an end node's one v - 1; zbv's V twice each way inside, once at its turn."""
    if getattr(cfg, "pipeline_schedule", None) == "zbv":
        return 4 if nodes > 2 else 2
    virtual = virtual_stages(cfg)
    return 2 * virtual if nodes > 2 else 2 * virtual - 1


def kept_for_backward(cfg, size: ModelSize) -> float:
    """The share of the weights zero3 keeps gathered from forward to backward (model/parallel.py): the last unit of
    blocks and the head (a unit of its own, or with tied embeddings the root's), which backward needs first."""
    per_unit = cfg.fsdp_blocks_per_unit or default_blocks_per_unit(size.block_parameters)
    last_unit = (size.blocks - 1) % per_unit + 1
    head = max(size.parameters - size.block_parameters * size.blocks, 0) / (1 if size.tied_embeddings else 2)
    return min(1.0, (last_unit * size.block_parameters + head) / max(size.parameters, 1))


def sent_by_each_node(collectives: list[Collective], nodes: int) -> float:
    """The bytes each node sends a step: a ring's share of each collective (see the module's docstring)."""
    def share(c: Collective) -> float:
        if c.kind == "send":  # point to point: the bytes themselves
            return 1.0
        p = c.ranks or nodes
        return (2 if c.kind == "all-reduce" else 1) * (p - 1) / p
    return sum(c.bytes * c.times * share(c) for c in collectives)


def collective_seconds(collectives: list[Collective], busbw: float, nodes: int) -> float:
    return sent_by_each_node(collectives, nodes) / busbw


def compute_seconds(cfg, model: ModelFacts, peak_flops: float | None) -> float | None:
    """One process's compute for a step of full-length samples: 6 FLOPs a dense parameter a token (LoRA 4: the
    frozen weights need no weight gradient), + 2 recomputed under activation checkpointing, + attention."""
    if not peak_flops:
        return None
    tokens = cfg.cutoff_len
    per_token = (4 if cfg.is_lora else 6) * model.dense
    if cfg.gradient_checkpointing and cfg.named_recompute_ratio is not None:  # auto: none counted, the least
        per_token += 2 * model.dense * cfg.named_recompute_ratio  # compute it may choose to hide traffic behind
    per_sample = per_token * tokens + 12 * model.layers * model.attention_width * tokens * tokens
    samples = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return per_sample * samples / (peak_flops * MFU_ASSUMED)


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
    bf16 = gpus and cfg.bf16 is not False
    hsdp_in_node = (cfg.hsdp_shard_size or nproc) <= nproc
    collectives = step_collectives(cfg, mode, model, bf16, hsdp_in_node, processes, gpu_bytes, nproc, not gpus)
    seconds = collective_seconds(collectives, busbw, nodes)
    compute = compute_seconds(cfg, model, peak_flops)
    ratio = seconds / compute if compute else None
    others = {other: collective_seconds(step_collectives(cfg, other, model, bf16, True, processes, gpu_bytes, nproc,
                                                         not gpus), busbw, nodes)
              for other in ("ddp", "zero2", "hsdp", "zero3") if other != mode}
    return {"parallel": mode, "auto": bool(how), "collectives": [c.__dict__ for c in collectives],
            "comm_s": seconds, "compute_s": compute, "ratio": ratio, "busbw": busbw, "nodes": nodes,
            "slow": ratio is not None and ratio > SLOW_RATIO,
            "text": explain(cfg, mode + how, collectives, seconds, compute, busbw, nodes),
            "advice": advice(cfg, mode, seconds, others) if ratio is not None and ratio > SLOW_RATIO else None}


def explain(cfg, mode: str, collectives: list[Collective], seconds: float, compute: float | None, busbw: float,
            nodes: int) -> str:
    text = (f"{cfg.finetuning_type} fine-tuning under {mode} moves {describe(collectives)} across the {nodes} nodes "
            f"each optimizer step ({cfg.gradient_accumulation_steps} micro-step(s)): ~{duration_text(seconds)} at "
            f"{busbw / 1e9:.3g} GB/s busbw")
    if compute is None:
        return text + "; no compute estimate without GPUs"
    return (text + f", {seconds / compute:.2g}x the ~{duration_text(compute)} a step of full-length samples "
                   f"({cfg.cutoff_len} tokens) computes at {MFU_ASSUMED:.0%} of the measured bf16 peak")


def advice(cfg, mode: str, seconds: float, others: dict[str, float]) -> str:
    tips = []
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
