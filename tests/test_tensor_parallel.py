"""Tensor parallelism: the run plan's device mesh and its refusals (no processes), how a block is split (one process,
a mesh of one), and on gloo ranks the losses of one process, full and LoRA, under tp 2 and tp 2 x dp 2; a checkpoint
of tp 2 x dp 2 resumed on 4 data-parallel processes and on one, and its final/ the full model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_config, read_metrics, write_config
from meshtune.cli import main
from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.plan import ModelSize, resolve
from ranks import run_workers

QWEN_7B = ModelSize(7_615_616_512, 233_057_792, 28, attention_heads=28, kv_heads=4, model_type="qwen2")


def env(world_size: int, local_world_size: int | None = None, rank: int = 0) -> DistEnv:
    local = local_world_size or world_size
    return DistEnv(rank, world_size, rank % local, local, torch.device("cpu"))


def plan_of(world_size: int = 4, local: int | None = None, size: ModelSize = QWEN_7B, **values):
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "tensor_parallel": 2, **values})
    return resolve(cfg, env(world_size, local), None, lambda: size)


def test_the_mesh_puts_tp_innermost_and_the_data_parallel_mode_over_the_groups():
    lora = plan_of(finetuning_type="lora", parallel="ddp")
    assert lora.mesh == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2}
    assert lora.parallel == "hsdp" and lora.hsdp_shard_size == 1 and "dp_replicate" in lora.why["parallel"]
    full = plan_of(8, finetuning_type="full", parallel="zero3")
    assert full.mesh == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
    hsdp = plan_of(8, 4, finetuning_type="full", parallel="hsdp")  # 2 nodes of 4: shards of one node's 2 groups
    assert hsdp.mesh == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    # the data counts tensor-parallel groups: rank 5 of 8 is data rank 2 of 4, and the global batch is theirs
    data = full.data_env(env(8, rank=5))
    assert (data.rank, data.world_size) == (2, 4)
    with pytest.raises(ConfigError, match="train_batch_size 16 .* x 4 processes = 8"):
        plan_of(8, finetuning_type="full", per_device_train_batch_size=1, gradient_accumulation_steps=2,
                train_batch_size=16)


def test_what_tensor_parallel_cannot_keep_is_turned_off_with_the_reason_and_written_to_run_plan(tmp_path):
    plan = plan_of(finetuning_type="full", parallel="zero2", padding_free=True, torch_compile=True)
    assert not (plan.fused_loss or plan.padding_free or plan.compile)
    assert "vocabulary is split" in plan.why["fused_loss"] and "padded" in plan.why["padding_free"]
    assert "eagerly" in plan.why["torch_compile"]
    assert "tensor_parallel              2" in plan.describe()
    assert "dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in plan.describe()
    plan.write(tmp_path / "run_plan.json")
    written = json.loads((tmp_path / "run_plan.json").read_text())
    assert written["mesh"]["tp"] == 2 and "vocabulary is split" in written["why"]["fused_loss"]


def test_without_tensor_parallel_the_plan_is_the_data_parallel_one():
    one = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "finetuning_type": "full",
                        "parallel": "zero2", "fused_loss": True})
    plan = resolve(one, env(4), None, lambda: QWEN_7B)
    assert plan.tensor_parallel == 1 and plan.mesh == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    assert plan.fused_loss and "tensor_parallel" not in plan.describe()
    this = env(4, rank=3)
    assert plan.data_env(this) is this


@pytest.mark.parametrize("world_size, local, size, values, message", [
    (4, 4, QWEN_7B, {"tensor_parallel": 3}, "3 does not divide the 4 processes of a node .* work here: 1, 2, 4"),
    (8, 4, QWEN_7B, {"tensor_parallel": 8}, "8 does not divide the 4 processes of a node"),
    (8, 8, QWEN_7B, {"tensor_parallel": 8}, "does not divide the model's 28 attention heads and 4 key-value heads .*"
                                            "; counts that work here: 1, 2, 4"),
    (4, 4, QWEN_7B, {"finetuning_type": "qlora"}, "qlora"),
    (4, 4, QWEN_7B, {"finetuning_type": "full", "parallel": "zero3", "cpu_offload": True}, "cpu_offload"),
    (4, 4, QWEN_7B, {"additional_target": "lm_head"}, "additional_target"),
    (4, 4, ModelSize(10, 1, 1, 4, 4, "gemma"), {}, "not model_type gemma"),
    (4, 4, ModelSize(10, 1, 1, 4, 4, "qwen2", tied_embeddings=True), {}, "tie_word_embeddings"),
    (4, 4, QWEN_7B, {"tensor_parallel": 1, "context_parallel": 2}, "context parallel is not available yet"),
])
def test_impossible_layouts_are_refused_naming_what_works(world_size, local, size, values, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(world_size, local, size, **values)


def test_a_block_is_split_column_wise_then_row_wise_with_lora_matched_to_its_base(tiny_model_dir):
    """On a mesh of one process: which parameters each style split (placements), frozen ones kept frozen."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from meshtune.model.lora import add_lora
    from meshtune.model.loading import load_model
    from meshtune.model.tensor_parallel import parallelize_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = build_config({"model_name_or_path": str(tiny_model_dir), "dataset": "d.jsonl", "lora_target": "all"})
        model = add_lora(load_model(tiny_model_dir, torch.float32), cfg)
        parallelize_model(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        params = dict(model.named_parameters())
        layer = "base_model.model.model.layers.0."
        placements = {name[len(layer):]: params[name].placements for name in params if name.startswith(layer)}
        assert placements["self_attn.q_proj.base_layer.weight"] == (Shard(0),)
        assert placements["self_attn.q_proj.base_layer.bias"] == (Shard(0),)
        assert placements["self_attn.q_proj.lora_A.default.weight"] == (Replicate(),)
        assert placements["self_attn.q_proj.lora_B.default.weight"] == (Shard(0),)
        assert placements["mlp.down_proj.base_layer.weight"] == (Shard(1),)
        assert placements["mlp.down_proj.lora_A.default.weight"] == (Shard(1),)
        assert placements["mlp.down_proj.lora_B.default.weight"] == (Replicate(),)
        assert placements["input_layernorm.weight"] == (Replicate(),)
        assert params["base_model.model.model.embed_tokens.weight"].placements == (Shard(0),)
        assert params["base_model.model.lm_head.weight"].placements == (Shard(0),)
        trained = {name for name, p in params.items() if p.requires_grad}
        assert trained and all("lora_" in name for name in trained)
    finally:
        dist.destroy_process_group()


# ---- on gloo ranks: the losses of one process --------------------------------------------------------------------

RUNS: dict[tuple, dict] = {}


def train(tmp_path, model_dir, dataset, method: str, nproc: int, tp: int, accumulation: int, name: str,
          **extra) -> dict:
    """A run of 4 steps at global batch 8 (2 rows a micro-step); its records, output_dir."""
    out = tmp_path / name
    out.mkdir()
    values = base_config(model_dir, dataset, out / "output", finetuning_type=method, parallel="ddp",
                         nproc_per_node=nproc, tensor_parallel=tp, per_device_train_batch_size=2,
                         gradient_accumulation_steps=accumulation, tokenized_path=str(tmp_path / "tokenized"),
                         learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, save_final=False)
    values.update(extra)
    config = str(write_config(out, **values))
    if nproc == 1:
        assert main(["train", config]) == 0
    else:
        codes, output = run_workers(["train", config], nproc, out / "ranks", timeout=240)
        assert codes == [0] * nproc, output[-6000:]
    plan = json.loads((out / "output" / "run_plan.json").read_text())
    assert plan["mesh"]["tp"] == tp, plan["mesh"]
    return {"losses": [r["loss"] for r in read_metrics(out / "output")], "output": out / "output", "plan": plan}


def assert_same_losses(losses: list[float], reference: list[float], what: str) -> None:
    assert len(losses) == len(reference), f"{what}: {losses} vs {reference}"
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step} loss {got} vs one process {want}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_tp2_and_tp2_x_dp2_give_the_losses_of_one_process(tmp_path, tiny_model_dir, tiny_dataset, method):
    reference = train(tmp_path, tiny_model_dir, tiny_dataset, method, 1, 1, 4, "one")["losses"]
    assert reference[-1] < reference[0], f"the loss should fall: {reference}"
    tp2 = train(tmp_path, tiny_model_dir, tiny_dataset, method, 2, 2, 4, "tp2")["losses"]
    assert_same_losses(tp2, reference, f"{method} tp 2")
    tp2_dp2 = train(tmp_path, tiny_model_dir, tiny_dataset, method, 4, 2, 2, "tp2dp2",
                    parallel="zero3" if method == "full" else "ddp")["losses"]
    assert_same_losses(tp2_dp2, reference, f"{method} tp 2 x dp 2")
