"""The learning-rate schedule: transformers' own `get_scheduler`, so each `lr_scheduler_type` and the warmup mean
what they mean in HF Trainer (the first warmup step at lr 0; `constant` without warmup)."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler


def warmup_steps(total_steps: int, warmup_ratio: float, warmup_steps_: float) -> int:
    """HF TrainingArguments.get_warmup_steps: warmup_steps of 1 or more counts steps, a fraction below 1 is a share
    of all steps (transformers 5), and 0 leaves it to warmup_ratio (transformers 4), rounded up."""
    if warmup_steps_ >= 1:
        return int(warmup_steps_)
    return math.ceil(total_steps * (warmup_steps_ or warmup_ratio))


def build_scheduler(optimizer: torch.optim.Optimizer, total: int, warmup: int,
                    kind: str) -> torch.optim.lr_scheduler.LambdaLR:
    """HF's scheduler `kind` over `total` optimizer steps; a LambdaLR whose state_dict a checkpoint keeps."""
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def describe_schedule(total: int, warmup: int, kind: str) -> str:
    """One line for the run's log; says so when `constant` leaves a warmup unused, as HF's does."""
    if kind == "constant":
        return ("lr schedule: constant, no warmup (as in HF; constant_with_warmup warms up)" if warmup else
                "lr schedule: constant")
    after = {"cosine": "cosine decay to 0", "linear": "linear decay to 0", "constant_with_warmup": "constant"}[kind]
    return f"lr schedule ({kind}): {warmup} warmup step(s) from 0, then {after} over {total - warmup} step(s)"
