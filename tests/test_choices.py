"""Choices made for the user: `parallel: auto`, and garbage collection at the same steps on every rank."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from conftest import base_config
from meshtune.config import build_config
from meshtune.model.parallel import choose_parallel, sharding_for_full
from meshtune.train.collection import StepGarbageCollection, default_interval
from meshtune.train.loop import run

GIB = 2**30


def env(world_size: int, device: str) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, device=torch.device(device))


def never_counted() -> int:
    raise AssertionError("the parameter count is needed only for full fine-tuning on several GPUs")


@pytest.mark.parametrize("requested", ["ddp", "zero2", "zero3", "hsdp"])
def test_an_explicit_parallel_mode_is_kept(requested):
    assert choose_parallel(requested, False, env(4, "cpu"), never_counted) == (requested, "")


@pytest.mark.parametrize("is_lora, world_size, device, reason", [
    (True, 8, "cpu", "LoRA"), (False, 1, "cpu", "one process"), (False, 2, "cpu", "CPU processes")])
def test_auto_is_ddp_for_lora_one_process_and_cpu(is_lora, world_size, device, reason):
    mode, why = choose_parallel("auto", is_lora, env(world_size, device), never_counted)
    assert mode == "ddp" and reason in why


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
    assert (default_interval(None, 1), default_interval(None, 2), default_interval(7, 1)) == (0, 50, 7)


def test_training_collects_at_the_interval_and_says_what_auto_chose(tmp_path, tiny_model_dir, tiny_dataset,
                                                                    calls, capsys):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=4, gc_interval=2,
                                   parallel="auto", finetuning_type="full"))
    records = run(cfg).records
    assert [r["step"] for r in records][-1] == 4
    assert calls.count(1) == 2  # after steps 2 and 4
    assert gc.isenabled()
    assert "parallel auto: ddp (one process)" in capsys.readouterr().out
