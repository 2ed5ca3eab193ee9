"""Choices made for the user, resolved once into the run plan: `parallel: auto` and the other defaults, and garbage
collection at the same steps on every rank."""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import base_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.plan import ModelSize, default_blocks_per_unit, resolve, sharding_for_full, sharding_for_qlora
from meshtune.train.collection import StepGarbageCollection
from meshtune.train.loop import run

GIB = 2**30


def env(world_size: int, device: str, local_world_size: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, device=torch.device(device), rank=0,
                           local_world_size=local_world_size or world_size)


def config(**values):
    return build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **values})


def never_counted() -> ModelSize:
    raise AssertionError("the model's size is needed only for full fine-tuning on several GPUs and FSDP2 units")


@pytest.mark.parametrize("requested", ["ddp", "zero2", "zero3", "hsdp"])
def test_an_explicit_parallel_mode_is_kept(requested):
    plan = resolve(config(parallel=requested, finetuning_type="full", fsdp_blocks_per_unit=2), env(4, "cpu", 2), None,
                   never_counted)
    assert plan.parallel == requested and "parallel" not in plan.why


@pytest.mark.parametrize("method, world_size, device, reason", [
    ("lora", 8, "cpu", "LoRA"), ("full", 1, "cpu", "one process"), ("full", 2, "cpu", "CPU processes")])
def test_auto_is_ddp_for_lora_one_process_and_cpu(method, world_size, device, reason):
    plan = resolve(config(finetuning_type=method), env(world_size, device), None, never_counted)
    assert plan.parallel == "ddp" and reason in plan.why["parallel"]
    assert plan.blocks_per_unit is None and plan.hsdp_shard_size is None


def test_cpu_defaults_are_resolved_with_their_reasons():
    plan = resolve(config(finetuning_type="full", bf16=True), env(2, "cpu"), None, never_counted)
    assert (plan.bf16, plan.padding_free, plan.compile, plan.fused_adamw, plan.gc_interval) == (False, False, False,
                                                                                                 False, 50)
    assert plan.weights_from_rank0 and plan.gradient_accumulation_steps == 1
    assert "ignored on CPU" in plan.why["precision"] and "on with CUDA" in plan.why["torch_compile"]
    text = plan.describe()
    assert "parallel                     ddp  (auto: CPU processes)" in text and "optim" in text
    one = resolve(config(gc_interval=7), env(1, "cpu"), None, never_counted)
    assert (one.gc_interval, resolve(config(), env(1, "cpu"), None, never_counted).gc_interval) == (7, 0)


def test_fsdp_units_and_hsdp_shards_are_resolved_from_the_model_and_the_node():
    plan = resolve(config(finetuning_type="full", parallel="hsdp"), env(4, "cpu", 2), None,
                   lambda: ModelSize(7_600_000_000, 233_000_000))
    assert (plan.blocks_per_unit, plan.hsdp_shard_size) == (4, 2)
    assert "within ~1B parameters" in plan.why["fsdp_blocks_per_unit"]
    with pytest.raises(ConfigError, match="hsdp_shard_size: 3 does not divide the 4 processes"):
        resolve(config(finetuning_type="full", parallel="hsdp", hsdp_shard_size=3), env(4, "cpu"), None,
                lambda: ModelSize(10, 1))


def test_a_resume_on_another_world_size_keeps_the_global_batch_or_says_why_not():
    manifest = {"global_batch": 8}
    plan = resolve(config(per_device_train_batch_size=2, gradient_accumulation_steps=1), env(2, "cpu"), manifest,
                   never_counted)
    assert plan.gradient_accumulation_steps == 2 and "1 -> 2" in plan.why["gradient_accumulation_steps"]
    with pytest.raises(ConfigError, match="global batch of 8, which 3 processes"):
        resolve(config(per_device_train_batch_size=2), env(3, "cpu"), manifest, never_counted)


@pytest.mark.parametrize("params_m,expected", [(0.01, 4), (46.8, 4), (233, 4), (306, 3), (488, 2), (878, 1),
                                               (2000, 1)])
def test_default_units_hold_at_most_four_blocks_and_about_a_billion_parameters(params_m, expected):
    # 1.5B, 7B, 14B, 32B and 72B Qwen2.5 blocks; a unit is never empty
    assert default_blocks_per_unit(int(params_m * 1e6)) == expected
    assert default_blocks_per_unit(0) == 4


@pytest.mark.parametrize("n_params, gpus, expected", [
    (1.54e9, 2, "zero2"),   # Qwen2.5-1.5B: 3 GB of bf16 weights + 12 GB of state per GPU
    (7.6e9, 4, "zero3"),    # 7B on 4: 15 GB + 30 GB would leave too little of 80 GB for activations
    (7.6e9, 8, "zero2"),    # 7B on 8: 15 GB + 15 GB
    (72.7e9, 16, "zero3"),  # 72B: its bf16 weights alone are 145 GB
])
def test_full_finetuning_on_several_gpus_shards_by_memory(n_params, gpus, expected):
    mode, why = sharding_for_full(int(n_params), gpus, 80 * GIB)
    assert mode == expected, why
    assert f"on {gpus} GPUs" in why and "GiB" in why


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The generation of every gc.collect call from here on (each still collects)."""
    recorded: list[int] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: recorded.append(generation) or real(generation))
    return recorded


def test_collection_runs_at_the_interval_only_and_walks_every_generation_now_and_then(calls):
    assert gc.isenabled()
    with StepGarbageCollection(3) as collection:
        assert not gc.isenabled()
        calls.clear()  # the collection on the way in
        for step in range(1, 31):
            collection.after_step(step)
    assert gc.isenabled()
    assert calls == [1] * 9 + [2]  # steps 3, 6, ..., 30; the tenth walks the oldest generation too


def test_automatic_collection_comes_back_after_a_failure():
    with pytest.raises(RuntimeError), StepGarbageCollection(50):
        assert not gc.isenabled()
        raise RuntimeError("a step failed")
    assert gc.isenabled()


def test_interval_zero_leaves_python_alone():
    with StepGarbageCollection(0) as collection:
        assert gc.isenabled()
        collection.after_step(50)
    assert collection.collections == 0


def test_training_collects_at_the_interval_and_says_what_auto_chose(tmp_path, tiny_model_dir, tiny_dataset,
                                                                    calls, capsys):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=4, gc_interval=2,
                                   parallel="auto", finetuning_type="full"))
    records = run(cfg).records
    assert [r["step"] for r in records][-1] == 4
    assert calls.count(1) == 2  # after steps 2 and 4
    assert gc.isenabled()
    out = capsys.readouterr().out
    assert "parallel                     ddp  (auto: one process)" in out
    assert json.loads((tmp_path / "out" / "run_plan.json").read_text())["parallel"] == "ddp"


QWEN_32B = ModelSize(32_763_876_352, 489_786_368, 64)  # Qwen2.5-32B: 64 blocks, 152064-token vocabulary


@pytest.mark.parametrize("gpu_gib, gpus, expected", [(80, 2, "ddp"), (24, 2, "zero3"), (24, 4, "zero3")])
def test_qlora_shards_when_the_whole_4bit_model_would_take_over_half_a_gpu(gpu_gib, gpus, expected):
    """32B in NF4 with bf16 embeddings and head: about 17.7 GiB (17.9 measured), under half of an 80 GB card, over
    half of 24 GiB."""
    mode, why = sharding_for_qlora(QWEN_32B, gpus, gpu_gib * GIB)
    assert mode == expected, why
    assert "17.7 GiB of 4-bit model per GPU" in why
    if expected == "zero3":
        assert f" GiB per GPU over {gpus}" in why and "zero3 shards it" in why


def test_qlora_auto_on_gpus_plans_for_gpu_memory_limit(monkeypatch):
    seen = []
    monkeypatch.setattr("meshtune.plan.smallest_gpu_memory", lambda device, limit: seen.append(limit) or
                        min(80 * GIB, (limit or 80) * GIB))
    cfg = config(finetuning_type="qlora", gpu_memory_limit=24)
    plan = resolve(cfg, env(2, "cuda"), None, lambda: QWEN_32B)
    assert plan.parallel == "zero3" and seen == [24] and "of 24 GiB" in plan.why["parallel"]
    assert plan.frozen_bf16 or not plan.bf16  # the frozen base, NF4 apart, in bf16 under FSDP2 too
    plan = resolve(config(finetuning_type="qlora"), env(2, "cuda"), None, lambda: QWEN_32B)
    assert plan.parallel == "ddp" and "Q-LoRA" in plan.why["parallel"]


def test_sharded_qlora_on_one_process_runs_as_ddp_and_hsdp_must_shard():
    plan = resolve(config(finetuning_type="qlora", parallel="zero3"), env(1, "cpu"), None, never_counted)
    assert plan.parallel == "ddp" and "zero3 on one process: nothing to shard" in plan.why["parallel"]
    with pytest.raises(ConfigError, match="hsdp with a shard of 1 process shards nothing.*hsdp_shard_size above 1"):
        resolve(config(finetuning_type="qlora", parallel="hsdp", hsdp_shard_size=1), env(2, "cpu"), None,
                lambda: ModelSize(10, 1))


def test_sharded_qlora_with_checkpointing_is_uncompiled_by_default_on_cuda(monkeypatch):
    monkeypatch.setattr("meshtune.plan.bf16_supported", lambda device: True)
    monkeypatch.setattr("meshtune.plan.varlen_available", lambda device: True)
    plan = resolve(config(finetuning_type="qlora", parallel="zero3", gradient_checkpointing=True), env(2, "cuda"),
                   None, lambda: QWEN_32B)
    assert not plan.compile and "fail their recompute" in plan.why["torch_compile"]
    for values in ({"parallel": "ddp", "gradient_checkpointing": True}, {"parallel": "zero3"}):
        assert resolve(config(finetuning_type="qlora", **values), env(2, "cuda"), None, lambda: QWEN_32B).compile
    assert resolve(config(finetuning_type="qlora", parallel="zero3", gradient_checkpointing=True, torch_compile=True),
                   env(2, "cuda"), None, lambda: QWEN_32B).compile  # asked for: kept
