"""The global batch of a step does not depend on how many processes share it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtune.data.sampler import GlobalBatchPlan, permutation


def plan(dp_size: int, accumulation: int, micro: int = 2, **kw) -> GlobalBatchPlan:
    return GlobalBatchPlan(np.arange(1, 41) % 7 + 1, seed=3, micro_batch=micro, accumulation=accumulation,
                           dp_size=dp_size, **kw)


def step_rows(p: GlobalBatchPlan, epoch: int, step: int) -> list:
    rows = []
    for rank in range(p.dp_size):
        for micro in p.micro_batches(epoch, step, rank):
            rows += micro
    return rows


def test_same_rows_per_step_for_every_layout():
    layouts = [plan(1, 4), plan(2, 2), plan(4, 1)]
    for epoch in range(2):
        for step in range(layouts[0].steps_in_epoch(epoch)):
            expected = step_rows(layouts[0], epoch, step)
            for other in layouts[1:]:
                assert step_rows(other, epoch, step) == expected


def test_each_epoch_is_a_new_permutation_and_steps_cover_it():
    p = plan(2, 2)
    assert p.steps_in_epoch(0) == 40 // 8
    seen = [i for step in range(5) for row in step_rows(p, 0, step) for i in row]
    assert sorted(seen) == list(range(40))
    assert permutation(40, 3, 0) != permutation(40, 3, 1)
    assert permutation(40, 3, 0) == permutation(40, 3, 0)


def test_total_steps_and_positions():
    p = plan(1, 1, micro=8)  # 5 steps per epoch
    assert p.total_steps(2.0, -1) == 10
    assert p.total_steps(1.5, -1) == 8  # HF Trainer's ceil(1.5 x 5)
    assert p.total_steps(3.0, 4) == 4
    assert p.position(0) == (0, 0) and p.position(5) == (1, 0) and p.position(7) == (1, 2)


def test_epoch_ends_are_the_steps_that_complete_an_epoch():
    p = plan(1, 1, micro=8)  # 5 steps per epoch
    assert p.epoch_ends(p.total_steps(2.0, -1)) == {5, 10}
    assert p.epoch_ends(8) == {5}  # 1.5 epochs: the last step is inside the second
    assert p.epoch_ends(4) == frozenset()
    packed = plan(2, 1, micro=1, packing_capacity=10)  # packing: epochs may differ in steps
    ends = np.cumsum([packed.steps_in_epoch(epoch) for epoch in range(40)])
    assert packed.epoch_ends(100) == set(ends[ends <= 100].tolist())


def test_packing_plan_uses_rows_and_group_by_length_keeps_the_step_content():
    packed = plan(2, 1, micro=1, packing_capacity=10)
    rows = packed.rows(0)
    assert all(sum(packed.lengths[i] for i in row) <= 10 for row in rows)
    assert sorted(i for row in rows for i in row) == list(range(40))
    grouped, plain = plan(2, 2, group_by_length=True), plan(2, 2)
    assert sorted(map(tuple, step_rows(grouped, 0, 1))) == sorted(map(tuple, step_rows(plain, 0, 1)))


def test_positions_do_not_recompute_earlier_epochs(monkeypatch):
    import meshtune.data.sampler as sampler

    p = plan(1, 1, micro=8)
    total = p.total_steps(4.0, -1)
    calls = []
    real = sampler.permutation
    monkeypatch.setattr(sampler, "permutation", lambda *a: calls.append(a) or real(*a))
    epochs = [p.position(step)[0] for step in range(total)]
    for step in range(total):
        p.micro_batches(*p.position(step), dp_rank=0)
    assert epochs[-1] == 3
    assert len(calls) <= 4, f"permutation recomputed {len(calls)} times for 4 epochs"


def test_balanced_micro_batches_hold_every_row_once_with_near_equal_tokens():
    lengths = np.random.default_rng(0).integers(128, 1025, size=400)
    plan = GlobalBatchPlan(lengths, seed=3, micro_batch=8, accumulation=2, dp_size=4, balance_tokens=True)
    for step in range(3):
        slots = [mb for rank in range(4) for mb in plan.micro_batches(0, step, rank)]
        rows = [row for slot in slots for row in slot]
        start = step * plan.global_batch
        assert sorted(map(tuple, rows)) == sorted(map(tuple, plan.rows(0)[start:start + plan.global_batch]))
        loads = [sum(plan.row_length(row) for row in slot) for slot in slots]
        assert max(loads) - min(loads) <= 1024, loads  # unbalanced: spread of ~8 x 260 tokens per slot
    # the slots depend on ranks x accumulation only: 2 ranks x 2 micro-steps == 1 rank x 4 micro-steps
    two = GlobalBatchPlan(lengths, seed=3, micro_batch=8, accumulation=2, dp_size=2, balance_tokens=True)
    one = GlobalBatchPlan(lengths, seed=3, micro_batch=8, accumulation=4, dp_size=1, balance_tokens=True)
    assert two.micro_batches(0, 1, 0) + two.micro_batches(0, 1, 1) == one.micro_batches(0, 1, 0)


def partial_plan(dp_size: int, accumulation: int, micro: int = 2, samples: int = 43, **kw) -> GlobalBatchPlan:
    return GlobalBatchPlan(np.arange(1, samples + 1) % 7 + 1, seed=3, micro_batch=micro, accumulation=accumulation,
                           dp_size=dp_size, **kw)


def test_an_epochs_last_partial_batch_is_trained_split_over_the_ranks():
    """43 samples, global batch 16: 3 steps an epoch, the last of 11 rows; every sample seen once an epoch, and
    every layout of the 16 trains the same rows in each step, the partial one too."""
    layouts = [partial_plan(1, 8), partial_plan(2, 4), partial_plan(4, 2), partial_plan(8, 1)]
    for balanced in (False, True):
        plans = [partial_plan(p.dp_size, p.accumulation, balance_tokens=balanced) for p in layouts]
        for epoch in range(2):
            assert [p.steps_in_epoch(epoch) for p in plans] == [3] * 4
            seen = [i for step in range(3) for row in step_rows(plans[0], epoch, step) for i in row]
            assert sorted(seen) == list(range(43))
            for step in range(3):
                expected = sorted(map(tuple, step_rows(plans[0], epoch, step)))
                for other in plans[1:]:
                    assert sorted(map(tuple, step_rows(other, epoch, step))) == expected, (other, epoch, step)
    one, four = layouts[0], layouts[2]
    assert one.rows_in_step(0, 2) == 11 and one.micro_steps(0, 2) == 6  # as HF: ceil(11 / 2) micro-batches
    assert four.micro_steps(0, 2) == 2  # ceil(11 / (2 x 4)): every rank runs 2 micro-steps
    shares = [[len(micro) for micro in four.micro_batches(0, 2, rank)] for rank in range(4)]
    assert shares == [[2, 2], [2, 2], [2, 1], [0, 0]]  # the empty ones run a filler
    assert all(len(four.micro_batches(0, step, rank)) == 2 for step in range(2) for rank in range(4))


def test_drop_last_keeps_every_step_a_whole_global_batch():
    p = partial_plan(2, 4, drop_last=True)
    assert p.steps_in_epoch(0) == 2 and p.total_steps(3.0, -1) == 6
    assert all(p.rows_in_step(0, step) == 16 for step in range(2))
    small = partial_plan(1, 8, samples=10)
    assert small.steps_in_epoch(0) == 1 and small.rows_in_step(0, 0) == 10  # smaller than one global batch: trained
    assert partial_plan(1, 8, samples=10, drop_last=True).steps_in_epoch(0) == 0


def hf_trainer_steps(samples: int, micro: int, accumulation: int, epochs: float, processes: int, tmp_path):
    """What HF Trainer's own code makes of this job, on each of `processes` ranks: its train dataloader, sharded
    by accelerate as a `processes`-way job shards it, and the step count `set_initial_training_values` derives
    from it; with the samples each rank's dataloader yields in one epoch."""
    from accelerate.data_loader import prepare_data_loader
    from transformers import Trainer, TrainingArguments

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Linear(1, 1)

        def forward(self, input_ids=None, labels=None):
            return {"loss": self.weight(input_ids.float()).sum()}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accumulation, num_train_epochs=epochs, use_cpu=True,
                             report_to="none", save_strategy="no")
    trainer = Trainer(model=Tiny(), args=args, train_dataset=[{"input_ids": [i], "labels": [i]}
                                                               for i in range(samples)])
    loader = trainer.get_train_dataloader()
    steps, seen = set(), []
    for rank in range(processes):
        shard = prepare_data_loader(loader, num_processes=processes, process_index=rank, put_on_device=False)
        steps.add(trainer.set_initial_training_values(args, shard)[-1])  # max_steps
        seen += [int(i) for batch in shard for i in batch["input_ids"].flatten()]
    assert len(steps) == 1
    return steps.pop(), seen


@pytest.mark.parametrize("samples, micro, accumulation, epochs, processes", [
    (40, 2, 8, 5.0, 1),  # Qwen's finetune.py flags on one GPU
    (40, 2, 8, 5.0, 2),  # ... on two
    (7, 2, 8, 2.0, 1),  # fewer samples than one global batch
    (41, 3, 2, 1.5, 2),
    (100, 4, 4, 2.0, 3),
    (10, 2, 1, 1.6, 1),  # 1.6 x 5 steps: HF's product rounds to 8
])
def test_step_count_and_samples_seen_are_hf_trainers(tmp_path, samples, micro, accumulation, epochs, processes):
    hf_steps, hf_seen = hf_trainer_steps(samples, micro, accumulation, epochs, processes, tmp_path)
    ours = GlobalBatchPlan(np.ones(samples, dtype=np.int64), seed=0, micro_batch=micro, accumulation=accumulation,
                           dp_size=processes)
    assert ours.total_steps(epochs, -1) == hf_steps
    seen = [i for step in range(ours.steps_in_epoch(0)) for row in step_rows(ours, 0, step) for i in row]
    assert sorted(seen) == list(range(samples)) == sorted(set(hf_seen))  # HF pads a rank's share with repeats


def test_dataloader_drop_last_says_at_launch_what_it_leaves_out_that_hf_trainer_trains(caplog):
    """The key is HF's, its meaning meshtune's: the epoch's whole partial global batch is left out, where HF drops
    only a last batch of fewer than per_device_train_batch_size x processes samples."""
    import logging
    from types import SimpleNamespace

    from meshtune.config import TrainConfig
    from meshtune.data.pipeline import plan_steps
    from meshtune.errors import ConfigError

    data = SimpleNamespace(lengths=np.ones(43, dtype=np.int64))
    cfg = TrainConfig(model_name_or_path="m", dataset=["d.jsonl"], per_device_train_batch_size=2,
                      gradient_accumulation_steps=4, num_train_epochs=1, dataloader_drop_last=True)
    caplog.set_level(logging.INFO, logger="meshtune")
    plan, steps = plan_steps(cfg, data, 2, 4, report=True)
    assert steps == 2 and plan.global_batch == 16
    assert ("dataloader_drop_last: true: the last 11 samples of each epoch's order (fewer than the global batch of "
            "16) are not trained that epoch; HF Trainer drops only a last per-device batch of fewer than 2 x 2 "
            "processes") in caplog.text
    kept, kept_steps = plan_steps(cfg.model_copy(update={"dataloader_drop_last": False}), data, 2, 4, report=True)
    assert kept_steps == 3 and caplog.text.count("dataloader_drop_last") == 1
    with pytest.raises(ConfigError, match="with dataloader_drop_last: true one optimizer step needs a global batch"):
        plan_steps(cfg, SimpleNamespace(lengths=np.ones(15, dtype=np.int64)), 2, 4)
