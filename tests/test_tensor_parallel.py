"""Tensor parallelism: the run plan's device mesh and its refusals (no processes), how a block is split (one process,
a mesh of one), and on gloo ranks the losses of one process, full and LoRA, under tp 2 and tp 2 x dp 2 (stage: sft,
and stage: dpo with its rewards, each row's log-prob across the vocabulary's shares); a checkpoint of tp 2 x dp 2
resumed on 4 data-parallel processes and on one, and its final/ the full model; on a machine with 2 or 4 GPUs, tp 2
and tp 2 x dp 2 over NCCL against one GPU (skipped elsewhere)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import LLAMAFACTORY_DATA, base_config, needs_gpus, read_metrics, run_cli, write_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.plan import ModelSize, resolve
from plans import QWEN_7B, env, plan_for
from ranks import train_on_ranks

def plan_of(world_size: int = 4, local: int | None = None, size: ModelSize = QWEN_7B, **values):
    return plan_for({"tensor_parallel": 2, **values}, world_size, local, size)


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
    (4, 4, QWEN_7B, {"context_parallel": 2}, "context_parallel: 2 cannot be combined with tensor_parallel"),
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


def split_job(rank: int, world_size: int, workdir) -> None:
    """On 2 ranks of one tensor-parallel group: each model in workdir, with LoRA on every linear layer (B drawn
    non-zero, so the adapters shape the loss), gives the loss and the gradients of the unsplit model: of the
    adapters, and of every base weight too (made trainable here, as full fine-tuning trains them)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from meshtune.model.tensor_parallel import parallelize_model
    from meshtune.model.vocab_parallel_loss import IGNORE, vocab_parallel_loss_sum, vocab_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for model_dir in sorted(workdir.glob("model-*")):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), LoraConfig(
            r=4, target_modules="all-linear", lora_dropout=0.0))
        for name, param in model.named_parameters():
            param.requires_grad_(True)
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
        whole = copy.deepcopy(model)
        ids = torch.randint(0, 101, (2, 12))
        targets = ids[:, 1:].clone()
        targets[0, :4] = IGNORE  # rows without a target (prompts) count nothing
        losses = []
        for m in (whole, model):
            if m is model:
                parallelize_model(m, mesh)
            logits = m(input_ids=ids).logits[:, :-1]
            if m is model:  # each rank holds its share of the 101-token vocabulary's logits: 51, then 50
                assert logits.size(-1) == 51 - rank
                loss = vocab_parallel_loss_sum(logits, targets, vocab_shard(m))
            else:
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5 * losses[0], f"{model_dir.name}: {losses}"
        expected = dict(whole.named_parameters())
        adapters = [name for name, p in model.named_parameters() if "lora_" in name]
        assert len(adapters) == 2 * 7 * 2, model_dir.name  # A and B of 7 linear layers in 2 blocks
        for name, param in model.named_parameters():
            want, got = expected[name].grad, param.grad.full_tensor()
            error = float((got - want).norm() / want.norm())
            assert error < 1e-5, f"{model_dir.name} {name}: gradient off by {error:.2e} of its norm"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qwen3_llama_and_mistral_blocks_split_with_their_lora_exactly(tmp_path):
    """Qwen3's per-head query and key norms (applied to each process's share of the heads), Llama's and Mistral's
    bias-free projections, the loss across the vocabulary's shares: the loss and every gradient of the unsplit
    model."""
    import transformers

    from ranks import run_ranks

    for name in ("Qwen3", "Llama", "Mistral"):
        config = getattr(transformers, f"{name}Config")(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = getattr(transformers, f"{name}ForCausalLM")(config)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "norm" in key:  # not the ones they start as: a norm's weight must reach the output split
                    param.normal_(1.0, 0.2)
        model.save_pretrained(str(tmp_path / f"model-{name}"))
    run_ranks(split_job, 2, tmp_path)


def row_logps_job(rank: int, world_size: int, workdir) -> None:
    """Each row's summed target log-prob (stage: dpo's and kto's) from this rank's share of the vocabulary's logits:
    the value and the gradient of the whole logits, rows padded with positions that have no target."""
    from meshtune.model.vocab_parallel_loss import IGNORE, VocabShard, vocab_parallel_loss_sum
    from meshtune.train.objectives.preference import sequence_logps

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11) * 3
    targets = torch.randint(0, 11, (4, 6))
    targets[:, 4:] = IGNORE  # padding to a multiple of tensor_parallel: no target
    targets[0, :2] = IGNORE  # a prompt
    targets[3] = IGNORE  # a filler row
    weights = torch.randn(4)
    whole = logits.clone().requires_grad_(True)
    want, want_tokens = sequence_logps(whole, targets)
    (want * weights).sum().backward()
    start, end = (0, 6) if rank == 0 else (6, 11)
    share = logits[..., start:end].clone().requires_grad_(True)
    shard = VocabShard(torch.distributed.group.WORLD, start)
    got, tokens = sequence_logps(share, targets, vocab=shard)
    (got * weights).sum().backward()
    assert torch.equal(tokens, want_tokens) and got[3] == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(share.grad, whole.grad[..., start:end], rtol=1e-6, atol=1e-6)
    loss = vocab_parallel_loss_sum(logits[..., start:end], targets, shard)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_row_log_probs_across_vocabulary_shares_and_their_gradient_are_the_whole_logits(tmp_path):
    from ranks import run_ranks

    run_ranks(row_logps_job, 2, tmp_path)


# ---- on gloo ranks: the losses of one process --------------------------------------------------------------------

RUNS: dict[tuple, dict] = {}  # a run two tests read (one process's full fine-tuning, its tp 2 x dp 2) runs once


def train(tmp_path, model_dir, dataset, method: str, nproc: int, tp: int, accumulation: int, name: str,
          **extra) -> dict:
    """A run of 4 steps at global batch 8 (2 rows a micro-step); its records, output_dir. Run once a module for
    the same settings: the second test to ask reads the first one's (its output_dir under that test's tmp_path)."""
    key = (str(model_dir), str(dataset), method, nproc, tp, accumulation, tuple(sorted(extra.items())))
    if key not in RUNS:
        RUNS[key] = _train(tmp_path, model_dir, dataset, method, nproc, tp, accumulation, name, **extra)
    return RUNS[key]


def _train(tmp_path, model_dir, dataset, method: str, nproc: int, tp: int, accumulation: int, name: str,
           **extra) -> dict:
    out = tmp_path / name
    out.mkdir()
    values = base_config(model_dir, dataset, out / "output", finetuning_type=method, parallel="ddp",
                         nproc_per_node=nproc, tensor_parallel=tp, per_device_train_batch_size=2,
                         gradient_accumulation_steps=accumulation, tokenized_path=str(tmp_path / "tokenized"),
                         learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, save_final=False)
    values.update(extra)
    config = str(write_config(out, **values))
    train_on_ranks(config, nproc, out / "ranks")
    plan = json.loads((out / "output" / "run_plan.json").read_text())
    assert plan["mesh"]["tp"] == tp, plan["mesh"]
    return {"losses": [r["loss"] for r in read_metrics(out / "output")], "output": out / "output", "plan": plan}


def assert_same_losses(losses: list[float], reference: list[float], what: str) -> None:
    assert len(losses) == len(reference), f"{what}: {losses} vs {reference}"
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step} loss {got} vs one process {want}"


# what the checkpoint test reads of full fine-tuning's runs (final/, checkpoint-2), which saving leaves the losses
# of: the equality test's runs save it too, and each run serves both tests
SAVED = {"lora": {}, "full": {"save_final": True}}
TP2_DP2_SAVED = dict(parallel="zero3", save_steps=2, save_final=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_tp2_and_tp2_x_dp2_give_the_losses_of_one_process(tmp_path, tiny_model_dir, tiny_dataset, method):
    reference = train(tmp_path, tiny_model_dir, tiny_dataset, method, 1, 1, 4, "one", **SAVED[method])["losses"]
    assert reference[-1] < reference[0], f"the loss should fall: {reference}"
    # every process reads the files here (rank 0's weights reach the others in the tp 2 x dp 2 run)
    tp2 = train(tmp_path, tiny_model_dir, tiny_dataset, method, 2, 2, 4, "tp2", load_weights_on="every_rank")["losses"]
    assert_same_losses(tp2, reference, f"{method} tp 2")
    tp2_dp2 = train(tmp_path, tiny_model_dir, tiny_dataset, method, 4, 2, 2, "tp2dp2",
                    **(TP2_DP2_SAVED if method == "full" else {}))["losses"]
    assert_same_losses(tp2_dp2, reference, f"{method} tp 2 x dp 2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp2_x_dp2_checkpoint_resumes_on_dp4_and_on_one_process_and_exports_the_full_model(
        tmp_path, tiny_model_dir, tiny_dataset):
    """Checkpoints are layout-free: DCP reshards the tensor-parallel shards for 4 data-parallel processes and for
    one, the global batch kept (gradient accumulation 2 -> 1 and 2 -> 4), and steps 3-4 continue as one process
    would train them; final/ of the tp run holds the whole tensors one process saves."""
    full = TP2_DP2_SAVED
    reference = train(tmp_path, tiny_model_dir, tiny_dataset, "full", 1, 1, 4, "one", **SAVED["full"])
    tp_run = train(tmp_path, tiny_model_dir, tiny_dataset, "full", 4, 2, 2, "tp2dp2", **full)
    assert_same_losses(tp_run["losses"], reference["losses"], "tp 2 x dp 2")
    checkpoint = str(tp_run["output"] / "checkpoint-2")
    dp4 = train(tmp_path, tiny_model_dir, tiny_dataset, "full", 4, 1, 2, "dp4", resume_from_checkpoint=checkpoint,
                **full)
    assert dp4["plan"]["gradient_accumulation_steps"] == 1 and dp4["plan"]["resumed_from"] == checkpoint
    assert_same_losses(dp4["losses"], reference["losses"][2:], "resumed on dp 4")
    one = train(tmp_path, tiny_model_dir, tiny_dataset, "full", 1, 1, 2, "resumed-one",
                resume_from_checkpoint=checkpoint, save_final=False)
    assert one["plan"]["gradient_accumulation_steps"] == 4
    assert_same_losses(one["losses"], reference["losses"][2:], "resumed on one process")
    exported = load_file(str(tp_run["output"] / "final" / "model.safetensors"))
    expected = load_file(str(reference["output"] / "final" / "model.safetensors"))
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].shape == tensor.shape, name
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


DPO_VALUES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def train_dpo(tmp_path, model_dir, method: str, nproc: int, tp: int, accumulation: int, name: str,
              **extra) -> list[dict]:
    """stage: dpo on 9 training pairs at global batch 4 (one pair a micro-step): 3 steps, the last one's single pair
    leaving the other data ranks filler micro-batches; 3 held-out pairs evaluated at the end."""
    out = tmp_path / name
    values = base_config(model_dir, "dpo_en_demo", out / "output", stage="dpo", dataset_dir=str(LLAMAFACTORY_DATA),
                         finetuning_type=method, parallel="ddp", nproc_per_node=nproc, tensor_parallel=tp,
                         cutoff_len=256, val_size=3, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                         gradient_accumulation_steps=accumulation, max_steps=-1, num_train_epochs=1,
                         eval_strategy="steps", eval_steps=3, learning_rate=5e-2 if method == "lora" else 1e-3,
                         tokenized_path=str(tmp_path / "tokenized"), save_final=False,
                         precompute_ref_log_probs=False)  # the reference in each step, unless a run asks
    values.update(extra)
    config = str(write_config(out, **values))
    train_on_ranks(config, nproc, out / "ranks")
    assert json.loads((out / "output" / "run_plan.json").read_text())["mesh"]["tp"] == tp
    return read_metrics(out / "output")


def assert_same_dpo_records(records: list[dict], reference: list[dict], what: str) -> None:
    """Within 1e-5: a reward is beta x a difference of log-probs of hundreds, whose fp32 sums differ in the last
    digits between the split and the whole head, so it is held to 1e-5 absolute, the rest also relative."""
    assert [r["step"] for r in records] == [r["step"] for r in reference] == [1, 2, 3], what
    for got, want in zip(records, reference):
        for name in DPO_VALUES:
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-5), f"{what}: step {got['step']} {name}"
    assert records[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=1e-5), what


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_under_tp2_and_tp2_x_dp2_gives_one_processs_losses_and_rewards(tmp_path, tiny_model_dir, method):
    """The policy's and the reference's row log-probs across the vocabulary's shares: LoRA's reference the policy
    with its adapters off, full fine-tuning's a frozen copy split over tp as the policy is (and sharded by zero3
    over the data ranks under tp 2 x dp 2); with precompute_ref_log_probs, the pass's batches dealt to the tp
    groups."""
    one = train_dpo(tmp_path, tiny_model_dir, method, 1, 1, 4, "one")
    assert one[-1]["rewards/margins"] != 0  # the policy has moved from its reference
    tp2 = train_dpo(tmp_path, tiny_model_dir, method, 2, 2, 4, "tp2")
    assert_same_dpo_records(tp2, one, f"{method} tp 2")
    tp2_dp2 = train_dpo(tmp_path, tiny_model_dir, method, 4, 2, 2, "tp2dp2",
                        parallel="zero3" if method == "full" else "ddp")
    assert_same_dpo_records(tp2_dp2, one, f"{method} tp 2 x dp 2")
    precomputed = train_dpo(tmp_path, tiny_model_dir, method, 4, 2, 2, "tp2dp2-precomputed",
                            precompute_ref_log_probs=True)
    assert_same_dpo_records(precomputed, one, f"{method} tp 2 x dp 2, reference precomputed")


# ---- on 2 or 4 CUDA GPUs (NCCL): the same equality where tensor parallel is meant to run -------------------------

LAYOUTS = [pytest.param(2, id="tp2", marks=needs_gpus(2)), pytest.param(4, id="tp2xdp2", marks=needs_gpus(4))]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gpus", LAYOUTS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_tensor_parallel_on_gpus_trains_as_one_gpu(tmp_path, tiny_model_dir, tiny_dataset, method, gpus):
    """`meshtune train` through torchrun: tp 2 over NCCL (on 4 GPUs tp 2 x dp 2, zero3 for full fine-tuning)
    against one GPU at the same global batch, in fp32 (the same losses within 1e-4: the split matmuls and the
    vocabulary-parallel loss sum in another order) and in bf16 (within bf16's 2e-2)."""
    def job(name: str, nproc: int, bf16: bool) -> list[float]:
        out = tmp_path / name
        data_ranks = max(nproc // 2, 1)  # tp 2 pairs; global batch 8 = 2 rows x accumulation x data ranks
        config = write_config(tmp_path / f"cfg-{name}", **base_config(
            tiny_model_dir, tiny_dataset, out, finetuning_type=method, tensor_parallel=min(nproc, 2),
            nproc_per_node=nproc, parallel="zero3" if method == "full" and data_ranks > 1 else "ddp", bf16=bf16,
            torch_compile=False, per_device_train_batch_size=2, gradient_accumulation_steps=4 // data_ranks,
            learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=5, save_final=False,
            tokenized_path=str(tmp_path / "tokenized")))
        result, _ = run_cli(["train", str(config)], timeout=400)
        assert result.returncode == 0, result.stdout[-4000:]
        if nproc > 1:
            assert json.loads((out / "run_plan.json").read_text())["mesh"]["tp"] == 2
        return [r["loss"] for r in read_metrics(out)]

    for bf16, tolerance in ((False, 1e-4), (True, 2e-2)):
        one = job(f"one-{bf16}", 1, bf16)
        assert one[-1] < one[0], f"the loss should fall: {one}"
        split = job(f"tp-{bf16}", gpus, bf16)
        assert split == pytest.approx(one, rel=tolerance), f"bf16={bf16}: {gpus} GPUs {split} vs one GPU {one}"
