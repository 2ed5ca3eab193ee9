"""Choices made for the user, resolved once into the run plan: `parallel: auto` and the other defaults, and garbage
collection at the same steps on every rank."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from conftest import base_config
from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.mesh import ParallelDims
from meshtune.plan import (EACH, ONCE, ModelSize, default_blocks_per_unit, full_state_bytes, gradient_reduction,
                           reshard_after_forward, resolve, resume_request, sharding_for_full, sharding_for_qlora)
from meshtune.train.garbage_collection import StepGarbageCollection, libraries_frozen
from meshtune.train.loop import run

GIB = 2**30


def env(world_size: int, device: str, local_world_size: int | None = None) -> DistEnv:
    return DistEnv(0, world_size, 0, local_world_size or world_size, torch.device(device))


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
    mode, why = sharding_for_full(config(finetuning_type="full"), int(n_params), gpus, 80 * GIB)
    assert mode == expected, why
    assert f"on {gpus} GPUs" in why and "GiB" in why


def test_one_memory_model_decides_every_choice_and_bf16_master_weights_halve_its_state():
    fp32, bf16 = config(finetuning_type="full"), config(finetuning_type="full", master_weights="bf16")
    n = int(6e9)
    assert full_state_bytes(fp32, n, 4, whole_weights=True) == 2 * n + 16 * n / 4
    assert full_state_bytes(bf16, n, 4, whole_weights=False, unsharded_grads=True) == 8 * n / 4 + 4 * n

    def size(parameters: float):
        return lambda: ModelSize(parameters=int(parameters), block_parameters=int(parameters) // 32, blocks=32)

    def card():
        return 80 * GIB

    # each choice flips (at half of an 80 GiB card) where the state's bytes a parameter do: 16 in fp32, 8 in bf16
    assert sharding_for_full(fp32, int(12e9), 8, card())[0] == "zero3"  # 2 + 16 / 8 bytes a parameter
    assert sharding_for_full(bf16, int(12e9), 8, card())[0] == "zero2"  # 2 + 8 / 8
    assert reshard_after_forward(fp32, "hsdp", 4, size(9e9), card, {}) is True   # 2 + 16 / 4
    assert reshard_after_forward(bf16, "hsdp", 4, size(9e9), card, {}) is False  # 2 + 8 / 4
    assert gradient_reduction(fp32, 4, "zero3", 2, size(6e9), card, {}) == EACH  # 16 / 4 + 4 unsharded
    assert gradient_reduction(bf16, 4, "zero3", 2, size(6e9), card, {}) == ONCE  # 8 / 4 + 4


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


def test_what_lives_before_training_is_out_of_the_collectors_reach_until_it_ends():
    """The libraries' objects are frozen while a run trains, so a full collection walks only what the run made; a
    cycle the run leaves behind is still collected, and every object is the collector's again after, also after a
    failure."""
    before = gc.get_freeze_count()
    with libraries_frozen():
        assert gc.get_freeze_count() > before + 10_000  # torch's and transformers' objects, imported by this module
        watcher = garbage_cycle()
        freed = gc.collect()  # (not inside an assert: pytest's rewriting would hold the objects it shows)
        assert freed >= 2 and watcher() is None
    assert gc.get_freeze_count() == before
    with pytest.raises(RuntimeError), libraries_frozen():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == before


class Node:
    pass


def garbage_cycle() -> weakref.ref:
    """Two objects that only hold each other: garbage that only a collection frees. A weak reference to one."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


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
    monkeypatch.setattr("meshtune.plan.bf16_supported", lambda device: True)  # GPUs with bf16, on any machine
    cfg = config(finetuning_type="qlora", gpu_memory_limit=24)
    plan = resolve(cfg, env(2, "cuda"), None, lambda: QWEN_32B)
    assert plan.parallel == "zero3" and seen == [24] and "of 24 GiB" in plan.why["parallel"]
    assert plan.bf16 and plan.frozen_bf16  # the frozen base, NF4 apart, in bf16 under FSDP2 too
    plan = resolve(config(finetuning_type="qlora"), env(2, "cuda"), None, lambda: QWEN_32B)
    assert plan.parallel == "ddp" and "Q-LoRA" in plan.why["parallel"]


def test_sharded_qlora_on_one_process_runs_as_ddp_and_hsdp_must_shard():
    plan = resolve(config(finetuning_type="qlora", parallel="zero3"), env(1, "cpu"), None, never_counted)
    assert plan.parallel == "ddp" and "zero3 on one process: nothing to shard" in plan.why["parallel"]
    with pytest.raises(ConfigError, match="hsdp with a shard of 1 process shards nothing.*hsdp_shard_size above 1"):
        resolve(config(finetuning_type="qlora", parallel="hsdp", hsdp_shard_size=1), env(2, "cpu"), None,
                lambda: ModelSize(10, 1))


def test_qlora_zero3_on_one_gpu_is_the_default_plan_in_every_field_but_the_reason(monkeypatch):
    """On one process `parallel: zero3` runs Q-LoRA exactly as the default does (unwrapped, compiled, the same
    recomputation): a speed difference between the two is the machine's, not a second path."""
    monkeypatch.setattr("meshtune.plan.bf16_supported", lambda device: True)
    monkeypatch.setattr("meshtune.plan.varlen_available", lambda device: True)
    plans = [resolve(config(finetuning_type="qlora", gradient_checkpointing_ratio=1.0, **extra), env(1, "cuda"),
                     None, lambda: ModelSize(7_615_616_512, 233_057_792, 28)) for extra in ({}, {"parallel": "zero3"})]
    default, zero3 = (dict(vars(plan), why={k: v for k, v in plan.why.items() if k != "parallel"}) for plan in plans)
    assert default == zero3 and plans[0].parallel == "ddp" and plans[0].compile


def test_sharded_qlora_with_checkpointing_is_uncompiled_by_default_on_cuda(monkeypatch):
    monkeypatch.setattr("meshtune.plan.bf16_supported", lambda device: True)
    monkeypatch.setattr("meshtune.plan.varlen_available", lambda device: True)
    plan = resolve(config(finetuning_type="qlora", parallel="zero3", gradient_checkpointing=True), env(2, "cuda"),
                   None, lambda: QWEN_32B)
    assert not plan.compile and "fail their recompute" in plan.why["torch_compile"]
    for values in ({"parallel": "ddp", "gradient_checkpointing": True},
                   {"parallel": "zero3", "gradient_checkpointing": False}):
        assert resolve(config(finetuning_type="qlora", **values), env(2, "cuda"), None, lambda: QWEN_32B).compile
    assert resolve(config(finetuning_type="qlora", parallel="zero3", gradient_checkpointing=True, torch_compile=True),
                   env(2, "cuda"), None, lambda: QWEN_32B).compile  # asked for: kept


@pytest.fixture
def gpus_of(monkeypatch):
    """CUDA as the plan sees it, without a GPU: every card of `gib` GiB, bf16 and varlen attention available."""
    def set_card(gib: float) -> None:
        monkeypatch.setattr("meshtune.plan.smallest_gpu_memory", lambda device, limit: gib * GIB)
        monkeypatch.setattr("meshtune.plan.bf16_supported", lambda device: True)
        monkeypatch.setattr("meshtune.plan.varlen_available", lambda device: True)
    return set_card


QWEN_7B = ModelSize(7_615_616_512, 233_057_792, 28)
QWEN_72B = ModelSize(72_706_203_648, 856_686_592, 80)


@pytest.mark.parametrize("size, nodes, per_node, expected, reason, reshard", [
    # 7B on 4 GPUs a node: its whole bf16 weights beside a quarter of the state would take over half the card
    (QWEN_7B, 2, 4, "hsdp", "hsdp shards the model over each node's GPUs (28.4 GiB of state per GPU of 80 GiB)",
     "42.6 GiB per GPU of 80 GiB; gathered again for backward, as zero3"),
    (QWEN_7B, 2, 8, "hsdp", "(14.2 GiB of state per GPU", "as zero2 (28.4 GiB of weights and state per GPU"),
    (QWEN_72B, 2, 8, "zero3", "one node's 8 GPUs cannot hold the model's state for hsdp (135.4 GiB each)", None),
    (QWEN_7B, 4, 1, "zero3", "full fine-tuning on 4 GPUs; zero2 would hold", None),  # one GPU a node: no shard in it
    (ModelSize(1_543_714_304, 46_797_824, 28), 2, 1, "ddp", "2 nodes of one GPU: each holds the whole model", None),
    (QWEN_7B, 1, 8, "zero2", "full fine-tuning on 8 GPUs", None),  # one node: as before
])
def test_auto_across_nodes_shards_inside_a_node_and_replicates_across(gpus_of, size, nodes, per_node, expected,
                                                                      reason, reshard):
    gpus_of(80)
    plan = resolve(config(finetuning_type="full"), env(nodes * per_node, "cuda", per_node), None, lambda: size)
    assert plan.parallel == expected and reason in plan.why["parallel"], plan.why["parallel"]
    if expected == "hsdp":
        assert plan.hsdp_shard_size == per_node and "only the gradients' all-reduce crosses" in plan.why["parallel"]
        assert reshard in plan.why["reshard_after_forward"]
        assert plan.reshard_after_forward is ("as zero3" in reshard)
    else:
        assert plan.reshard_after_forward is ({"zero3": True, "zero2": False}.get(expected))


def test_qlora_across_nodes_shards_inside_a_node_where_the_node_holds_the_4bit_model(gpus_of):
    gpus_of(24)  # 32B's 17.7 GiB of 4-bit model: over half a 24 GiB card, under half of four
    plan = resolve(config(finetuning_type="qlora"), env(8, "cuda", 4), None, lambda: QWEN_32B)
    assert plan.parallel == "hsdp" and "over each node's 4 GPUs instead" in plan.why["parallel"]
    assert plan.reshard_after_forward is True  # Q-LoRA's point is memory
    gpus_of(16)  # 8.9 GiB a GPU over 2: over half a 16 GiB card, so zero3 over all 8
    assert resolve(config(finetuning_type="qlora"), env(8, "cuda", 2), None, lambda: QWEN_32B).parallel == "zero3"


def test_lora_under_zero2_runs_as_ddp_and_says_why():
    """A DeepSpeed ZeRO-2 JSON becomes parallel: zero2; with LoRA its meaning (gradients and optimizer state
    sharded, weights whole) is ddp's, and FSDP2 would gather the frozen base every step."""
    plan = resolve(config(finetuning_type="lora", parallel="zero2"), env(4, "cpu"), None, never_counted)
    assert plan.parallel == "ddp" and "zero2 with LoRA runs as ddp" in plan.why["parallel"]
    assert plan.frozen_bf16 == plan.bf16 and plan.blocks_per_unit is None
    assert resolve(config(finetuning_type="lora", parallel="zero3"), env(4, "cpu"), None,
                   lambda: ModelSize(10, 1)).parallel == "zero3"  # zero3 does shard the base: kept


@pytest.mark.parametrize("parallel, world_size, values, expected, reason", [
    ("ddp", 2, {}, ("ddp", "fp32", None), None),
    ("ddp", 2, {"grad_sync": "flat", "grad_reduce_dtype": "bf16", "fsdp_prefetch": 2}, ("flat", "bf16", None),
     {"fsdp_prefetch": "ddp: no FSDP2 units to gather ahead"}),
    ("ddp", 1, {"grad_sync": "flat", "grad_reduce_dtype": "bf16"}, (None, None, None),
     {"grad_sync": "one process: no gradient crosses", "grad_reduce_dtype": "one process: no gradient crosses"}),
    ("zero3", 2, {"fsdp_prefetch": 2, "grad_reduce_dtype": "bf16"}, (None, "bf16", 2), None),
    ("zero2", 1, {"grad_sync": "flat"}, (None, "fp32", 0), {"grad_sync": "zero2: FSDP2 reduce-scatters"}),
])
def test_how_gradients_cross_and_what_fsdp2_prefetches_are_in_the_plan(parallel, world_size, values, expected,
                                                                       reason):
    """grad_sync, grad_reduce_dtype and fsdp_prefetch as the builder applies them: each where it does something,
    None (with why, where the config asked for it) where it does nothing."""
    plan = resolve(config(finetuning_type="full", parallel=parallel, fsdp_blocks_per_unit=1, **values),
                   env(world_size, "cpu"), None, lambda: ModelSize(10, 1))
    assert (plan.grad_sync, plan.grad_reduce_dtype, plan.fsdp_prefetch) == expected
    for key, text in (reason or {}).items():
        assert text in plan.why[key] and f"{key:<28} " in plan.describe()
    keys = ("grad_sync", "grad_reduce_dtype", "fsdp_prefetch")
    assert not reason or set(reason) == {key for key in keys if key in plan.why}


@pytest.mark.parametrize("resume, shared, found, asked, reason", [
    ("auto", True, "out/checkpoint-4", (True, None), "auto: the newest complete, verified checkpoint"),
    ("auto", True, None, (True, None), "auto: no complete checkpoint in output_dir"),
    ("none", True, None, (False, None), None),
    ("out/checkpoint-2", True, "out/checkpoint-2", (True, Path("out/checkpoint-2")), None),
    ("auto", False, None, (False, None), "not shared by all nodes (allow_local_checkpoints): no resume"),
])
def test_the_checkpoint_resumed_is_asked_for_and_recorded_by_the_plan(resume, shared, found, asked, reason):
    """resume_from_checkpoint auto asks the checkpoint manager for the newest complete, verified checkpoint; the plan
    records the one found (run_plan.json's resumed_from) and why, where meshtune chose it."""
    cfg = config(resume_from_checkpoint=resume)
    assert resume_request(cfg, shared) == asked
    plan = resolve(cfg, env(1, "cpu"), None, never_counted, resumed_from=Path(found) if found else None,
                   shared=shared)
    assert plan.resumed_from == found
    assert (reason in plan.why["resume_from_checkpoint"]) if reason else "resume_from_checkpoint" not in plan.why
    assert f"resume_from_checkpoint       {found or 'none: from step 0'}" in plan.describe()


@pytest.mark.parametrize("parallel, device, card, size, expected, reason", [
    ("ddp", "cpu", None, None, "once_per_step", "no_sync"),
    ("hsdp", "cpu", None, None, "shard_each_micro_step", "all-reduced across the replicas on the last only"),
    ("zero2", "cpu", None, None, "once_per_step", "no GPU to hold"),
    ("zero3", "cpu", None, None, "each_micro_step", "gradients stay sharded"),
    ("zero2", "cuda", 80, QWEN_7B, "each_micro_step", "70.9 GiB per GPU of 80 GiB"),  # 7B on 4: no room
    ("zero3", "cuda", 141, QWEN_7B, "once_per_step", "56.7 GiB per GPU of 141 GiB"),
])
def test_gradients_cross_once_an_optimizer_step_where_memory_allows(gpus_of, parallel, device, card, size, expected,
                                                                    reason):
    if card:
        gpus_of(card)
    plan = resolve(config(finetuning_type="full", parallel=parallel, gradient_accumulation_steps=4,
                          hsdp_shard_size=2), env(4, device, 2), None, lambda: size or ModelSize(10, 1))
    assert plan.gradient_reduction == expected and reason in plan.why["gradient_reduction"], plan.why
    assert f"gradient_reduction           {expected}" in plan.describe()
    one_step = resolve(config(finetuning_type="full", parallel=parallel, hsdp_shard_size=2), env(4, device, 2), None,
                       lambda: size or ModelSize(10, 1))
    assert one_step.gradient_reduction == "once_per_step" and "gradient_reduction" not in one_step.why


@pytest.mark.parametrize("values, device, expected, reason", [
    ({}, "cuda", "measure", "blocks are recomputed only where it would not fit memory_budget"),
    ({}, "cpu", 0.0, "default on CPU: nothing recomputed"),
    ({"gradient_checkpointing": True}, "cuda", "measure", None),
    ({"gradient_checkpointing": True}, "cpu", 1.0, "every block (memory is measured on GPUs only)"),
    ({"gradient_checkpointing_ratio": 0.5}, "cpu", 0.5, None),  # a ratio given turns it on
    ({"gradient_checkpointing": False}, "cuda", 0.0, None),
])
def test_recomputation_left_open_is_measured_on_gpus_and_off_on_cpu(gpus_of, values, device, expected, reason):
    """As LLaMA-Factory, which recomputes by default, a job that fits only with recomputation trains with the
    defaults; unlike it, a step that fits recomputes nothing."""
    gpus_of(80)
    plan = resolve(config(**values), env(1, device), None, never_counted)
    assert plan.recompute == expected
    assert ((reason in plan.why.get("gradient_checkpointing", "")) if reason
            else "gradient_checkpointing" not in plan.why)
    text = ("measured before training" if expected == "measure" else "off" if expected == 0.0 else
            f"{expected:g} of the blocks")
    assert f"gradient_checkpointing       {text}" in plan.describe()
    sharded_qlora = resolve(config(finetuning_type="qlora", parallel="zero3", **values), env(2, device), None,
                            lambda: QWEN_32B)
    assert sharded_qlora.compile == (device == "cuda" and expected == 0.0)  # a recomputed block runs uncompiled


def test_each_lever_conflict_names_a_config_key_and_a_condition_and_the_first_that_holds_gives_the_reason():
    from meshtune.config import TrainConfig
    from meshtune.plan import CONFLICTS, Layout, give_way
    from meshtune.plan.levers import UNDER

    assert {row.lever for row in CONFLICTS} <= set(TrainConfig.model_fields)
    assert {row.under for row in CONFLICTS} <= set(UNDER)
    layout = Layout(parallel="ddp", dims=ParallelDims.of({"pp": 2, "tp": 2}, env(4, "cpu")), hsdp_shard=None,
                    replicas_only=False, link=None)
    why: dict[str, str] = {}
    assert give_way("torch_compile", True, config(), layout, why) is False
    assert why["torch_compile"].startswith("off under tensor_parallel")  # tensor_parallel's row comes first
    assert give_way("grad_sync", "ddp", config(), layout, why) == "flat"
    untouched: dict[str, str] = {}
    assert give_way("fused_loss", False, config(), layout, untouched) is False and untouched == {}  # off already


@pytest.mark.parametrize("key, parallel", [("tensor_parallel", "zero3"), ("pipeline_parallel", "ddp")])
def test_tensor_and_pipeline_parallel_refuse_a_model_they_do_not_split_by_name(key, parallel):
    import dataclasses

    import plans

    other_type = dataclasses.replace(plans.QWEN_7B, model_type="gpt2")
    with pytest.raises(ConfigError, match=rf"^{key}: 2: meshtune splits the \w+ of qwen2, qwen3, llama, mistral "
                                          rf"models.*not model_type gpt2 of /m; set {key}: 1$"):
        plans.plan_for({key: 2, "parallel": parallel}, world_size=4, local=4, size=other_type)
    tied = dataclasses.replace(plans.QWEN_7B, tied_embeddings=True)
    with pytest.raises(ConfigError, match=rf"^{key}: 2: /m ties its output head to the input embedding "
                                          r"\(tie_word_embeddings\), .*small enough for"):
        plans.plan_for({key: 2, "parallel": parallel}, world_size=4, local=4, size=tied)


@pytest.mark.parametrize("masks, chosen, placed", [("torch", "torch", "outside its compiled graph"),
                                                    ("counter", "counter", "inside its compiled"),
                                                    ("auto", "counter", "auto: counter masks")])
def test_the_plan_says_where_lora_dropout_blocks_recompute(masks, chosen, placed):
    """LoRA with dropout, compiled blocks recomputed: the plan names the masks and where the recompute runs (auto:
    counter masks); without dropout, without compile or without recompute there is nothing to say, and auto keeps
    torch's dropout."""
    gpu = env(1, "cuda")
    lora = dict(finetuning_type="lora", lora_dropout=0.05, lora_dropout_masks=masks, gradient_checkpointing_ratio=1.0,
                torch_compile=True)
    plan = resolve(config(**lora), gpu, None, never_counted)
    assert placed in plan.why["lora_dropout_masks"] and plan.lora_dropout_masks == chosen
    assert f"lora_dropout_masks           {chosen}  (" in plan.describe()
    for other in ({"lora_dropout": 0.0}, {"torch_compile": False}, {"gradient_checkpointing": False,
                                                                     "gradient_checkpointing_ratio": "auto"}):
        elsewhere = resolve(config(**{**lora, **other}), gpu, None, never_counted)
        assert elsewhere.lora_dropout_masks == (None if "lora_dropout" in other else
                                                "counter" if masks == "counter" else "torch")
        assert "lora_dropout_masks" not in elsewhere.why


def test_a_memory_fit_that_finds_no_room_names_torchs_masks_where_the_blocks_have_counter_masks():
    """Where the fit refuses a run, the other ways to make room it names: torch's masks where the plan has counter
    masks (their step's peak was the higher one on a GPU), bf16 state for full fine-tuning with fp32 masters."""
    from meshtune.train.loop import BF16_STATE_ROOM, TORCH_MASKS_ROOM, more_room

    gpu = env(1, "cuda")
    lora = dict(finetuning_type="lora", lora_dropout=0.05, gradient_checkpointing_ratio=1.0, torch_compile=True)
    for masks, named in (("auto", True), ("counter", True), ("torch", False)):
        cfg = config(**lora, lora_dropout_masks=masks)
        assert more_room(cfg, resolve(cfg, gpu, None, never_counted)) == (TORCH_MASKS_ROOM if named else ""), masks
    full = config(finetuning_type="full", gradient_checkpointing_ratio=1.0, torch_compile=True)
    assert more_room(full, resolve(full, gpu, None, never_counted)) == BF16_STATE_ROOM
    bf16 = config(finetuning_type="full", master_weights="bf16", gradient_checkpointing_ratio=1.0)
    assert more_room(bf16, resolve(bf16, gpu, None, never_counted)) == ""
