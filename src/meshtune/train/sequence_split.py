"""Context parallel's side of the loop: each micro-batch split over the cp group's processes for its forward and
backward (model/context_parallel.py says how the model attends across the shares)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from meshtune.data.collate import Batch
from meshtune.mesh import ParallelDims

CHUNK_MULTIPLE = 32  # positions


class SequenceSplit:
    """`split(batch)`: a context in which `batch` (on the device) is this process's share of its rows, and the
    model's attention is the ring over the cp group; forward and backward both run inside it. With cp 1, the batch
    itself and nothing else."""

    def __init__(self, dims: ParallelDims):
        self.cp = dims.cp
        # the run's cp dimension: consecutive ranks (next to tensor parallel's, innermost), built with its mesh once
        self.mesh = dims.sub_mesh("cp") if self.cp > 1 else None

    def __call__(self, batch: Batch):
        return self._split(batch) if self.cp > 1 else nullcontext(batch)

    def around(self, loss_of: Callable[[Batch], torch.Tensor]) -> Callable[[Batch], torch.Tensor]:
        """`loss_of` on this process's share of a batch, for a forward without backward (evaluation)."""
        if self.cp == 1:
            return loss_of

        def share_loss(batch: Batch) -> torch.Tensor:
            with self(batch) as local:
                return loss_of(local)
        return share_loss

    @contextmanager
    def _split(self, batch: Batch) -> Iterator[Batch]:
        from torch.distributed.tensor.experimental import context_parallel

        input_ids, position_ids, targets = (t.clone() for t in (batch.input_ids, batch.position_ids, batch.targets))
        buffers = [input_ids, position_ids, targets]
        with context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            local = Batch(input_ids=input_ids, targets=targets, position_ids=position_ids, attention_mask=None,
                          num_tokens=batch.num_tokens, sample_lengths=batch.sample_lengths)
            local.locate_targets()  # this share's
            yield local


def row_multiple(cp: int, tp: int) -> int:
    """What every row's length is padded to: tensor parallel's equal shares of positions; context parallel's 2 x cp
    chunks, each a multiple of 32 positions, as the ring needs of the memory-efficient kernel (fp32), whose
    log-sum-exp comes in blocks of 32 queries. At most 64 x cp padding positions a row, for samples thousands long."""
    return tp * (2 * cp * CHUNK_MULTIPLE if cp > 1 else 1)
