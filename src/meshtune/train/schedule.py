"""The learning-rate schedule: transformers' own `get_scheduler`, so each `lr_scheduler_type` and the warmup mean
what they mean in HF Trainer (the first warmup step at lr 0; `constant` without warmup); and DeepSpeed's
WarmupLR, WarmupDecayLR and WarmupCosineLR (`deepspeed_*`) as DeepSpeed computes them, for the jobs whose DeepSpeed
JSON names one."""

from __future__ import annotations

import functools
import math

import torch
from transformers import get_scheduler

from meshtune.errors import ConfigError

# lr_scheduler_type of DeepSpeed's schedules -> DeepSpeed's name
DEEPSPEED_SCHEDULES = {"deepspeed_warmup_lr": "WarmupLR", "deepspeed_warmup_decay_lr": "WarmupDecayLR",
                       "deepspeed_warmup_cosine_lr": "WarmupCosineLR"}
DEEPSPEED_COS_MIN_RATIO = 0.0001  # WarmupCosineLR's default end, as a share of the peak


def warmup_steps(total_steps: int, warmup_ratio: float, warmup_steps_: float) -> int:
    """HF TrainingArguments.get_warmup_steps: warmup_steps of 1 or more counts steps, a fraction below 1 is a share
    of all steps (transformers 5), and 0 leaves it to warmup_ratio (transformers 4), rounded up."""
    if warmup_steps_ >= 1:
        return int(warmup_steps_)
    return math.ceil(total_steps * (warmup_steps_ or warmup_ratio))


def build_scheduler(optimizer: torch.optim.Optimizer, total: int, warmup: int, kind: str,
                    warmup_type: str | None = None, cos_min_ratio: float | None = None
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler `kind` over `total` optimizer steps; a LambdaLR whose state_dict a checkpoint keeps."""
    if kind not in DEEPSPEED_SCHEDULES:
        return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    if warmup < 1:
        raise ConfigError(f"lr_scheduler_type {kind} (DeepSpeed's {DEEPSPEED_SCHEDULES[kind]}) with no warmup: "
                          f"DeepSpeed refuses it (warmup_num_steps must be a positive integer); set warmup_steps or "
                          f"warmup_ratio, or the DeepSpeed file's scheduler.params.warmup_num_steps")
    ratio = functools.partial(deepspeed_lr_ratio, kind=kind, total=total, warmup=warmup,
                              log_warmup=(warmup_type or "log") == "log", floor=deepspeed_floor(kind, cos_min_ratio))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, ratio)


def deepspeed_floor(kind: str, cos_min_ratio: float | None) -> float:
    """Where WarmupCosineLR ends, as a share of the peak (its cos_min_ratio, DeepSpeed's default where unset)."""
    if kind != "deepspeed_warmup_cosine_lr":
        return 0.0
    return DEEPSPEED_COS_MIN_RATIO if cos_min_ratio is None else cos_min_ratio


def deepspeed_lr_ratio(step: int, kind: str, total: int, warmup: int, log_warmup: bool, floor: float) -> float:
    """The learning rate of optimizer step `step` (from 0) as a share of the peak, operation for operation as
    DeepSpeed's lr_schedules.py computes it. DeepSpeed sets the first step's rate when the scheduler is built
    (its start, 0) and advances after every step, so step k trains at its value for last_batch_iteration k - 1:
    a log warmup trains its first two steps at 0 and reaches the peak at step `warmup`. DeepSpeed warms up over at
    least 2 steps."""
    last = step - 1
    if last < 0:
        return 0.0
    warmup = max(2, warmup)
    if last < warmup:
        return (1.0 / math.log(warmup)) * math.log(last + 1) if log_warmup else last / warmup
    if kind == "deepspeed_warmup_lr":
        return 1.0
    if kind == "deepspeed_warmup_decay_lr":
        return max(0.0, float(total - last) / float(max(1.0, total - warmup)))
    progress = min(1.0, (last - warmup + 1) / max(1, total - warmup))
    return max(0.0, floor + (1.0 - floor) * ((1 + math.cos(math.pi * progress)) / 2))


def describe_schedule(total: int, warmup: int, kind: str, warmup_type: str | None = None,
                      cos_min_ratio: float | None = None) -> str:
    """One line for the run's log; says so when `constant` leaves a warmup unused, as HF's does."""
    if kind in DEEPSPEED_SCHEDULES:
        after = {"deepspeed_warmup_lr": "constant",
                 "deepspeed_warmup_decay_lr": "linear decay",
                 "deepspeed_warmup_cosine_lr": f"cosine decay to {deepspeed_floor(kind, cos_min_ratio):g} of the "
                                               f"peak"}[kind]
        return (f"lr schedule ({kind}, as DeepSpeed's {DEEPSPEED_SCHEDULES[kind]} computes it): "
                f"{warmup_type or 'log'} warmup over {max(2, warmup)} step(s) from 0 (the first step at 0, "
                f"as DeepSpeed steps it), then {after}")
    if kind == "constant":
        return ("lr schedule: constant, no warmup (as in HF; constant_with_warmup warms up)" if warmup else
                "lr schedule: constant")
    after = {"cosine": "cosine decay to 0", "linear": "linear decay to 0", "constant_with_warmup": "constant"}[kind]
    return f"lr schedule ({kind}): {warmup} warmup step(s) from 0, then {after} over {total - warmup} step(s)"
