"""The CUDA-only kernels behind the fast path, checked against the plain path on the GPU, and cpu_offload's host
shards against zero3 without them (skipped without one; run them on a device machine: `python3 -m pytest
tests/test_cuda_paths.py`). bf16 tolerances, as METHOD.md gives them: relative error of a whole tensor between
1e-3 and 1e-2."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import base_config, needs_gpus, read_metrics, run_cli, write_config
from meshtune.config import build_config
from meshtune.data.collate import IGNORE
from meshtune.model import attention
from meshtune.model.loss_head import linear_cross_entropy
from meshtune.train.bf16_adamw import StochasticBf16AdamW
from meshtune.train.loop import run

# slow: Triton and the compiler start processes to build their kernels
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_bf16_adamw_kernel_matches_its_reference():
    """master_weights: bf16's Triton kernel (every parameter in one launch) against the operator-by-operator
    reference on the same GPU: shapes below, at and across the kernel's 8,192-element chunks, an empty shard, two
    groups with and without decay, three steps with new gradient tensors each. Weights and moments agree except
    where fused multiply-adds move an fp32 result across a rounding boundary: rare, and one bf16 step apart."""
    shapes = [(3,), (8192,), (8193,), (0,), (257, 129), (64, 1024), (5000, 7)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    start = [(torch.randn(s, device="cuda", generator=generator) * 0.05).bfloat16() for s in shapes]
    runs = []
    for kernel in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        groups = [{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        optimizer = StochasticBf16AdamW(groups, lr=1e-3, seed=5, kernel=kernel)
        generator.manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, device="cuda", generator=generator) * 1e-2).bfloat16()
            optimizer.step()
        assert (optimizer._launcher is not None) == kernel
        runs.append([(p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in params])
    for got, want in zip(runs[0], runs[1]):
        for a, b in zip(got, want):
            differ = a != b
            assert differ.float().mean().item() <= 1e-3 if a.numel() else True
            step = (b.float().view(torch.int32) + 0x10000).view(torch.float32) - b.float()  # one bf16 step at b
            assert ((a.float() - b.float()).abs() <= step.abs() * 1.01)[differ].all()
    moved = sum((a[0] != t).sum().item() for a, t in zip(runs[0], start))
    assert moved > 0.5 * sum(t.numel() for t in start)  # the kernel did update the weights


def test_varlen_kernel_matches_causal_attention_per_sample():
    assert attention.VARLEN_ATTN is not None, "torch.nn.attention.varlen is missing"
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 300, 1, 64, 700]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, 12, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    k = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    v = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = attention.causal_varlen(q, k, v, cu, max(lengths), None)
    assert not out.isnan().any()
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        want = F.scaled_dot_product_attention(*(t[sl].transpose(0, 1).double() for t in (q, k, v)), is_causal=True,
                                              enable_gqa=True).transpose(0, 1)
        assert rel_err(out[sl], want) < 1e-2, n
        start += n


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_loss_matches_full_logits_on_cuda(compiled):
    generator = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
    weight = (torch.randn(32000, 512, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.05).requires_grad_()
    targets = torch.randint(0, 32000, (3000,), device="cuda", generator=generator)
    targets[::7] = IGNORE
    positions = (targets != IGNORE).nonzero().squeeze(1)
    fused = linear_cross_entropy(hidden, weight, positions, targets[positions], compiled=compiled)
    fused.backward()
    got = fused.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=IGNORE, reduction="sum")
    plain.backward()
    assert rel_err(got[0], plain.detach()) < 1e-3
    assert rel_err(got[1], hidden.grad) < 1e-2
    assert rel_err(got[2], weight.grad) < 1e-2


@pytest.mark.parametrize("method", ["lora", "full"])
def test_fast_path_on_cuda_tracks_the_plain_path(tmp_path, tiny_model_dir, tiny_dataset, method):
    """The defaults for CUDA (padding-free varlen, fused compiled loss, compiled blocks) against padded batches,
    full logits and eager blocks, bf16: losses within bf16 noise."""
    def losses(name, **extra):
        cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / name, finetuning_type=method,
                                       learning_rate=1e-3, max_steps=4, val_size=8, **extra))
        records = run(cfg).records
        return [r["loss"] for r in records] + [records[-1]["eval_loss"]]

    fast = losses("fast")
    plain = losses("plain", padding_free=False, fused_loss=False, torch_compile=False)
    assert fast == pytest.approx(plain, rel=2e-2)


def test_profile_summary_splits_device_time(tmp_path, tiny_model_dir, tiny_dataset):
    """profile_steps on CUDA: the summary's head gives kernel time (not the CPU ops that launched the kernels
    counted a second time), which cannot exceed the window's wall time on one stream."""
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=3, profile_steps="2-3",
                                   torch_compile=False))
    run(cfg)
    head = (tmp_path / "out" / "profile" / "summary.txt").read_text().splitlines()[:2]
    wall = float(head[0].split(": ")[1].split(" s")[0])
    busy = float(head[1].split("kernels and copies ")[1].split(" s")[0])
    assert 0 < busy <= wall, head


def test_full_finetuning_blocks_take_every_token_count_without_compiling_again():
    """Norm weights that train give inductor's fused RMSNorm backward (mix-order reduction), whose strict checks
    guard on the token count (>= 4096 rows, >= 5 MiB, rows >= 2 x hidden). Token counts on both sides of each
    must reuse the blocks compiled at the first step (compile_blocks turns those checks off)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtune.model.compile import compile_blocks
    from meshtune.train.metrics import compile_seconds

    torch._dynamo.reset()
    config = Qwen2Config(vocab_size=1000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config).cuda()  # fp32 master weights, all trainable, as full fine-tuning
    compile_blocks(model)
    seconds = []
    for tokens in (5000, 3000, 3300, 3500, 4100, 6000):  # around 2 x 1536, 5 MiB / (1536 x 1), 4096
        ids = torch.randint(0, 1000, (1, tokens), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, use_cache=False).logits.float().mean()
        loss.backward()
        seconds.append(compile_seconds())
    assert seconds[1:] == [seconds[0]] * 5, seconds
    torch._dynamo.reset()


def assert_same_curve(got: list[dict], want: list[dict]) -> None:
    """Per-step losses and gradient norms of two fp32 runs: equal but for the fused AdamW kernels of CPU and GPU,
    which round apart by an ulp. (Under bf16 compute such an ulp flips a bf16 rounding now and then, and Adam's
    sign-like first steps carry it into whole updates: too coarse a check of the offload path.)"""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-3)


def same_weights(a, b) -> bool:
    """Two final/ model directories of fp32 runs hold the same tensors but for ulp-level optimizer rounding."""
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(rel_err(second[k], first[k]) < 1e-3 for k in first)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_cpu_offload_keeps_pinned_host_shards_and_trains_as_without_it(tmp_path, tiny_model_dir, tiny_dataset,
                                                                         method):
    """cpu_offload on one GPU: every shard (hence its gradient and optimizer state) in pinned host memory, the
    gradient norm summed over a CUDA mesh from host gradients, torch's fused AdamW stepping them on the CPU, final/
    gathered from them, and its checkpoint resumed without offload: the losses of zero3 without offload."""
    def train_run(name, **extra):
        cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / name, finetuning_type=method,
                                       parallel="zero3", learning_rate=1e-3, max_steps=4, save_steps=2,
                                       torch_compile=False, bf16=False, **extra))
        return run(cfg, keep_model=True)

    plain = train_run("plain")
    offloaded = train_run("offload", cpu_offload=True)
    assert all(p.to_local().device.type == "cuda" for p in plain.model.parameters())
    assert all(p.to_local().device.type == "cpu" and p.to_local().is_pinned() for p in offloaded.model.parameters())
    plan = json.loads((tmp_path / "offload" / "run_plan.json").read_text())
    assert plan["cpu_offload"] and plan["fused_adamw"] and "pinned host memory" in plan["why"]["cpu_offload"]
    assert_same_curve(offloaded.records, plain.records)
    assert offloaded.records[0]["loss"] == pytest.approx(plain.records[0]["loss"], rel=1e-6)  # before any step
    if method == "full":
        assert same_weights(tmp_path / "plain" / "final", tmp_path / "offload" / "final")
        resumed = train_run("resumed", save_final=False,
                            resume_from_checkpoint=str(tmp_path / "offload" / "checkpoint-2"))
        assert_same_curve(resumed.records, plain.records[2:])


@pytest.mark.slow
@needs_gpus(2)
def test_cpu_offload_on_two_gpus_receives_rank_0s_weights_into_host_shards(tmp_path, tiny_model_dir, tiny_dataset):
    """Two processes through torchrun and NCCL: rank 1 builds the model empty and receives its shards of rank 0's
    weights into host memory; a checkpoint without offload resumes with it. The losses of zero3 without offload."""
    def metrics(name, **extra):
        out = tmp_path / name
        out.mkdir()
        values = base_config(tiny_model_dir, tiny_dataset, out / "output", finetuning_type="full", parallel="zero3",
                             nproc_per_node=2, gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=4,
                             save_steps=2, torch_compile=False, bf16=False, tokenized_path=str(tmp_path / "tokenized"),
                             **extra)
        result, _ = run_cli(["train", str(write_config(out, **values))], timeout=300)
        assert result.returncode == 0, result.stdout[-4000:]
        return read_metrics(out / "output")

    plain = metrics("plain")
    offloaded = metrics("offload", cpu_offload=True)
    assert_same_curve(offloaded, plain)
    assert same_weights(tmp_path / "plain" / "output" / "final", tmp_path / "offload" / "output" / "final")
    resumed = metrics("resumed", cpu_offload=True, save_final=False,
                      resume_from_checkpoint=str(tmp_path / "plain" / "output" / "checkpoint-2"))
    assert_same_curve(resumed, plain[2:])


def test_a_staggered_pipeline_gathers_its_zero2_stage_then_waits_its_turn_on_the_gpu():
    """pipeline_stagger's wait on a GPU (NCCL, one process): the stage's FSDP2 units gathered, the device's queue
    drained, then the turn's time passes (tests/test_pipeline_parallel.py runs the same on CPU)."""
    from test_pipeline_parallel import stagger_waits_with_its_stage_whole

    stagger_waits_with_its_stage_whole("cuda")


@pytest.mark.parametrize("dropout, masks", [(0.0, "torch"), (0.1, "torch"), (0.1, "counter")])
def test_recomputed_blocks_compile_where_their_checkpoint_is_placed_on_cuda(dropout, masks):
    """model/recompute.py's placement on the GPU: without dropout, or with counter masks, the checkpoint inside the
    compiled block (its forward graph once a step); with torch's dropout in its call (torch 2.11 failed to partition
    the graph that replays the random state on CUDA; this placement keeps it out of the graph). All compile and
    train, saving no activation of a recomputed block but its input; with counter masks every block recomputed gives
    the gradients of none: to rounding here, where the two compiled graphs may fuse and reduce otherwise
    (tests/test_counter_dropout.py asserts them bit-equal on CPU), and far closer than masks drawn from another
    seed."""
    from meshtune.model.counter_dropout import use_counter_dropout
    from test_recompute import activations, compiled_step, tiny_lora_model

    def model():
        built = tiny_lora_model(dropout, device="cuda")
        if masks == "counter":
            use_counter_dropout(built)
        return built

    saved = []
    grads, calls = compiled_step(model(), saved=saved)
    forwards = 6 if (dropout, masks) == (0.1, "torch") else 3
    assert calls == {"CompiledFunction": forwards, "CompiledFunctionBackward": 3}
    # every block recomputed keeps its input alone (and the final norm its own), whatever the placement
    assert len(activations(saved)) == 3 + 1, saved
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    if masks == "counter":
        kept, _ = compiled_step(model(), recomputed=0)
        other_masks, _ = compiled_step(model(), recomputed=0, seed=4)
        # over all gradients at once: lora_A's are zero in these steps, as lora_B starts at zero
        rounding, masks_apart = (rel_err(torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in kept]))
                                 for got in (grads, other_masks))
        assert rounding < 1e-4 and masks_apart > 1e-2, f"recomputed {rounding:.2e}, another seed {masks_apart:.2e}"
