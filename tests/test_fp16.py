"""fp16 for GPUs without bf16 (V100, T4), as HF's fp16: autocast to fp16 and a dynamic loss scale (torch's
GradScaler under ddp, its ShardedGradScaler under FSDP2, where an overflow in one rank's shard skips the step on
every rank). CPU runs ignore fp16 as they ignore bf16; the loop's use of the scaler is run here on CPU by
forcing the plan's fp16 (CPU autocast computes in fp16 too)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import base_config
from meshtune.compat.deepspeed import translate_deepspeed
from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.checkpoint import TrainingProgress
from meshtune.plan import resolve
from meshtune.train.loss_scale import LossScaler


def config(**values):
    return build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **values})


def never_counted():
    raise AssertionError("not needed")


def test_fp16_is_for_gpus_and_replaces_bf16():
    gpu = DistEnv(0, 1, 0, 1, torch.device("cuda"))
    plan = resolve(config(fp16=True, padding_free=False, torch_compile=False), gpu, None, never_counted)
    assert (plan.fp16, plan.bf16, plan.frozen_bf16, plan.autocast_bf16) == (True, False, False, False)
    assert "fp16 compute (autocast), dynamic loss scale, fp32 master weights" in plan.describe()
    cpu = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    plan = resolve(config(fp16=True), cpu, None, never_counted)
    assert not plan.fp16 and plan.why["precision"] == "fp16 is ignored on CPU"


def test_fp16_with_another_precision_is_refused():
    with pytest.raises(ConfigError, match="fp16: true and bf16: true ask for two compute precisions"):
        config(fp16=True, bf16=True)
    with pytest.raises(ConfigError, match="fp16: true and master_weights: bf16"):
        config(fp16=True, finetuning_type="full", master_weights="bf16")


def test_deepspeed_fp16_enabled_means_fp16():
    out = translate_deepspeed({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}, "ds.json",
                              {}, {})
    assert out.values["fp16"] is True and out.problems == []
    assert {"fp16.loss_scale", "fp16.initial_scale_power"} <= set(out.unhonoured)
    both = translate_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "ds.json", {}, {})
    assert both.problems == ["ds.json: bf16.enabled and fp16.enabled are both true; keep one"]


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_the_scaler_unscales_before_clipping_and_skips_overflowed_steps():
    scaled, plain = tiny(), tiny()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (scaled, plain)]
    progress = TrainingProgress()
    scaler = LossScaler(True, False, torch.device("cpu"), progress)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scaler.scale(scaled(x).pow(2).sum()).backward()
    plain(x).pow(2).sum().backward()
    assert not torch.allclose(scaled[0].weight.grad, plain[0].weight.grad)  # scaled by 2**16
    scaler.unscale(optimizers[0])
    assert torch.allclose(scaled[0].weight.grad, plain[0].weight.grad)
    assert scaler.step(optimizers[0]) and progress.loss_scale["scale"] == 2.0 ** 16
    optimizers[1].step()
    assert all(torch.allclose(a, b) for a, b in zip(scaled.parameters(), plain.parameters()))

    before = [p.detach().clone() for p in scaled.parameters()]
    optimizers[0].zero_grad()
    scaler.scale(scaled(x).pow(2).sum() * float("inf")).backward()
    scaler.unscale(optimizers[0])
    assert not scaler.step(optimizers[0])  # skipped: the parameters stay, the scale halves
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters()))
    assert progress.loss_scale["scale"] == 2.0 ** 15
    kept = TrainingProgress(**json.loads(json.dumps(dataclasses.asdict(progress))))  # as checkpoints keep it
    resumed = LossScaler(True, False, torch.device("cpu"), kept)
    assert resumed._scaler.get_scale() == 2.0 ** 15
    off = LossScaler(False, False, torch.device("cpu"), TrainingProgress())
    loss = plain(x).sum()
    assert off.scale(loss) is loss and off.step(optimizers[1])


def sharded_job(rank: int, world_size: int, workdir) -> None:
    """FSDP2 on 2 gloo ranks: a finite step equals the unscaled one; an overflow in rank 1's shard alone skips the
    step on both ranks."""
    from torch.distributed.fsdp import fully_shard

    model, reference = tiny(), tiny()
    fully_shard(model[0])
    fully_shard(model)
    fully_shard(reference[0])
    fully_shard(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = LossScaler(True, True, torch.device("cpu"), TrainingProgress())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    scaler.scale(model(x).pow(2).sum()).backward()
    scaler.unscale(optimizer)
    assert scaler.step(optimizer)
    reference(x).pow(2).sum().backward()
    reference_optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a.full_tensor(), b.full_tensor())
    optimizer.zero_grad()
    before = [p.full_tensor().clone() for p in model.parameters()]
    loss = model(x).pow(2).sum() * (float("inf") if rank == 1 else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale(optimizer)
    assert not scaler.step(optimizer)
    assert all(torch.equal(a, b.full_tensor()) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_the_sharded_scaler_skips_on_every_rank_when_one_shard_overflows(tmp_path):
    from ranks import run_ranks

    run_ranks(sharded_job, 2, tmp_path)


def forced_fp16(monkeypatch):
    """The plan a GPU would resolve for fp16: true, here on CPU."""
    import meshtune.train.loop as loop

    real = loop.resolve
    monkeypatch.setattr(loop, "resolve", lambda *args, **kwargs: dataclasses.replace(real(*args, **kwargs), fp16=True))


def fp16_zero2_job(rank: int, world_size: int, workdir) -> None:
    """The loop on 2 gloo ranks under zero2 with the plan's fp16 forced: ShardedGradScaler over FSDP2's shards."""
    import os

    import meshtune.train.loop as loop

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what torchrun sets; the process group already exists
    real = loop.resolve
    loop.resolve = lambda *args, **kwargs: dataclasses.replace(real(*args, **kwargs), fp16=True)
    loop.train(build_config(json.loads((workdir / "task.json").read_text())))


@pytest.mark.slow
def test_the_loop_trains_in_fp16_with_the_scaler_and_checkpoints_its_scale(tmp_path, tiny_model_dir, tiny_dataset,
                                                                           monkeypatch):
    import torch.distributed.checkpoint as dcp

    from conftest import read_metrics
    from meshtune.train.loop import run
    from ranks import run_ranks

    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "fp32", finetuning_type="full", learning_rate=1e-3,
                         max_steps=4, save_steps=2, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    reference = [r["loss"] for r in run(build_config(values)).records]
    sharded = {**values, "output_dir": str(tmp_path / "zero2"), "parallel": "zero2",
               "gradient_accumulation_steps": 1}
    (tmp_path / "task.json").write_text(json.dumps(sharded))
    run_ranks(fp16_zero2_job, 2, tmp_path)
    forced_fp16(monkeypatch)
    values["output_dir"] = str(tmp_path / "fp16")
    losses = [r["loss"] for r in run(build_config(values)).records]
    assert losses != reference and losses == pytest.approx(reference, rel=1e-3)
    # zero2: each rank's half of the batch at twice the weight overflows the first step's fp16 gradients at the
    # initial scale 2**16. Both ranks skip it (neither moves, so the later steps run on agreeing weights), and the
    # schedule waits: each step's learning rate is the one the reference used after as many steps taken
    records = read_metrics(tmp_path / "zero2")
    skipped = [r["step"] for r in records if r["grad_norm"] is None]  # an overflowed norm is written as null
    assert skipped == [1] and records[0]["loss"] == pytest.approx(reference[0], rel=1e-3)
    reference_lr = [r["lr"] for r in read_metrics(tmp_path / "fp32")]
    assert [r["lr"] for r in records] == [reference_lr[r["step"] - 1 - sum(s < r["step"] for s in skipped)]
                                          for r in records]
    saved = {"trainer": {"json": ""}}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(saved, checkpoint_id=str(tmp_path / "fp16" / "checkpoint-4"), no_dist=True)
    assert json.loads(saved["trainer"]["json"])["loss_scale"]["scale"] == 2.0 ** 16
