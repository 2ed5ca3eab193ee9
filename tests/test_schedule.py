"""The learning-rate schedule means what HF Trainer's does: warmup from lr 0, `constant` without warmup, the
warmup counted as TrainingArguments counts it, and a resumed run continuing the same rates."""

from __future__ import annotations

import math
import typing

import pytest
import torch
import torch.distributed as dist
from transformers import TrainingArguments

from meshtune.checkpoint import CheckpointManager, TrainingProgress, training_state
from meshtune.config import TrainConfig
from meshtune.errors import ConfigError
from meshtune.train.schedule import DEEPSPEED_SCHEDULES, build_scheduler, describe_schedule, warmup_steps

TOTAL, WARMUP = 10, 4


def rates(kind: str, total: int = TOTAL, warmup: int = WARMUP, scheduler=None, optimizer=None) -> list[float]:
    """The lr each optimizer step trains at (read before the step, as the loop logs it)."""
    if scheduler is None:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        scheduler = build_scheduler(optimizer, total, warmup, kind)
    seen = []
    for _ in range(total - scheduler.last_epoch):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


WARMING = [0.0, 0.25, 0.5, 0.75]  # step k of a warmup of 4 trains at k / 4: the first step at lr 0
EXPECTED = {
    "cosine": WARMING + [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)],
    "linear": WARMING + [(6 - k) / 6 for k in range(6)],
    "constant": [1.0] * TOTAL,  # HF's constant has no warmup
    "constant_with_warmup": WARMING + [1.0] * 6,
}


@pytest.mark.parametrize("kind", [kind for kind in typing.get_args(TrainConfig.model_fields["lr_scheduler_type"]
                                                                    .annotation) if kind not in DEEPSPEED_SCHEDULES])
def test_each_schedule_the_config_accepts_is_hfs(kind):
    assert rates(kind) == pytest.approx(EXPECTED[kind], abs=1e-12)


# DeepSpeed's lr_schedules.py, by its arithmetic: the scheduler sets the first step's lr when built
# (last_batch_iteration -1: warmup_min_lr, 0 here; WarmupCosineLR 0.0) and steps after every optimizer step, so step
# k trains at its value for last_batch_iteration i = k - 1. Warmup (i < W): log: log(i + 1) / log(W), linear: i / W.
# WarmupDecayLR then (T - i) / (T - W); WarmupCosineLR cos_min_ratio + (1 - cos_min_ratio) (1 + cos(pi (i - W + 1) /
# (T - W))) / 2, cos_min_ratio 0.0001 by default; WarmupLR 1. W is at least 2.
LOG4 = [0.0, 0.0, math.log(2) / math.log(4), math.log(3) / math.log(4), 1.0]  # steps 0-4: the peak at step W
LINEAR4 = [0.0, 0.0, 0.25, 0.5, 0.75]


def ds_cosine(i: int, floor: float = 0.0001) -> float:
    return floor + (1 - floor) * (1 + math.cos(math.pi * (i - WARMUP + 1) / (TOTAL - WARMUP))) / 2


DEEPSPEED_EXPECTED = {
    ("deepspeed_warmup_lr", None): LOG4 + [1.0] * 5,
    ("deepspeed_warmup_lr", "linear"): LINEAR4 + [1.0] * 5,
    ("deepspeed_warmup_decay_lr", None): LOG4 + [(TOTAL - i) / (TOTAL - WARMUP) for i in range(4, 9)],
    ("deepspeed_warmup_decay_lr", "log"): LOG4 + [(TOTAL - i) / (TOTAL - WARMUP) for i in range(4, 9)],
    ("deepspeed_warmup_decay_lr", "linear"): LINEAR4 + [(TOTAL - i) / (TOTAL - WARMUP) for i in range(4, 9)],
    ("deepspeed_warmup_cosine_lr", None): LOG4 + [ds_cosine(i) for i in range(4, 9)],
}


@pytest.mark.parametrize("kind, warmup_type", list(DEEPSPEED_EXPECTED))
def test_deepspeed_schedules_give_each_step_deepspeeds_rate(kind, warmup_type):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build_scheduler(optimizer, TOTAL, WARMUP, kind, warmup_type)
    assert rates(kind, scheduler=scheduler, optimizer=optimizer) == pytest.approx(
        DEEPSPEED_EXPECTED[kind, warmup_type], abs=1e-12)


def test_deepspeeds_cosine_floor_and_its_shortest_warmup():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build_scheduler(optimizer, TOTAL, WARMUP, "deepspeed_warmup_cosine_lr", "linear", 0.1)
    assert rates("", scheduler=scheduler, optimizer=optimizer) == pytest.approx(
        LINEAR4 + [ds_cosine(i, 0.1) for i in range(4, 9)], abs=1e-12)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    one = build_scheduler(optimizer, TOTAL, 1, "deepspeed_warmup_lr")  # DeepSpeed warms up over 2 steps at least
    assert rates("", scheduler=one, optimizer=optimizer)[:4] == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match=r"deepspeed_warmup_decay_lr \(DeepSpeed's WarmupDecayLR\) with no warmup: "
                                          r"DeepSpeed refuses it"):
        build_scheduler(optimizer, TOTAL, 0, "deepspeed_warmup_decay_lr")
    assert describe_schedule(TOTAL, WARMUP, "deepspeed_warmup_decay_lr") == (
        "lr schedule (deepspeed_warmup_decay_lr, as DeepSpeed's WarmupDecayLR computes it): log warmup over 4 step(s) "
        "from 0 (the first step at 0, as DeepSpeed steps it), then linear decay")


@pytest.mark.parametrize("total, ratio, steps", [(30, 0.1, 0), (100, 0.07, 0), (1000, 0.03, 0), (7, 0.5, 0),
                                                 (30, 0.0, 0.1), (30, 0.0, 0.07), (30, 0.2, 5), (30, 0.2, 5.5)])
def test_warmup_is_counted_as_hf_counts_it(total, ratio, steps):
    """transformers 5 reads warmup_steps below 1 as a share of all steps; transformers 4's warmup_ratio is the same
    share when warmup_steps is 0."""
    hf = TrainingArguments(output_dir="unused", warmup_steps=steps or ratio, report_to="none")
    assert warmup_steps(total, ratio, steps) == hf.get_warmup_steps(total)


def test_a_share_of_steps_rounds_up_as_hf_does():
    assert warmup_steps(30, 0.07, 0) == warmup_steps(30, 0.0, 0.07) == 3  # 2.1 steps
    assert warmup_steps(100, 0.07, 0) == 8  # 7.000000000000001 in floating point, and so in HF
    assert warmup_steps(30, 0.1, 0) == 3 and warmup_steps(30, 0.2, 5.5) == 5


def test_the_log_line_says_when_constant_leaves_a_warmup_unused():
    assert "no warmup" in describe_schedule(TOTAL, WARMUP, "constant")
    assert describe_schedule(TOTAL, 0, "constant") == "lr schedule: constant"
    assert describe_schedule(TOTAL, WARMUP, "cosine") == ("lr schedule (cosine): 4 warmup step(s) from 0, then cosine "
                                                          "decay to 0 over 6 step(s)")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["cosine", "constant_with_warmup", "deepspeed_warmup_decay_lr"])
def test_a_checkpoint_taken_in_the_warmup_resumes_the_same_rates(tmp_path, world_of_one, kind):
    def fresh():
        model = torch.nn.Linear(3, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        return model, optimizer, build_scheduler(optimizer, TOTAL, WARMUP, kind)

    model, optimizer, scheduler = fresh()
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    manager = CheckpointManager(tmp_path, None, False, 0, 1)
    manager.save(2, training_state(model, optimizer, scheduler, TrainingProgress(step=2), 0, False),
                 {"epoch": 0, "world_size": 1, "parallel": "ddp", "config_hash": "abc"})
    manager.close()
    model, optimizer, scheduler = fresh()
    manager.load(tmp_path / "checkpoint-2", training_state(model, optimizer, scheduler, TrainingProgress(), 0, False))
    expected = EXPECTED.get(kind) or DEEPSPEED_EXPECTED[kind, None]
    assert rates(kind, scheduler=scheduler, optimizer=optimizer) == pytest.approx(expected[2:], abs=1e-12)
