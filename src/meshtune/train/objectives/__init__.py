"""What training optimises, apart from the loop that drives it.

An objective owns its unit of data (what one index of the tokenized dataset is; the sampler deals rows of them),
how units become a micro-batch (`collate`), the loss of a micro-batch as a sum (`loss_sum`) with its share of the
normaliser (`count`), and what it reports. A step's loss is the sum over its whole global batch / the count summed
over every rank and micro-step, so the layout never changes the math; `normalised` is that one division, for
training, evaluation and the measured steps of the memory fit alike. What it reports besides the loss
(`metric_names`) is summed the same way (`metric_sums`) and divided by the same count: a ratio of sums all-reduced
across ranks, never a mean of means. The loop, the evaluator and the memory fit call an objective and
compute no loss themselves.
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

    @property
    def metric_names(self) -> tuple[str, ...]:
        """What the objective reports besides the loss, each a sum over the step / its normaliser."""

    def metric_sums(self, batch: Batch) -> torch.Tensor:
        """The numerators of `metric_names` for the micro-batch `loss_sum` last computed (fp64, one value a name)."""


def normalised(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """A summed loss over its normaliser; a count of 0 (a filler batch that keeps collectives in step) gives the sum
    itself, 0 for such a batch."""
    if isinstance(count, torch.Tensor):
        return total / count.clamp(min=1)
    return total / max(count, 1)
