"""Rows of samples -> model tensors, with labels shifted inside each sample.

Shifting per sample (target of token t = token t+1 of the same sample, -100 at each sample's end) before
concatenation means packed rows never train one sample to predict the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshtune.data.chat_template import IGNORE_INDEX as IGNORE


@dataclass
class Batch:
    input_ids: torch.Tensor  # (rows, length)
    targets: torch.Tensor  # (rows, length), already shifted, IGNORE where nothing is trained
    position_ids: torch.Tensor  # restart at 0 for every sample
    attention_mask: torch.Tensor | None  # None for packed rows: position_ids make attention block-diagonal
    num_tokens: int  # real (non-padding) tokens
    cu_seqlens: torch.Tensor | None = None  # padding-free: sample boundaries in the single row (int32)
    sample_lengths: tuple[int, ...] = ()  # every sample's length (the attention term of the FLOP count)
    filler: bool = False  # trains nothing: it keeps a rank's collectives in step with the others' (ignore_all)
    reference_logps: torch.Tensor | None = None  # stage: dpo's precomputed reference log-prob of each row

    def __post_init__(self) -> None:
        # found here on the host, so the step never waits on the GPU for them
        if self.targets.device.type == "cpu":
            self.locate_targets()

    def locate_targets(self) -> None:
        """Where the targets sit in the flattened row(s), and their ids. On a device tensor it waits for the device:
        for targets that exist only there (context parallel's share of a row)."""
        flat = self.targets.reshape(-1)
        self.target_positions = (flat != IGNORE).nonzero().squeeze(1)
        self.target_ids = flat.index_select(0, self.target_positions)

    @property
    def num_targets(self) -> int:
        return self.target_ids.numel()

    @property
    def num_sequences(self) -> int:
        """Sequences in the batch: one a row, or under padding-free the samples of its one row."""
        return self.input_ids.shape[0] if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def max_length(self) -> int:
        """The longest sample (the varlen kernel's bound)."""
        return max(self.sample_lengths)

    def ignore_all(self) -> Batch:
        """Train nothing on this batch (a filler batch that keeps collectives in step): no target, and no token or
        FLOP counted."""
        self.targets.fill_(IGNORE)
        self.target_positions = self.target_positions[:0]
        self.target_ids = self.target_ids[:0]
        self.num_tokens, self.filler = 0, True
        return self

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        moved = Batch(move(self.input_ids), move(self.targets), move(self.position_ids), move(self.attention_mask),
                      self.num_tokens, move(self.cu_seqlens), self.sample_lengths, self.filler,
                      move(self.reference_logps))
        moved.target_positions, moved.target_ids = move(self.target_positions), move(self.target_ids)
        return moved

    def model_inputs(self) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.cu_seqlens is not None:  # read by the meshtune_varlen attention (model/attention.py)
            inputs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                          max_length_q=self.max_length, max_length_k=self.max_length)
        return inputs


def sequence_sums(values: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """(rows, positions) values -> each sequence's sum: a row's, or under padding-free (one row) each sample's
    between `cu_seqlens`. Sized from the values, so the device is never waited on."""
    if cu_seqlens is None:
        return values.sum(dim=1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths,
                                       output_size=values.numel())
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add_(0, sequence,
                                                                                           values.reshape(-1))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> GPU without a host sync: a copy from pageable memory makes the CPU wait for the GPU's queue to
    drain, so the CPU could not prepare the next step while the GPU runs this one. Pinned memory copies async."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def shifted_targets(labels: np.ndarray) -> np.ndarray:
    targets = np.full(len(labels), IGNORE, dtype=np.int64)
    targets[:-1] = labels[1:]
    return targets


def concatenated(samples: list[int], dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Samples end to end: input ids, shifted targets, positions restarting at 0 per sample, and the lengths."""
    ids, targets, positions, lengths = [], [], [], []
    for index in samples:
        sample_ids, sample_labels = dataset[index]
        ids.append(np.asarray(sample_ids, dtype=np.int64))
        targets.append(shifted_targets(np.asarray(sample_labels, dtype=np.int64)))
        positions.append(np.arange(len(sample_ids), dtype=np.int64))
        lengths.append(len(sample_ids))
    return np.concatenate(ids), np.concatenate(targets), np.concatenate(positions), lengths


def collate(rows: list[list[int]], dataset, pad_id: int, packed: bool, pad_to_multiple: int = 1,
            padding_free: bool = False) -> Batch:
    """Right-pad rows to the longest; each row holds one sample, or several when `packed`.

    `padding_free`: every sample of every row end to end in one row, with no padding at all, plus the sample
    boundaries for a variable-length attention kernel. The math is that of the padded batch.
    """
    if padding_free:
        return collate_padding_free([index for row in rows for index in row], dataset)
    pieces, lengths = [], []
    for row in rows:
        ids, targets, positions, row_lengths = concatenated(row, dataset)
        pieces.append((ids, targets, positions))
        lengths += row_lengths
    length = max(len(p[0]) for p in pieces)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    shape = (len(rows), length)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    target_t = torch.full(shape, IGNORE, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    for r, (ids, targets, positions) in enumerate(pieces):
        n = len(ids)
        input_ids[r, :n] = torch.from_numpy(ids)
        target_t[r, :n] = torch.from_numpy(targets)
        position_ids[r, :n] = torch.from_numpy(positions)
        # padding is its own "sample" (positions from 0) so packed attention never joins it to a real one
        position_ids[r, n:] = torch.arange(length - n)
        mask[r, :n] = 1
    return Batch(input_ids, target_t, position_ids, None if packed else mask, int(mask.sum()),
                 sample_lengths=tuple(lengths))


def collate_padding_free(samples: list[int], dataset) -> Batch:
    ids, targets, positions, lengths = concatenated(samples, dataset)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return Batch(torch.from_numpy(ids)[None], torch.from_numpy(targets)[None], torch.from_numpy(positions)[None], None,
                 int(sum(lengths)), cu_seqlens, tuple(lengths))
