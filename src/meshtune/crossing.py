"""What a step moves between the nodes, and how much of it the step hides: the one copy of the arithmetic that the
run plan (`parallel: auto` on a link of `link_gbps`), the doctor (doctor/traffic.py) and the projections
(bench/scaling_model.py) read.

Bytes. The link between nodes is taken as the bottleneck (the GPUs of one node talk over NVLink or shared memory,
far faster), and a collective over p ranks as a ring, as nccl-tests models it: each node sends an all-reduce's S
bytes x 2(p-1)/p, an all-gather's or reduce-scatter's (the whole buffer) S x (p-1)/p. A ring over every process of
the job enters and leaves each node once a ring, however many processes a node holds, so p is the collective's
processes, not the nodes: ddp's all-reduce over 2 nodes x 8 GPUs sends 1.9 S out of each node, hsdp's all-reduce
between the 2 replicas (each shard group its own S / 8) S. On gloo (CPU) a reduce-scatter is an all-reduce on the
wire. Per optimizer step of A micro-steps (checked against the interfaces' counters: bench/shaped_link.py):

- ddp: one all-reduce of the trainable gradients (LoRA: the adapters only);
- zero2: one all-gather of the weights (in the first micro-step's forward; kept whole until the last micro-step's
  backward) + one reduce-scatter of the trainable gradients (every micro-step where they stay sharded);
- zero3: A all-gathers for forward, A again for backward of all but what stays gathered in between (the last unit
  of blocks and the head; none with zero3_reshard_to_node, whose backward gathers inside the node) + the
  reduce-scatter;
- hsdp: sharded inside a node, only the all-reduce of the gradients between the replicas crosses nodes;
- pipeline_parallel (stages outermost, data-parallel inside a stage): at a stage boundary between nodes each
  process's pipeline sends its micro-batches' activations forward (rows x length x hidden) and receives their
  gradients back, the same bytes; a node inside the pipeline sends both ways. With v stages a process
  (interleaved_1f1b) a micro-batch passes each node v times, the last node's forward and the first's backward v - 1
  of them; zbv's V passes each boundary twice, down and back. Where a stage spans nodes, its replicas' all-reduce of
  the stage's gradients crosses them too.
PowerSGD (powersgd_rank) is not modelled: its factors depend on each matrix's shape.

Time. A GPU's compute for a step is estimated from its FLOPs at MFU_ASSUMED of a bf16 matmul rate (a CPU
process's at CPU_EFFICIENCY_ASSUMED of the fp32 rate its node's processes measure together). The gradients cross once
an optimizer step (or once a micro-step where they stay sharded), during that micro-step's backward (BACKWARD_SHARE of
its compute); what does not fit that window is exposed, and at least the last unit's share always is (it starts when
backward ends). The weights' gathers overlap the rest of the step. On CPU nothing is hidden: gloo's collectives run on
the cores that compute (on a shaped link the step grew by its bytes' time on the wire, docs/benchmarks/network.md).

A pipeline's step is simulated from the order torch.distributed.pipelining runs (`schedule_actions`): each rank's
forwards (F) and backwards, whole (B) or split into the input's gradient (I) and the weights' (W, zbv), over the
micro-batches. An action starts when its rank is free and its input is there: a stage's F of micro-batch i waits for
the previous stage's F of i, its backward for the next stage's input gradient of i, one hop later where the two
stages sit on different processes (a hop: one micro-batch's activations of a node's processes over the link). Each
stage's cost comes from its FLOPs (`stage_costs`): a block's matmuls 2 a parameter a token in F, in I and in W alike
(W none under LoRA, whose frozen weights take no gradient), attention's 4 x width x length a token in F and twice
that in I, recomputation another F in I, the head (and its weight's gradient) on the last stage; scaled so that the
ranks' mean compute is the step's compute estimate. The step is the slowest rank's finish, or the link's time for
all the sends where that is longer; the bubble is what the finish adds over the busiest rank's compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

UNIT_PARAMS = 1_000_000_000  # an FSDP2 unit's parameters, at most, when the config leaves blocks per unit open
MAX_BLOCKS_PER_UNIT = 4       # the largest unit measured (docs/benchmarks/where-the-time-goes.md)
NF4_BYTES = 0.5 + 1 / 64  # a 4-bit value, and an 8-bit scale per 64 of them (the scales' own scales are negligible)
MFU_ASSUMED = 0.4   # measured 36% for full 7B zero3 on 4 H100 (docs/benchmarks/one-gpu.md, 7B models)
CPU_EFFICIENCY_ASSUMED = 0.5  # of the fp32 matmul rate measured together: 0.53 (docs/benchmarks/network.md)
BACKWARD_SHARE = 2 / 3  # of a micro-step's compute: backward is about twice forward's FLOPs


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs to know of the model, read from its config alone (no weights)."""

    parameters: int
    block_parameters: int  # one transformer block's
    blocks: int = 1        # transformer blocks
    attention_heads: int = 0   # query heads of each block's attention (0: unknown)
    kv_heads: int = 0          # key-value heads
    model_type: str = ""       # the config's model_type (qwen2, llama, ...)
    tied_embeddings: bool = False  # the output head is the input embedding
    hidden: int = 0            # the residual stream's width: what a pipeline stage sends the next, a token
    head_parameters: int = 0   # the output head's (vocabulary x hidden; 0: unknown)


@dataclass(frozen=True)
class ModelFacts:
    """What the estimates need of the model, from its config alone (no weights)."""

    size: ModelSize
    trainable: int        # the parameters whose gradients cross (LoRA: the adapters)
    dense: int            # parameters outside the input embedding (FLOPs per token)
    layers: int
    attention_width: int  # heads x head_dim
    hidden: int = 0       # the residual stream's width: what a pipeline stage sends the next, a token


def full_model_facts(size: ModelSize) -> ModelFacts:
    """Full fine-tuning's facts from the plan's ModelSize: every parameter trains; the FLOPs a token are the blocks'
    and the head's (the parameters outside the blocks are the embedding and the head, one weight where tied), and the
    attention's width is taken as the hidden size (heads x head_dim, as in Qwen2 and Llama)."""
    outside = max(size.parameters - size.block_parameters * size.blocks, 0)
    head = 0 if size.tied_embeddings else outside // 2
    dense = size.block_parameters * size.blocks + (outside if size.tied_embeddings else head)
    return ModelFacts(size, size.parameters, dense, size.blocks, size.hidden, size.hidden)


def default_blocks_per_unit(block_parameters: int) -> int:
    """Blocks per FSDP2 unit when the config leaves it open: each unit's hooks and collectives cost host time, and
    the ranks wait for the slowest host at every collective, so fewer, larger units run faster. The cap keeps what
    zero3 gathers at once (a unit, and the next one prefetched) small beside the GPU: 72B's 0.9B-parameter blocks
    stay one a unit."""
    return max(1, min(MAX_BLOCKS_PER_UNIT, UNIT_PARAMS // max(block_parameters, 1)))


def qlora_weight_bytes(size: ModelSize) -> float:
    """Q-LoRA's whole base: block weights in NF4, embeddings and head in bf16 (what a GPU holds of it under ddp, and
    what its gathers move)."""
    block_params = size.block_parameters * size.blocks
    return NF4_BYTES * block_params + 2 * (size.parameters - block_params)


def fsdp_units(size: ModelSize, blocks_per_unit: int | None = None) -> int:
    """FSDP2's units of blocks (`fsdp_blocks_per_unit`, else the default): the last one's gradients cross only
    once backward ends, so their share of a crossing is never hidden."""
    return max(1, size.blocks // (blocks_per_unit or default_blocks_per_unit(size.block_parameters)))


@dataclass(frozen=True)
class Collective:
    kind: str      # all-reduce | all-gather | reduce-scatter | send
    what: str
    bytes: float
    times: int
    ranks: int = 0  # the processes of its ring; 0: one a node (the nodes)


def step_collectives(cfg, mode: str, model: ModelFacts, bf16: bool, hsdp_in_node: bool, processes: int = 1,
                     per_node: int = 1, gloo: bool = False, reduce_each: bool = False, pipeline: int | None = None,
                     micro: int | None = None) -> list[Collective]:
    """The collectives that cross the nodes in one optimizer step (see the module's docstring), over `processes`
    of `per_node` a node; `gloo`: reduce-scatters move an all-reduce's bytes; `reduce_each`: sharded gradients
    reduce-scattered every micro-step; `pipeline` stages (default: the config's) over `micro` micro-batches a step
    (default: gradient_accumulation_steps)."""
    grad_bytes = 2 if cfg.grad_reduce_dtype == "bf16" else 4
    gradients = model.trainable * grad_bytes
    if cfg.finetuning_type == "qlora":
        weights = qlora_weight_bytes(model.size)
    else:
        weights = model.size.parameters * (2 if bf16 else 4)
    micro = micro or cfg.gradient_accumulation_steps
    ranks = processes if processes > 1 else 0
    pipeline = pipeline or getattr(cfg, "pipeline_parallel", 1)
    if pipeline > 1:
        return pipeline_collectives(cfg, model, bf16, gradients, processes, per_node, pipeline, micro)
    if mode == "hsdp" and hsdp_in_node:
        return [Collective("all-reduce", "gradients", gradients, 1, ranks // per_node if ranks else 0)]
    if mode == "ddp":
        return [Collective("all-reduce", "gradients", gradients, 1, ranks)]
    scatter = Collective("all-reduce" if gloo else "reduce-scatter", "gradients", gradients,
                         micro if reduce_each else 1, ranks)
    if mode == "zero2":  # the weights stay whole across the micro-steps
        return [Collective("all-gather", "weights", weights, 1, ranks), scatter]
    gathers = [Collective("all-gather", "weights", weights, micro, ranks)]
    if not (getattr(cfg, "zero3_reshard_to_node", False) and per_node > 1):  # else backward gathers inside the node
        again = weights * (1 - kept_for_backward(cfg, model.size))
        gathers.append(Collective("all-gather", "weights again for backward", again, micro, ranks))
    return [*gathers, scatter]


def pipeline_collectives(cfg, model: ModelFacts, bf16: bool, gradients: float, processes: int, per_node: int,
                         pp: int, micro: int) -> list[Collective]:
    """What crosses the nodes a step under `pp` pipeline stages (see the module's docstring): each process's
    pipeline carries per_device_train_batch_size x `micro` rows of (at most) cutoff_len tokens."""
    per_stage = max(processes // pp, 1)
    nodes = max(processes // max(per_node, 1), 1)
    if nodes == 1:
        return []
    tokens = cfg.per_device_train_batch_size * micro * cfg.cutoff_len
    activations = tokens * model.hidden * (2 if bf16 else 4) * min(per_node, per_stage)
    sent = [Collective("send", "activations forward and their gradients back", activations,
                       pipeline_crossings(cfg, min(pp, nodes)))]
    if per_stage > per_node:  # a stage's replicas on several nodes
        sent.append(Collective("all-reduce", "a stage's gradients", gradients / pp, 1, per_stage))
    return sent


MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv")  # a process holds several stages


def stages_a_process(cfg, schedule: str | None = None) -> int:
    """The stages each process holds under `schedule` (the config's where None): pipeline_virtual_stages where set
    (interleaved_1f1b), 2 for the multi-stage schedules (zbv's V: one on the way down, one on the way back), 1 for
    gpipe and 1f1b."""
    virtual = getattr(cfg, "pipeline_virtual_stages", None)
    if virtual is not None:
        return virtual
    return 2 if (schedule or getattr(cfg, "pipeline_schedule", None)) in MULTI_STAGE_SCHEDULES else 1


def pipeline_crossings(cfg, nodes: int) -> int:
    """How many times the busiest of `nodes` pipeline nodes sends a micro-batch's activations or their gradients:
    a node between two others sends both ways (one stage a process: 2, the two end nodes 1 each); with v stages a
    process each direction v times, an end node's one v - 1; zbv's V twice each way inside, once at its turn."""
    if getattr(cfg, "pipeline_schedule", None) == "zbv":
        return 4 if nodes > 2 else 2
    virtual = stages_a_process(cfg)
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


def compute_seconds(cfg, model: ModelFacts, peak_flops: float | None, gpus: bool = True) -> float | None:
    """One process's compute for a step of full-length samples (cutoff_len tokens) at MFU_ASSUMED of `peak_flops`
    (CPU_EFFICIENCY_ASSUMED of a CPU's fp32 rate): 6 FLOPs a dense parameter a token (LoRA 4: the frozen weights
    need no weight gradient), + 2 recomputed under activation checkpointing, + attention."""
    if not peak_flops:
        return None
    tokens = cfg.cutoff_len
    per_token = (4 if cfg.is_lora else 6) * model.dense
    if cfg.gradient_checkpointing and cfg.named_recompute_ratio is not None:  # auto: none counted, the least
        per_token += 2 * model.dense * cfg.named_recompute_ratio  # compute it may choose to hide traffic behind
    per_sample = per_token * tokens + 12 * model.layers * model.attention_width * tokens * tokens
    samples = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return per_sample * samples / (peak_flops * (MFU_ASSUMED if gpus else CPU_EFFICIENCY_ASSUMED))


@dataclass(frozen=True)
class StepTime:
    """An optimizer step on several nodes: a GPU's compute, and what of the crossing the step does not hide."""

    compute_s: float
    exposed_s: float     # crossing time not hidden, and a pipeline's bubble
    gather_s: float = 0.0
    reduce_s: float = 0.0
    bubble_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def efficiency(self) -> float:
        """Per GPU, against the same GPU's step on one node."""
        return self.compute_s / self.step_s


def data_parallel_step(crossing: list[Collective], nodes: int, busbw: float, compute_s: float, micro: int,
                       units: int, hidden: bool = True) -> StepTime:
    """A data-parallel step (see the module's docstring): each crossing of the gradients hidden behind its
    micro-step's backward but the last of `units` FSDP2 units (or DDP buckets), the gathers behind the rest; with
    `hidden` false (gloo on CPU) none of it hidden."""
    gathers = [c for c in crossing if c.kind == "all-gather"]
    reductions = [c for c in crossing if c.kind != "all-gather"]
    gather_s = collective_seconds(gathers, busbw, nodes)
    reduce_s = collective_seconds(reductions, busbw, nodes)
    if not hidden:
        return StepTime(compute_s, gather_s + reduce_s, gather_s, reduce_s)
    crossings = max((c.times for c in reductions), default=1)
    window = BACKWARD_SHARE * compute_s / max(micro, 1)
    each = reduce_s / crossings
    exposed_reduce = crossings * max(each / max(units, 1), each - window)
    exposed_gather = max(0.0, gather_s - (compute_s - crossings * window))
    return StepTime(compute_s, exposed_reduce + exposed_gather, gather_s, reduce_s)


def pipeline_step(crossing: list[Collective], nodes: int, busbw: float, compute_s: float,
                  shape: PipelineShape) -> StepTime:
    """A step of a pipeline of `shape` (see the module's docstring): torch's schedule simulated with each stage's
    cost, a hop between processes one micro-batch's sends, the link's whole traffic the floor of the step."""
    send_s = collective_seconds(crossing, busbw, nodes)
    hop_s = hop_seconds(crossing, busbw, shape)
    pp = len(shape.costs) // shape.virtual
    timeline = simulate(schedule_actions(shape.schedule, pp, shape.micro, shape.virtual),
                        scaled_costs(shape, compute_s), stage_ranks(shape.schedule, pp, shape.virtual), hop_s)
    step_s = max(timeline.finish_s, send_s)
    return StepTime(compute_s, step_s - compute_s, reduce_s=send_s, bubble_s=timeline.finish_s - timeline.busiest_s)


def hop_seconds(crossing: list[Collective], busbw: float, shape: PipelineShape) -> float:
    """One micro-batch's sends across a stage boundary (every pipeline of the node's) at `busbw`."""
    return sum(c.bytes for c in crossing if c.kind == "send") / max(shape.micro, 1) / busbw


def scaled_costs(shape: PipelineShape, compute_s: float) -> list[StageCost]:
    """`shape`'s stage costs in seconds: scaled so that the processes' mean compute a step is `compute_s`."""
    pp = len(shape.costs) // shape.virtual
    scale = compute_s * pp / (shape.micro * sum(c.total for c in shape.costs))
    return [StageCost(c.forward * scale, c.input_grad * scale, c.weight_grad * scale) for c in shape.costs]


@dataclass(frozen=True)
class StageCost:
    """One micro-batch through one stage: its forward, its input's gradient and its weights' (seconds, or any unit
    the caller scales)."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad

    def of(self, kind: str) -> float:
        """An action's time: F, B (the whole backward), I or W."""
        return {"F": self.forward, "B": self.input_grad + self.weight_grad, "I": self.input_grad,
                "W": self.weight_grad}[kind]


@dataclass(frozen=True)
class PipelineShape:
    """A pipeline's step: torch's schedule, the stages a process, the micro-batches a step and each stage's cost
    (pipeline_parallel x virtual of them, in stage order)."""

    schedule: str
    virtual: int
    micro: int
    costs: tuple[StageCost, ...]


def stage_costs(model: ModelFacts, stages: list[tuple[int, int]], lora: bool, recompute: float,
                length: int) -> tuple[StageCost, ...]:
    """Each stage's FLOPs for one row of `length` tokens (see the module's docstring): its blocks [first, end), the
    last stage's head (the dense parameters outside the blocks; the embedding is a lookup)."""
    block = 2 * model.size.block_parameters * length
    attention = 4 * model.attention_width * length * length
    head = 2 * max(model.dense - model.size.block_parameters * model.size.blocks, 0) * length
    costs = []
    for index, (first, end) in enumerate(stages):
        blocks = end - first
        forward = blocks * (block + attention)
        input_grad = blocks * (block + 2 * attention) + recompute * forward
        weight_grad = 0.0 if lora else blocks * block
        if index == len(stages) - 1:
            forward, input_grad = forward + head, input_grad + head
            weight_grad += 0.0 if lora else head
        costs.append(StageCost(forward, input_grad, weight_grad))
    return tuple(costs)


Action = tuple[str, int, int]  # (F | B | I | W, stage, micro-batch)


def schedule_actions(schedule: str, pp: int, micro: int, virtual: int = 1) -> list[list[Action]]:
    """Each rank's compute in the order torch runs it. The multi-stage schedules' from the function their classes
    build `pipeline_order` with (`_calculate_single_rank_operations`, given the attributes it reads); gpipe's and
    1f1b's as their `_step_microbatches` run them (Schedule1F1B's own `pipeline_order`, which torch only prints,
    numbers the last rank's micro-batches from 1): gpipe every forward, then every backward; 1f1b min(m, pp - r)
    forwards on rank r, then a backward and a forward in turn, then the backwards left."""
    if schedule == "gpipe":
        return [[("F", r, i) for i in range(micro)] + [("B", r, i) for i in range(micro)] for r in range(pp)]
    if schedule == "1f1b":
        return [one_f_one_b(r, pp, micro) for r in range(pp)]
    from torch.distributed.pipelining import schedules

    kind = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B, "zbv": schedules.ScheduleZBVZeroBubble}[schedule]
    rounds = max(1, micro // pp)
    state = SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=micro, num_stages=pp * virtual,
                            number_of_rounds=rounds, microbatches_per_round=micro // rounds)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
             for a in kind._calculate_single_rank_operations(state, rank)
             if a is not None and a.computation_type.value in "FBIW"] for rank in range(pp)]


def one_f_one_b(rank: int, pp: int, micro: int) -> list[Action]:
    """Schedule1F1B's order on `rank` (see `schedule_actions`)."""
    warmup = min(micro, pp - rank)
    actions = [("F", rank, i) for i in range(warmup)]
    for i in range(micro - warmup):
        actions += [("B", rank, i), ("F", rank, warmup + i)]
    return actions + [("B", rank, i) for i in range(micro - warmup, micro)]


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """The process of each stage, as torch's schedule classes map them (generate_stage_to_rank_mapping: "loop" for
    PipelineScheduleMulti's, ScheduleZBVZeroBubble's "v"): interleaved r, r + pp, ...; zbv's V r and 2 pp - 1 - r.
    The one placement the plan balances the stages for and the model builds them by."""
    if schedule == "zbv":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * virtual)]


@dataclass(frozen=True)
class Timeline:
    finish_s: float   # the slowest rank's last action's end
    busiest_s: float  # the most compute one rank has


def input_of(kind: str, stage: int, mb: int, last: int) -> tuple[str, int, int] | None:
    """What an action waits on, as ("F" | "G", stage, micro-batch): a forward the previous stage's output, a backward
    the next stage's input gradient (the last stage its own forward), a weights' gradient its own input gradient;
    None for the first stage's forward."""
    if kind == "W":
        return "G", stage, mb
    if kind == "F" and stage == 0:
        return None
    source = stage - 1 if kind == "F" else stage + 1 if stage < last else stage
    return ("F" if kind == "F" or source == stage else "G"), source, mb


def output_of(kind: str) -> str:
    """What an action makes: F its output, W the weights' gradient, B and I the input's gradient (G)."""
    return {"F": "F", "W": "W"}.get(kind, "G")


def simulate(actions: list[list[Action]], costs: list[StageCost], rank_of: list[int], hop_s: float) -> Timeline:
    """Each rank runs its actions in order, each as soon as its rank is free and its input is there (see the
    module's docstring): a forward the previous stage's output, a backward the next stage's input gradient (the
    last stage its own forward), a weights' gradient its own input gradient; `hop_s` more between processes."""
    last = len(costs) - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input gradient) | "W", stage, micro-batch): end

    def ready(kind: str, stage: int, mb: int) -> float | None:
        need = input_of(kind, stage, mb, last)
        if need is None:
            return 0.0
        end = done.get(need)
        return None if end is None else end + (hop_s if rank_of[need[1]] != rank_of[stage] else 0.0)

    clock, at, moved = [0.0] * len(actions), [0] * len(actions), True
    while moved:
        moved = False
        for rank, mine in enumerate(actions):
            while at[rank] < len(mine) and (start := ready(*mine[at[rank]])) is not None:
                kind, stage, mb = mine[at[rank]]
                clock[rank] = max(clock[rank], start) + costs[stage].of(kind)
                done[(output_of(kind), stage, mb)] = clock[rank]
                at[rank], moved = at[rank] + 1, True
    if any(at[rank] < len(mine) for rank, mine in enumerate(actions)):
        raise RuntimeError("pipeline schedule: an action waits on one that never runs")
    busy = [sum(costs[stage].of(kind) for kind, stage, _ in mine) for mine in actions]
    return Timeline(max(clock), max(busy))
