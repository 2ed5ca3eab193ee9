"""World-size-independent order: what every optimizer step trains on, whatever the topology.

Step k of epoch e consumes rows [k*G, (k+1)*G) of a list fixed by (seed, epoch), G = global batch. A row is one
sample, or with packing several consecutive samples of the permutation that fit in cutoff_len. The G rows are
then cut into micro-batches of `micro_batch` rows; rank r takes micro-batches [r*A, (r+1)*A), A = accumulation.
So 1 process x accumulation 4 and 4 processes x 1 see the same rows in each step, and a run resumed on another
world size continues the same sequence (only `step` needs saving).

An epoch's last step takes the rows left over, as HF Trainer's dataloader (`dataloader_drop_last: false`) keeps its
last partial batch: steps per epoch = ceil(rows / G), every row trained once an epoch. That step runs only the
micro-steps its rows need (ceil(rest / (micro_batch x ranks)), as HF runs fewer micro-batches in it), and a rank
whose share of a micro-step is empty runs a filler whose targets are all ignored, so every rank runs the same
collectives. The loss is normalised by the step's real target count, so the layouts still agree. `drop_last`
drops that step instead: every step then has exactly G rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

Row = list[int]  # indices of the samples packed into one row


def permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The sample order of an epoch, from torch's generator so it is the same on every platform."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def pack_rows(order: list[int], lengths: np.ndarray, capacity: int) -> list[Row]:
    """Greedy, order-preserving packing: a row takes samples until the next one would overflow `capacity`."""
    rows: list[Row] = []
    row: Row = []
    used = 0
    for index in order:
        length = int(lengths[index])
        if row and used + length > capacity:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(row)
    return rows


@dataclass
class GlobalBatchPlan:
    """Which rows each optimizer step of the whole run trains on."""

    lengths: np.ndarray
    seed: int
    micro_batch: int
    accumulation: int
    dp_size: int
    packing_capacity: int | None = None  # cutoff_len when packing, else None
    group_by_length: bool = False
    balance_tokens: bool = False  # padding-free only: micro-batches of equal token counts, not of equal row counts
    drop_last: bool = False  # drop each epoch's last partial global batch (dataloader_drop_last)

    def __post_init__(self) -> None:
        self._rows_cache: dict[int, list[Row]] = {}  # the current epoch's rows only: a large plan stays small
        self._steps_cache: dict[int, int] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_size

    def rows(self, epoch: int) -> list[Row]:
        if epoch not in self._rows_cache:
            order = permutation(len(self.lengths), self.seed, epoch)
            if self.packing_capacity:
                rows = pack_rows(order, self.lengths, self.packing_capacity)
            else:
                rows = [[index] for index in order]
            self._rows_cache = {epoch: rows}
        return self._rows_cache[epoch]

    def row_count(self, epoch: int) -> int:
        """Rows of an epoch: its samples, or with packing its packed rows (which depend on the epoch's order)."""
        return len(self.rows(epoch)) if self.packing_capacity else len(self.lengths)

    def steps_in_epoch(self, epoch: int) -> int:
        """ceil(rows / G): the last step takes the rows left over; floor with `drop_last`."""
        if epoch not in self._steps_cache:
            rows = self.row_count(epoch)
            self._steps_cache[epoch] = rows // self.global_batch if self.drop_last else -(-rows // self.global_batch)
        return self._steps_cache[epoch]

    def total_steps(self, num_epochs: float, max_steps: int) -> int:
        """max_steps, else HF Trainer's count: ceil(num_epochs x steps per epoch), each whole epoch with its own
        steps (packing makes them differ) and the fraction of the next rounded up."""
        if max_steps > 0:
            return max_steps
        if not self.packing_capacity:  # every epoch has as many rows: HF's very product, rounding included
            return math.ceil(num_epochs * self.steps_in_epoch(0))
        whole = math.floor(num_epochs)
        total = sum(self.steps_in_epoch(epoch) for epoch in range(whole))
        if num_epochs > whole:
            total += math.ceil((num_epochs - whole) * self.steps_in_epoch(whole))
        return total

    def rows_in_step(self, epoch: int, step: int) -> int:
        """G, or fewer in an epoch's last step."""
        return min(self.global_batch, self.row_count(epoch) - step * self.global_batch)

    def micro_steps(self, epoch: int, step: int) -> int:
        """Micro-steps every rank runs in this step: the accumulation, or what a last partial step's rows need."""
        per_micro_step = self.micro_batch * self.dp_size
        return min(self.accumulation, -(-self.rows_in_step(epoch, step) // per_micro_step))

    def epoch_ends(self, total_steps: int) -> frozenset[int]:
        """The optimizer steps, counted from 1, that complete an epoch, up to `total_steps`."""
        ends, done, epoch = [], 0, 0
        while (steps := self.steps_in_epoch(epoch)) and done + steps <= total_steps:
            done += steps
            ends.append(done)
            epoch += 1
        return frozenset(ends)

    def position(self, global_step: int) -> tuple[int, int]:
        """(epoch, step within epoch) of the 0-based optimizer step `global_step`."""
        epoch = 0
        while True:
            steps = self.steps_in_epoch(epoch)
            if steps == 0:
                raise ValueError("the dataset has fewer rows than one global batch (dataloader_drop_last)")
            if global_step < steps:
                return epoch, global_step
            global_step -= steps
            epoch += 1

    def row_length(self, row: Row) -> int:
        return sum(int(self.lengths[i]) for i in row)

    def step_rows(self, epoch: int, step: int) -> list[Row]:
        """The step's global batch in the epoch's order, the same on every layout."""
        start = step * self.global_batch
        return self.rows(epoch)[start:start + self.global_batch]

    def micro_batches(self, epoch: int, step: int, dp_rank: int) -> list[list[Row]]:
        """This rank's micro-batches, each a list of up to `micro_batch` rows: `accumulation` of them, or
        `micro_steps` in a last partial step, where some may be empty (the loop runs a filler for those)."""
        batch = self.step_rows(epoch, step)
        micro_steps = self.micro_steps(epoch, step)
        if self.balance_tokens:
            slots = balanced_slots(batch, [self.row_length(row) for row in batch], self.dp_size * micro_steps)
            return slots[dp_rank * micro_steps:(dp_rank + 1) * micro_steps]
        if self.group_by_length:
            batch = sorted(batch, key=self.row_length)
        per_rank = self.micro_batch * micro_steps
        mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [mine[m * self.micro_batch:(m + 1) * self.micro_batch] for m in range(micro_steps)]


def balanced_slots(rows: list[Row], lengths: list[int], slots: int) -> list[list[Row]]:
    """Deal `rows` into `slots` micro-batches of near-equal token counts (longest first, each to the lightest slot).

    With variable-length samples a rank's step lasts as long as its tokens take, and every rank waits for the
    slowest: balancing tokens, not rows, is what lets several GPUs scale. Slots depend only on the global batch
    and (ranks x accumulation), so 2 ranks x 1 micro-step and 1 rank x 2 micro-steps train the same slots.
    """
    loads = [0] * slots
    dealt: list[list[Row]] = [[] for _ in range(slots)]
    for index in sorted(range(len(rows)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(slots), key=lambda s: (loads[s], s))
        dealt[lightest].append(rows[index])
        loads[lightest] += lengths[index]
    return dealt
