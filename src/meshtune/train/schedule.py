"""Linear warmup, then cosine / linear decay to 0, or constant (as HF's schedulers)."""

from __future__ import annotations

import math

import torch


def warmup_steps(total_steps: int, warmup_ratio: float, warmup_steps_: int) -> int:
    return warmup_steps_ if warmup_steps_ > 0 else math.ceil(warmup_ratio * total_steps)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, total: int, warmup: int, kind: str):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, kind))
