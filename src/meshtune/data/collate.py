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
    num_targets: int

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.targets), move(self.position_ids), move(self.attention_mask),
                     self.num_tokens, self.num_targets)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs


def shifted_targets(labels: np.ndarray) -> np.ndarray:
    targets = np.full(len(labels), IGNORE, dtype=np.int64)
    targets[:-1] = labels[1:]
    return targets


def collate(rows: list[list[int]], dataset, pad_id: int, packed: bool, pad_to_multiple: int = 1) -> Batch:
    """Right-pad rows to the longest; each row holds one sample, or several when `packed`."""
    pieces = []
    for row in rows:
        ids, targets, positions = [], [], []
        for index in row:
            sample_ids, sample_labels = dataset[index]
            ids.append(np.asarray(sample_ids, dtype=np.int64))
            targets.append(shifted_targets(np.asarray(sample_labels, dtype=np.int64)))
            positions.append(np.arange(len(sample_ids), dtype=np.int64))
        pieces.append((np.concatenate(ids), np.concatenate(targets), np.concatenate(positions)))
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
    num_tokens = int(mask.sum())
    num_targets = int((target_t != IGNORE).sum())
    return Batch(input_ids, target_t, position_ids, None if packed else mask, num_tokens, num_targets)
