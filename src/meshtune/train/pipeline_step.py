"""An optimizer step's forward and backward under pipeline_parallel, through torch.distributed.pipelining: the
step's micro-batches, each padded to one shape, stacked into one batch that torch's schedule (ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B or ScheduleZBVZeroBubble) splits back into them (or, where the plan says so,
into their rows one by one); the last stage computes each micro-batch's loss, normalised as the data-parallel step
normalises it, so the sum over micro-batches is the one-process loss and its gradients. Where the plan staggers a node's
pipelines (plan/stagger.py), each waits its turn before a training step's first action (`Stagger`)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)

from meshtune.crossing import MULTI_STAGE_SCHEDULES as MULTI_STAGE  # several stages a process, given as a list
from meshtune.data.collate import IGNORE, Batch
from meshtune.model.pipeline_parallel import StageForward
from meshtune.plan import RunPlan
from meshtune.train.objectives import normalised
from meshtune.train.objectives.token_loss import token_loss_sum

logger = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}


class ForwardOnlyStage(PipelineStage):
    """A stage of an evaluation schedule. torch's `eval` of a V schedule (zbv) still walks its backward actions,
    each skipped, and hands their gradients between a process's two adjacent stages, which a stage without a
    backward refuses: here there are none to hand."""

    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)
LENGTH_MULTIPLE = 64  # rows padded to a multiple: fewer distinct shapes, each a stage set up anew


@dataclass(frozen=True)
class Stagger:
    """A node's pipelines started in turn (plan.pipeline_stagger_rate): this process's pipeline waits `turn` hops,
    a hop one micro-batch's activations (`token_bytes` a token) at the node's link `rate` (bytes/s)."""

    turn: int
    pipelines: int  # the node's
    rate: float
    token_bytes: int

    @classmethod
    def of(cls, plan: RunPlan, data_env, hidden: int) -> Stagger | None:
        """The plan's stagger for this process (its pipeline's place among the node's: its data rank there), or None
        where the pipelines start together."""
        if not plan.pipeline_stagger_rate:
            return None
        pipelines = max(data_env.local_world_size, 1)
        return cls(data_env.rank % pipelines, pipelines, plan.pipeline_stagger_rate,
                   hidden * (2 if plan.bf16 or plan.bf16_weights else 4))

    def seconds(self, rows: int, length: int) -> float:
        return self.turn * rows * length * self.token_bytes / self.rate

    def wait(self, seconds: float, modules: list[torch.nn.Module], device: torch.device) -> None:
        """Gather the stages' FSDP2 weights first, every pipeline at once (zero2 keeps them whole until the last
        backward, so no collective among the node's pipelines puts them back in step), then wait `seconds` with the
        device idle."""
        seen = set()
        for module in (m for stage in modules for m in stage.modules() if isinstance(m, FSDPModule)):
            if id(module) not in seen:
                seen.add(id(module))
                module.unshard()
        if seconds > 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(seconds)
SHAPES_KEPT = 4       # stages (with their receive buffers) kept for the shapes seen last


class PipelineStep:
    """This process's stages of the pipeline and the schedules it runs, one per micro-batch shape: a stage's sends
    and receives are set up for one shape on its first step, and micro-batches of a step differ in length from the
    next step's. Every process of a pipeline sees the same micro-batches, so all of them set up the same shapes."""

    def __init__(self, modules: list[StageForward], held: list[int], mesh: DeviceMesh, plan: RunPlan,
                 device: torch.device, pad_id: int, length_cap: int, stagger: Stagger | None = None):
        # held: the stage of each module, of the plan's stages
        self.modules, self.held, self.stages = modules, held, len(plan.pipeline_stages)
        self.group = mesh["pp"].get_group()
        # FSDP2 inside the stages: a stage's processes gather its weights together at each forward, and a stage set
        # up for a new shape runs one forward more (torch's shape inference), so its processes, which take other
        # micro-batches, pad them to one shape: the largest of theirs
        self.shape_group = mesh["dp"].get_group() if plan.parallel != "ddp" else None
        self.schedule, self.micro_batches = plan.pipeline_schedule, plan.gradient_accumulation_steps
        self.one_row = plan.pipeline_one_row  # each row of a training step's micro-batches one of the schedule's
        self.device, self.pad_id, self.length_cap = device, pad_id, length_cap
        self.autocast_bf16 = plan.autocast_bf16  # bf16 compute as the ddp step's (the replicas hold fp32 weights)
        # (rows, length, micro-batches); evaluation's schedules apart (a stage first set up without backward would
        # not run one later)
        self.schedules: OrderedDict[tuple[int, int, int, bool], object] = OrderedDict()
        self.sums: list[torch.Tensor] = []
        self.stagger, self.stepped = stagger, set()  # the schedules that ran a training step (set up: in step)
        self.waited = False
        self.loss_of: Callable[[torch.Tensor], torch.Tensor] = lambda total: total

    @property
    def first(self) -> bool:
        return 0 in self.held

    @property
    def last(self) -> bool:
        return self.stages - 1 in self.held

    def _schedule(self, rows: int, length: int, micro_batches: int, training: bool):
        key = (rows, length, micro_batches, training)
        if key in self.schedules:
            self.schedules.move_to_end(key)
            return self.schedules[key]
        kind = PipelineStage if training else ForwardOnlyStage
        stages = [kind(module, stage, self.stages, self.device, group=self.group)
                  for module, stage in zip(self.modules, self.held)]
        # scale_grads off: each micro-batch's loss is already its share of the step's (see step); evaluation runs
        # one batch as one micro-batch, forward only (a multi-stage schedule's own eval: its stages' placement)
        schedule = self.schedule if training or self.schedule in MULTI_STAGE else "gpipe"
        made = SCHEDULES[schedule](stages if schedule in MULTI_STAGE else stages[0], n_microbatches=micro_batches,
                                   loss_fn=self._loss, scale_grads=False)
        self.schedules[key] = made
        if len(self.schedules) > SHAPES_KEPT:
            self.stepped.discard(self.schedules.popitem(last=False)[0])
        return made

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = token_loss_sum(logits, targets)
        self.sums.append(total.detach())
        return self.loss_of(total)

    def step(self, micro: list[Batch], normaliser: torch.Tensor, reducing: int,
             scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (on this process's device); returns their summed loss on
        the last stage, 0 elsewhere. Each micro-batch's backward uses loss * reducing / normaliser, as the
        data-parallel step's does (`reducing`: the replicas the gradients are averaged over)."""
        self.loss_of = lambda total: scale(normalised(total * reducing, normaliser))
        return self._run(micro, self.micro_batches, training=True)

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """The summed loss of one held-out batch (on this process's device) through the stages, forward only: on the
        last stage; 0 elsewhere."""
        self.loss_of = lambda total: total
        return self._run([batch], 1, training=False)

    def _run(self, micro: list[Batch], count: int, training: bool) -> torch.Tensor:
        shape = torch.tensor(stacked_shape(micro, self.length_cap), device=self.device)
        if self.shape_group is not None:
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.shape_group)
        stacked = stack(micro, count, self.pad_id, *shape.tolist())
        rows, length = stacked.input_ids.shape
        count = rows if training and self.one_row else count  # the same rows, the schedule's chunks of one each
        schedule = self._schedule(rows // count, length, count, training)
        if training and self.stagger is not None:
            # a schedule's first step sets its stages up (shape inference, FSDP2's first gathers) in step
            key = (rows // count, length, count, training)
            if key in self.stepped:
                seconds = self.stagger.seconds(rows // count, length)
                if not self.waited and self.stagger.turn:
                    logger.info(f"pipeline stagger: this pipeline ({self.stagger.turn + 1} of the node's "
                                f"{self.stagger.pipelines}) starts a training step {seconds * 1e3:.3g} ms after the "
                                f"node's first ({rows // count} x {length} tokens a micro-batch)")
                    self.waited = True
                self.stagger.wait(seconds, self.modules, self.device)
            self.stepped.add(key)
        self.sums = []
        inputs = stacked.to(self.device)
        kwargs = {"attention_mask": inputs.attention_mask, "position_ids": inputs.position_ids}
        run = schedule.step if training else schedule.eval
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            if self.first:
                run(inputs.input_ids, **kwargs, **({"target": inputs.targets} if self.last else {}))
            elif self.last:
                run(**kwargs, target=inputs.targets)
            else:
                run(**kwargs)
        if not self.last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        # the losses of these micro-batches: a stage set up for a new shape may run a forward on placeholder
        # inputs first (torch's shape inference), whose loss is not theirs
        return torch.stack(self.sums[-count:]).double().sum()


def stacked_shape(micro: list[Batch], length_cap: int) -> tuple[int, int]:
    """The rows of a chunk and the length `stack` pads the micro-batches to: their most rows, their longest row
    rounded up to a multiple of LENGTH_MULTIPLE (or the longest a row may be)."""
    rows = max(b.input_ids.size(0) for b in micro)
    longest = max(b.input_ids.size(1) for b in micro)
    return rows, max(longest, min(-(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, length_cap))


def stack(micro: list[Batch], count: int, pad_id: int, rows: int, length: int) -> Batch:
    """The step's micro-batches as one batch of `count` equal chunks of `rows` rows, each right-padded to `length`
    (stacked_shape's, or more): padding is masked and trains nothing, so each chunk's loss is its micro-batch's. A
    micro-batch with fewer rows, and a missing one (an epoch's short last step), is filled with copies of a row
    whose targets are all ignored."""
    shape = (count * rows, length)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, IGNORE, dtype=torch.long)
    position_ids = torch.arange(length).repeat(count * rows, 1)
    mask = torch.zeros(shape, dtype=torch.long)
    spare = micro[0]
    for m in range(count):
        batch = micro[m] if m < len(micro) else None
        for r in range(rows):
            own = batch is not None and r < batch.input_ids.size(0)  # else a filler row (`spare` may be `batch`)
            source, row = (batch, r) if own else (spare, 0)
            n = source.input_ids.size(1)
            at = m * rows + r
            input_ids[at, :n] = source.input_ids[row]
            position_ids[at, :n] = source.position_ids[row]
            if source.attention_mask is not None:
                mask[at, :n] = source.attention_mask[row]
            if own:
                targets[at, :n] = source.targets[row]
    return Batch(input_ids, targets, position_ids, mask, sum(b.num_tokens for b in micro))

