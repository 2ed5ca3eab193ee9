"""A held-out split of the tokenized data, fixed by the seed."""

from __future__ import annotations

import numpy as np
import torch

from meshtune.errors import ConfigError


class Subset:
    """A view of some samples of a dataset, with the same interface (len, [i], lengths)."""

    def __init__(self, dataset, indices: list[int]):
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(dataset.lengths)[self.indices]
        tags = getattr(dataset, "desirable", None)  # unpaired preference data's tags go with their samples
        self.desirable = None if tags is None else np.asarray(tags)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[int(self.indices[i])]


def split_validation(dataset, val_size: float, seed: int) -> tuple[Subset, Subset]:
    """val_size < 1 is a fraction, otherwise a count; the held-out samples never train."""
    n = len(dataset)
    n_val = int(val_size) if val_size >= 1 else max(1, round(val_size * n))
    if n_val >= n:
        raise ConfigError(f"val_size: {val_size} leaves no training sample out of {n}; use a smaller fraction or count")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(dataset, sorted(order[n_val:])), Subset(dataset, sorted(order[:n_val]))
