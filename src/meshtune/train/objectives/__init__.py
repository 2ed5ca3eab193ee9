"""What training optimises, apart from the loop that drives it.

An objective owns its unit of data (what one index of the tokenized dataset is; the sampler deals rows of them),
how units become a micro-batch (`collate`), the loss of a micro-batch as a sum (`loss_sum`) with its share of the
normaliser (`count`), and what it reports. A step's loss is the sum over its whole global batch / the count summed
over every rank and micro-step, so the layout never changes the math; `normalised` is that one division, for
training, evaluation and the measured steps of the memory fit alike. What it reports besides the loss is summed
the same way (`metric_sums`, named by `metric_names`) and turned into values once all-reduced across ranks
(`metrics`): ratios of sums, never a mean of means. An objective whose loss depends on the whole step (KTO's KL
estimate) computes that first in `prepare_step`, which sees the step's global batch. The loop, the evaluator and
the memory fit call an objective and compute no loss themselves.
"""

from __future__ import annotations

from typing import Protocol

import torch

from meshtune.data.collate import Batch
from meshtune.data.sampler import Row


class Objective(Protocol):
    def collate(self, rows: list[Row], dataset, packed: bool) -> Batch:
        """Rows of units -> one micro-batch on the host."""

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """The micro-batch's loss as a sum (differentiable), on the batch's device."""

    def count(self, batch: Batch) -> float:
        """The micro-batch's share of the normaliser."""

    def prepare_step(self, step_rows: list[Row], micro_rows: list[list[Row]], dataset) -> None:
        """Before a step's micro-batches: `step_rows` the step's global batch in the epoch's order (the same on every
        rank), `micro_rows` this rank's micro-batches of it (some may be empty), of `dataset`'s samples. Collective
        where it computes: every rank calls it at the same steps."""

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of `metric_sums`' values."""

    def metric_sums(self, batch: Batch) -> torch.Tensor:
        """What the micro-batch `loss_sum` last computed adds to the reported values, as sums (fp64, one a name)."""

    def metrics(self, sums: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        """The reported values from `metric_sums` summed over the step on every rank, and the summed normaliser; NaN
        for a value the step does not define (it stays out of the logging interval's mean)."""


def normalised(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """A summed loss over its normaliser; a count of 0 (a filler batch that keeps collectives in step) gives the sum
    itself, 0 for such a batch."""
    if isinstance(count, torch.Tensor):
        return total / count.clamp(min=1)
    return total / max(count, 1)
