"""One optimizer step: the step's micro-batches, its counts summed over every rank, the objective's pass over the
step, forward and backward of each micro-batch through the objective (or the pipeline schedule), the gradient sync,
clipping and the update. The step never asks which stage trains: the objective (train/objectives) answers for it.

Collective order, decided here: every rank calls the counts' all-reduce (`step_counts`), the objective's
`prepare_step` (KTO's KL all-reduce), the wrapper's gradient reductions inside backward (or the pipeline schedule's
sends and receives), the flat sync, fp16's overflow all-reduce under FSDP2 (unscale), the clipping norm's
all-reduce, then with on_nonfinite: skip the non-finite flags' all-gather, in this order; a filler batch keeps a
rank with no rows of its own in step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtune import faults
from meshtune.data.collate import Batch, to_device
from meshtune.data.sampler import GlobalBatchPlan
from meshtune.distributed import DistEnv, all_reduce_sum
from meshtune.model.flops import FlopCounter
from meshtune.model.parallel import finish_gradient_sync, gradient_sync
from meshtune.train.hang_watchdog import HangWatchdog
from meshtune.train.loss_scale import LossScaler
from meshtune.train.nonfinite import NonFiniteSteps
from meshtune.train.objectives import Objective, normalised
from meshtune.train.optimizer import clip_gradients
from meshtune.train.pipeline_step import PipelineStep
from meshtune.train.preemption import StopRequest
from meshtune.train.sequence_split import SequenceSplit
from meshtune.train.stragglers import StepTimes


@dataclass
class StepParts:
    """What every optimizer step of the run uses."""
    env: DistEnv
    model: torch.nn.Module  # inside its wrapper (DDP, FSDP2, the flat sync), or this process's pipeline stages
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: list[torch.nn.Parameter]  # the trainable ones
    scaler: LossScaler
    max_grad_norm: float
    gradient_reduction: str  # plan.gradient_reduction: on which micro-steps gradients cross the processes
    keep_gathered: bool  # FSDP2 units kept whole from one micro-step to the next (reshard_after_forward false)
    fp16: bool  # an overflow is the loss scale's to skip, not a non-finite step
    batches: GlobalBatchPlan
    dataset: object  # the training set the rows index
    data_rank: int  # whose micro-batches this process takes (a cp x tp group's, a pipeline's share one)
    rows_to_batch: Callable[[list[list[int]]], Batch]  # an empty share: a filler batch, trained on nothing
    flops: FlopCounter
    split: SequenceSplit  # context parallel: each process's share of the positions
    pipeline: PipelineStep | None  # pipeline_parallel: this process's stages and torch's schedule
    stages: dist.ProcessGroup | None  # pipeline_parallel: the processes whose gradients one norm covers
    own: float  # 0: another of this data rank's processes counts its batches
    # the wrapper averages gradients over data ranks x cp: each cp process's loss is a partial sum of its row's
    reducing: int


@dataclass
class StepDone:
    """What a step leaves for the metrics, the logs and the checkpoint schedule."""
    epoch: int
    step_in_epoch: int
    targets: torch.Tensor  # the objective's normaliser summed over every rank
    tokens: torch.Tensor
    flops: torch.Tensor
    loss_sum: torch.Tensor  # this process's, not yet summed over ranks
    reported: torch.Tensor  # the objective's metric sums, this process's
    grad_norm: torch.Tensor
    lr: float  # the rate this step used
    updated: bool  # False: a non-finite step skipped


def optimizer_step(parts: StepParts, step: int, stop: StopRequest, times: StepTimes, watch: HangWatchdog,
                   nonfinite: NonFiniteSteps) -> StepDone:
    """Optimizer step `step` (0-based) of the run; `watch` names each part while it runs."""
    done = step + 1
    epoch, step_in_epoch = parts.batches.position(step)
    micro_rows = parts.batches.micro_batches(epoch, step_in_epoch, parts.data_rank)
    micro = [parts.rows_to_batch(rows) for rows in micro_rows]
    watch.at(done, "counting the step's tokens (all-reduce)")
    targets, tokens, flops, votes = times.line_up(lambda: step_counts(micro, parts.objective, parts.flops, parts.env,
                                                                      stop.vote, parts.own))
    stop.tally(votes)
    watch.at(done, "the objective's pass over the step before its micro-batches")
    parts.objective.prepare_step(parts.batches.step_rows(epoch, step_in_epoch), micro_rows, parts.dataset)
    watch.at(done, "forward and backward, with the gradient reduction")
    loss_sum, reported = forward_and_backward(parts, micro, targets, done)
    watch.at(done, "gradient clipping and optimizer step")
    grad_norm, lr, updated = update(parts, loss_sum, nonfinite, done)
    return StepDone(epoch, step_in_epoch, targets, tokens, flops, loss_sum, reported, grad_norm, lr, updated)


def forward_and_backward(parts: StepParts, micro: list[Batch], targets: torch.Tensor,
                         done: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each micro-batch's loss through the objective, its backward scaled by the step's global normaliser, then the
    gradients synchronised; returns this process's summed loss and metric sums."""
    env, objective = parts.env, parts.objective
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    reported = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=env.device)
    if parts.pipeline is not None:  # the schedule runs every micro-batch's forward and backward through the stages
        loss_sum = faults.nan_loss(parts.pipeline.step(micro, targets, parts.reducing, parts.scaler.scale), done,
                                   env.rank)
    else:
        for m, batch in enumerate(micro):
            with gradient_sync(parts.model, last=m == len(micro) - 1, reduction=parts.gradient_reduction,
                               keep_gathered=parts.keep_gathered):
                with parts.split(batch.to(env.device)) as local:  # forward and backward on this process's share
                    loss = faults.nan_loss(objective.loss_sum(local), done, env.rank)
                    parts.scaler.scale(normalised(loss * parts.reducing, targets)).backward()
                    reported += objective.metric_sums(local)
            loss_sum += loss.detach().double()
    finish_gradient_sync(parts.model)
    return loss_sum, reported


def update(parts: StepParts, loss_sum: torch.Tensor, nonfinite: NonFiniteSteps,
           done: int) -> tuple[torch.Tensor, float, bool]:
    """Clip, then step the optimizer and the schedule unless the step is not finite (or, fp16, overflowed);
    returns the gradient norm, the learning rate the step used, and whether it updated."""
    parts.scaler.unscale(parts.optimizer)
    grad_norm = clip_gradients(parts.params, parts.max_grad_norm, parts.stages)
    lr = float(parts.optimizer.param_groups[0]["lr"])  # the rate this step used (a tensor in torchao's AdamW)
    # fp16: gradients that overflow are the loss scale's to skip (and the scale lowers), not a fault
    checked_norm = torch.zeros_like(loss_sum) if parts.fp16 else grad_norm
    updated = nonfinite.update_allowed(done, loss_sum, checked_norm)  # stop: marks kept on the device
    if updated and parts.scaler.step(parts.optimizer):  # fp16: not after an overflow
        parts.scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr, updated


def step_counts(batches: list[Batch], objective: Objective, flops: FlopCounter, env: DistEnv,
                stop_vote: float = 0.0, own: float = 1.0) -> torch.Tensor:
    """The objective's normaliser, tokens, FLOPs of an optimizer step and the ranks voting to stop, summed over all
    ranks in one all-reduce. `own` 0: this rank's batches are those of the first rank of its cp x tp group, which
    counts them (its stop vote still counts)."""
    counts = torch.tensor([own * sum(objective.count(b) for b in batches), own * sum(b.num_tokens for b in batches),
                           own * sum(flops.batch_flops(b.sample_lengths) for b in batches if not b.filler),
                           stop_vote],
                          dtype=torch.float64)
    return all_reduce_sum(to_device(counts, env.device))
