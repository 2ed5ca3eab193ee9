"""Steps whose loss or gradient norm is not finite (NaN or inf: a bad sample, an overflow, a broken node).

`on_nonfinite: stop` (the default) costs the step nothing: each step marks, on the device, the first step at which
this rank's own loss (before the sum over ranks) and the gradient norm (the same on every rank) were not finite.
The marks are read where the loop waits for the device anyway: with each logging record, before each checkpoint
is written and at the end. The ranks then exchange them (a few numbers), and a non-finite step stops every rank
alike, naming the step, the ranks whose loss it was, their nodes and the samples of their batch. No checkpoint of
that step or a later one, and no final/, is ever written: the check comes before each.

`on_nonfinite: skip` must know before the optimizer step. The ranks exchange their marks every step (one small
all-gather and one wait for the device) and a non-finite step makes no update: no optimizer step, and the learning
rate schedule waits, as Megatron-LM and HF Trainer skip a step whose gradients overflowed. The steps skipped are
kept with the loop's counters (so in checkpoints) and the run stops once more than `max_nonfinite_skips` were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtune.data.sampler import GlobalBatchPlan
from meshtune.distributed import DistEnv
from meshtune.errors import MeshtuneError
from meshtune.train.stragglers import Place

logger = logging.getLogger(__name__)

SHOWN_SAMPLES = 16


class NonFiniteError(MeshtuneError):
    """A step whose loss or gradient norm was NaN or inf."""


def sample_ids(batches: GlobalBatchPlan, train_data,
               data_rank_of: Callable[[int], int] = int) -> Callable[[int, int | None], list[int]]:
    """`ids(step, rank)`: the samples 1-based optimizer step `step` trains on that rank (None: on every rank), as
    positions in the tokenized training data (through the held-out split, when there is one). `data_rank_of`: the
    data rank whose samples a global rank trains (the run's mesh: a cp x tp group's and a pipeline's processes
    share one)."""
    positions = getattr(train_data, "indices", None)

    def ids(step: int, rank: int | None) -> list[int]:
        epoch, in_epoch = batches.position(step - 1)
        ranks = range(batches.dp_size) if rank is None else [data_rank_of(rank)]
        rows = [row for r in ranks for micro in batches.micro_batches(epoch, in_epoch, r) for row in micro]
        found = [index for row in rows for index in row]
        return sorted(int(positions[i]) if positions is not None else i for i in found)

    return ids


class NonFiniteSteps:
    """What the loop asks at each step (`update_allowed`) and at the points where it waits (`check`)."""

    def __init__(self, policy: str, max_skips: int, env: DistEnv, places: list[Place],
                 samples: Callable[[int, int | None], list[int]], skipped: list[int],
                 before_stop: Callable[[], None]):
        """`skipped`: the steps skipped so far, a list the loop's checkpointed counters hold (extended in place).
        `before_stop` runs on every rank before the error (it publishes a checkpoint in flight: an earlier,
        checked step)."""
        self.policy, self.max_skips = policy, max_skips
        self.env, self.places, self.samples = env, places, samples
        self.skipped, self.before_stop = skipped, before_stop
        self.interval: list[int] = []  # steps skipped since the last logging record
        # first step whose own loss / gradient norm was not finite on this rank (0: none yet)
        self._first = torch.zeros(2, dtype=torch.int64, device=env.device)

    def update_allowed(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """After clipping, before the optimizer step: `loss` is this rank's own, not yet summed over the ranks.
        Stop: marks the step on the device and returns True at once; skip: False when any rank's loss or the
        gradient norm is not finite."""
        bad = torch.stack([~torch.isfinite(loss), ~torch.isfinite(grad_norm.to(loss.device))])
        if self.policy == "stop":
            self._first.masked_fill_(bad & (self._first == 0), step)
            return True
        flags = [(bool(own), bool(norm)) for own, norm in self._gather(bad.to(torch.int64))]
        if not any(own or norm for own, norm in flags):
            return True
        what = self._describe(step, flags)
        if len(self.skipped) >= self.max_skips:
            self.before_stop()
            before = f" ({', '.join(map(str, self.skipped))})" if self.skipped else ""
            raise NonFiniteError(f"{what}. Stopped: max_nonfinite_skips: {self.max_skips} steps were skipped "
                                 f"already{before}. {WHERE_SAMPLES} Check those samples, lower learning_rate or "
                                 f"max_grad_norm, or raise max_nonfinite_skips")
        self.skipped.append(step)
        self.interval.append(step)
        logger.warning(f"warning: {what}; skipped: no update, and the learning rate schedule waits "
                       f"({len(self.skipped)} of at most {self.max_skips})")
        return False

    def check(self) -> None:
        """Where the loop waits anyway (a logging record, before a checkpoint, at the end), on every rank at once:
        stop if a step so far was not finite."""
        if self.policy != "stop":
            return
        firsts = self._gather(self._first)
        marked = [step for pair in firsts for step in pair if step]
        if not marked:
            return
        step = min(marked)
        flags = [(own == step, norm == step) for own, norm in firsts]
        self.before_stop()
        raise NonFiniteError(f"{self._describe(step, flags)}. Stopped: nothing from step {step} on was saved "
                             f"(no checkpoint, no final/). {WHERE_SAMPLES} Check those samples, lower learning_rate "
                             f"or max_grad_norm, or set on_nonfinite: skip to pass over such steps (up to "
                             f"max_nonfinite_skips)")

    def skipped_since_record(self) -> list[int]:
        """The steps skipped since the last call, for the logging record."""
        steps, self.interval = self.interval, []
        return steps

    def _gather(self, values: torch.Tensor) -> list[list[int]]:
        """Every rank's `values` (a few integers), in rank order."""
        if self.env.world_size == 1:
            return [values.tolist()]
        gathered = [torch.empty_like(values) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, values)
        return [t.tolist() for t in gathered]

    def _describe(self, step: int, flags: list[tuple[bool, bool]]) -> str:
        """`flags[rank]`: (its own loss was not finite, the gradient norm was not finite) at `step`."""
        losses = [rank for rank, (own, _) in enumerate(flags) if own]
        if losses:
            where = "; ".join(f"rank {rank} ({self._place(rank)}) on samples {shown(self.samples(step, rank))}"
                              for rank in losses)
            return f"step {step}: the loss was not finite on {where}"
        return (f"step {step}: the gradient norm was not finite while every rank's loss was (the gradients are "
                f"summed over the ranks, so no one rank can be named); the step's samples: "
                f"{shown(self.samples(step, None))}")

    def _place(self, rank: int) -> str:
        if rank < len(self.places):
            return f"node {self.places[rank].node}, host {self.places[rank].host}"
        return "node unknown"


WHERE_SAMPLES = "Samples are numbered by their position in the tokenized training data, from 0."


def shown(ids: list[int]) -> str:
    if len(ids) <= SHOWN_SAMPLES:
        return ", ".join(map(str, ids))
    return f"{', '.join(map(str, ids[:SHOWN_SAMPLES]))}, ... ({len(ids)} in all)"
