"""Context parallelism: the run plan's mesh, data ranks and refusals (no processes, a CUDA job described to the
plan); the attention the ring replaces, against the model's own on padded rows (one process); and on a machine with
2 or 4 GPUs, `meshtune train` under context_parallel 2 and 4 against one process (skipped elsewhere: torch's ring
attention runs over the CUDA attention kernels; run `python3 -m pytest tests/test_context_parallel.py` there). The
split over the run's cp group itself runs on CPU ranks too: tests/test_mesh.py's `split_takes_its_chunks`."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch

from conftest import base_config, needs_gpus, read_metrics, run_cli, write_config
from meshtune.config import build_config
from meshtune.data.collate import IGNORE, collate
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.mesh import ParallelDims
from meshtune.plan import resolve
from meshtune.train.evaluation import Evaluator
from meshtune.train.sequence_split import SequenceSplit, row_multiple
from plans import QWEN_7B, env

def gpu_env(world_size: int, local_world_size: int | None = None, rank: int = 0, device: str = "cuda") -> DistEnv:
    return env(world_size, local_world_size, rank, device)


def plan_of(world_size: int = 4, local: int | None = None, device: str = "cuda", **values):
    """The plan of a job on 80 GB GPUs, bf16 set, so no choice asks a GPU this machine lacks."""
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "context_parallel": 2, "bf16": False,
                        **values})
    with mock.patch("meshtune.plan.smallest_gpu_memory", return_value=80 * 2**30):
        return resolve(cfg, gpu_env(world_size, local, device=device), None, lambda: QWEN_7B)


def test_the_cp_group_is_consecutive_ranks_inside_the_shards_and_takes_one_data_rank():
    full = plan_of(8, finetuning_type="full", parallel="zero3")
    assert full.mesh == {"dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1}
    assert full.context_parallel == 2 and full.model_parallel == 2
    data = full.data_env(gpu_env(8, rank=5))  # ranks 4 and 5 split the rows of data rank 2
    assert (data.rank, data.world_size) == (2, 4)
    hsdp = plan_of(8, 4, finetuning_type="full", parallel="hsdp")  # 2 nodes of 4: a node's processes shard
    assert hsdp.mesh == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1} and hsdp.hsdp_shard_size == 4
    lora = plan_of(4, finetuning_type="lora", parallel="ddp")  # replicas: a cp group's processes among them
    assert lora.mesh == {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 1} and lora.parallel == "ddp"
    # every process of the cp group holds partial gradients: the sharded mode spans them all, and a job whose one
    # data rank is 4 processes is no one-process job (full 7B under cp 4 on 4 GPUs shards its weights)
    alone = plan_of(4, finetuning_type="full", parallel="zero3", context_parallel=4)
    assert alone.parallel == "zero3" and alone.mesh == {"dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1}
    # the global batch is the data ranks'
    with pytest.raises(ConfigError, match="train_batch_size 16 .* x 2 processes = 4"):
        plan_of(4, finetuning_type="full", parallel="zero3", per_device_train_batch_size=1,
                gradient_accumulation_steps=2, train_batch_size=16)


def test_what_context_parallel_cannot_keep_is_turned_off_with_the_reason(tmp_path):
    plan = plan_of(4, finetuning_type="full", parallel="zero2")
    assert not plan.padding_free and "2 x context_parallel" in plan.why["padding_free"]
    assert not plan.compile and "ring attention" in plan.why["torch_compile"]
    assert plan.fused_loss  # computed on each process's share of the targets
    assert "context_parallel             2" in plan.describe()
    assert "dp_replicate 1 x dp_shard 2 x cp 2 x tp 1" in plan.describe()
    plan.write(tmp_path / "run_plan.json")
    assert json.loads((tmp_path / "run_plan.json").read_text())["mesh"]["cp"] == 2


@pytest.mark.parametrize("world_size, local, values, message", [
    (4, 4, {"tensor_parallel": 2}, "tensor_parallel above 1"),
    (4, 4, {"packing": True}, "packing .* block-diagonal mask"),
    (4, 4, {"padding_free": True}, "padding_free: true"),
    (4, 4, {"context_parallel": 3}, "3 does not divide the job's 4 processes; counts that work here: 1, 2, 4"),
    (8, 4, {"finetuning_type": "full", "parallel": "hsdp", "hsdp_shard_size": 2, "context_parallel": 4},
     "4 does not divide hsdp_shard_size 2"),
    (4, 4, {"device": "cpu"}, "needs CUDA GPUs"),
])
def test_impossible_layouts_are_refused_naming_what_works(world_size, local, values, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(world_size, local, **values)


def test_rows_are_padded_to_the_chunks_of_both_splits():
    assert [row_multiple(1, 1), row_multiple(2, 1), row_multiple(4, 1), row_multiple(1, 2)] == [1, 128, 256, 2]


def test_without_context_parallel_a_micro_batch_is_its_own_share(tiny_model_dir, tiny_dataset):
    split = SequenceSplit(ParallelDims.of({}, gpu_env(1, device="cpu")))
    loss_of = object()
    assert split.around(loss_of) is loss_of
    with split("batch") as local:
        assert local == "batch"


def test_the_ring_attentions_causal_sdpa_gives_the_models_losses_on_right_padded_rows(tiny_model_dir):
    """The attention the ring replaces (causal, no mask, key-value heads repeated) against the model's own sdpa with
    its padding mask, on rows of unequal lengths padded as cp 4 pads them: the same loss on every target."""
    from meshtune.model.context_parallel import use_context_parallel_attention
    from meshtune.model.loading import load_model
    from meshtune.train.objectives.token_loss import token_loss_sum

    dataset = [(np.arange(3, 3 + n), np.array([IGNORE] * 2 + list(range(5, 3 + n)))) for n in (9, 14, 6)]
    batch = collate([[0], [1], [2]], dataset=dataset, pad_id=0, packed=False, pad_to_multiple=row_multiple(4, 1),
                    padding_free=False)
    assert batch.input_ids.shape[1] == 256 and batch.attention_mask is not None
    model = load_model(tiny_model_dir, torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the repeat is exercised
    with torch.no_grad():
        want = token_loss_sum(model(**batch.model_inputs(), use_cache=False).logits, batch.targets)
        use_context_parallel_attention(model)
        inputs = {k: v for k, v in batch.model_inputs().items() if k != "attention_mask"}
        got = token_loss_sum(model(**inputs, use_cache=False).logits, batch.targets)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_attention_beyond_causal_sdpa_is_named_not_dropped():
    from meshtune.errors import ModelError
    from meshtune.model.context_parallel import causal_attention_forward

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ModelError, match="asks for sliding_window 4096; set context_parallel: 1"):
        causal_attention_forward(torch.nn.Identity(), q, q, q, None, sliding_window=4096)
    out, _ = causal_attention_forward(torch.nn.Identity(), q, q, q, None, sliding_window=None)
    assert out.shape == (1, 4, 2, 8)


def test_evaluation_counts_a_cp_groups_targets_once():
    """Each of the 2 processes of a cp group sums the loss of half the targets: the mean is over the batch's."""
    class Data(list):
        pass

    dataset = Data([[1, 2, 3]])
    batch = collate([[0]], dataset=[(np.arange(4, 8), np.arange(4, 8))], pad_id=0, packed=False, pad_to_multiple=1,
                    padding_free=False)
    evaluator = Evaluator(dataset, 1, None, 1, gpu_env(1, device="cpu"), lambda rows: batch,
                          lambda b: torch.tensor(3.0), lambda b: b.num_targets, target_share=1 / 2)
    assert evaluator.run(torch.nn.Linear(1, 1))["eval_loss"] == pytest.approx(3.0 / (3 * 0.5))


def ring_job(rank: int, world_size: int, workdir) -> None:
    """On 2 gloo ranks sharing GPU 0: a 2-block Qwen2 model (random, 4 heads, 2 key-value heads) trains one micro-
    batch of 3 padded rows through meshtune's forward loss under the split, and the summed loss and gradients of
    the two shares are compared with rank 0's whole batch through the model's own sdpa and padding mask. Gloo has
    no CUDA all-gather here (it crashes), so keys and values pass round the ring by all-to-all."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtune.model.context_parallel import use_context_parallel_attention
    from meshtune.model.loss_head import install_loss_head
    from meshtune.train.objectives.token_loss import forward_loss

    torch.cuda.set_device(0)
    set_rotate_method("alltoall")
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cuda:0"))
    rng = np.random.default_rng(0)
    data = []
    for n in (300, 211, 97):
        ids = rng.integers(3, 500, n)
        labels = ids.copy()
        labels[:n // 3] = IGNORE
        data.append((ids, labels))
    batch = collate([[0], [1], [2]], dataset=data, pad_id=0, packed=False, pad_to_multiple=row_multiple(2, 1))
    split = SequenceSplit(ParallelDims.of({"cp": 2}, env))  # the cp mesh, built once
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False)).to(dtype).cuda()
        install_loss_head(model)
        whole = forward_loss(model, batch.to(env.device), env, autocast_bf16=False, fused_loss=True)
        whole.backward()
        want = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        use_context_parallel_attention(model)
        with split(batch.to(env.device)) as local:
            assert local.input_ids.shape == (3, batch.input_ids.shape[1] // 2)
            share = forward_loss(model, local, env, autocast_bf16=False, fused_loss=True)
            share.backward()
        loss = share.detach().double()
        dist.all_reduce(loss)
        diff = norm = 0.0
        for n, p in model.named_parameters():
            grad = p.grad.double()
            dist.all_reduce(grad)
            diff += (grad - want[n]).pow(2).sum().item()
            norm += want[n].pow(2).sum().item()
        results[str(dtype)] = (abs(loss.item() / whole.item() - 1), (diff / norm) ** 0.5)
    (workdir / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.slow
def test_the_ring_over_a_split_batch_gives_the_whole_batchs_loss_and_gradients(tmp_path):
    """fp32 within 1e-6 (the ring's memory-efficient kernel; its log-sum-exp merges are the only difference), bf16
    within METHOD.md's 1e-2 for a whole tensor (flash attention)."""
    from ranks import run_ranks

    run_ranks(ring_job, 2, tmp_path)
    results = json.loads((tmp_path / "rank0.json").read_text())
    fp32_loss, fp32_grads = results["torch.float32"]
    bf16_loss, bf16_grads = results["torch.bfloat16"]
    assert fp32_loss < 1e-6 and fp32_grads < 1e-5, results
    assert bf16_loss < 1e-4 and bf16_grads < 1e-2, results


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [pytest.param(2, marks=needs_gpus(2)), pytest.param(4, marks=needs_gpus(4))])
def test_context_parallel_trains_as_one_process_and_its_checkpoint_resumes_on_one(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset, cp):
    """fp32 (the ring's memory-efficient kernel), zero3 over the processes of one cp group (2 or 4), against the
    same job on one process: the same losses within fp32's tolerance, and an evaluation on the held-out rows; then
    the cp job's checkpoint-3, resumed by one process, continues with the one-process losses."""
    def job(name: str, cp: int, **extra):
        out = tmp_path / name
        config = write_config(tmp_path / f"cfg-{name}", **base_config(
            tiny_model_dir, tiny_dataset, out, finetuning_type="full", parallel="zero3", context_parallel=cp,
            nproc_per_node=cp, bf16=False, torch_compile=False, max_steps=6, save_steps=3,
            per_device_train_batch_size=4, learning_rate=1e-3, val_size=8, eval_steps=3, eval_strategy="steps",
            tokenized_path=str(tmp_path / "tokenized"), **extra))
        result, _ = run_cli(["train", str(config)], timeout=400)
        assert result.returncode == 0, result.stdout[-4000:]
        return out, read_metrics(out)

    _, one = job("one", 1)
    out, split = job(f"cp{cp}", cp)
    assert json.loads((out / "run_plan.json").read_text())["mesh"]["cp"] == cp
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    evals, evals_one = ([(r["step"], r["eval_loss"]) for r in run if "eval_loss" in r] for run in (split, one))
    assert evals and [step for step, _ in evals] == [step for step, _ in evals_one]
    assert [loss for _, loss in evals] == pytest.approx([loss for _, loss in evals_one], rel=1e-4)
    _, resumed = job("resumed", 1, resume_from_checkpoint=str(out / "checkpoint-3"))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in one[3:]], rel=1e-4)
