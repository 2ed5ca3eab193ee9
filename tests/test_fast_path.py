"""The speed levers never change the math: padding-free rows with variable-length attention, the fused
head + cross-entropy, selective activation checkpointing and compiled blocks give the losses of the plain path
(padded batches, full logits, F.cross_entropy) within float tolerance."""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import base_config
from meshtune.config import build_config
from meshtune.data.collate import IGNORE, collate
from meshtune.model import loss_head
from meshtune.model.attention import NAME, causal_varlen
from meshtune.model.loss_head import LossHead, output_head
from meshtune.train.loop import run

PLAIN = dict(padding_free=False, fused_loss=False, optim="adamw_torch")
FAST = dict(padding_free=True, fused_loss=True, gradient_checkpointing=True, gradient_checkpointing_ratio=0.5)


def records(tmp_path, model_dir, dataset, name, method, val_size=8, **extra) -> list[dict]:
    cfg = build_config(base_config(model_dir, dataset, tmp_path / name, finetuning_type=method, learning_rate=1e-3,
                                   max_steps=4, val_size=val_size, **extra))
    result = run(cfg, keep_model=True)
    fast = bool(extra.get("padding_free"))  # the levers asked for are the levers that ran
    assert (result.model.config._attn_implementation == NAME) == fast
    assert isinstance(output_head(result.model), LossHead) == bool(extra.get("fused_loss", True))
    return result.records


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fast_path_gives_the_losses_of_the_plain_path(tmp_path, tiny_model_dir, tiny_dataset, method):
    plain = records(tmp_path, tiny_model_dir, tiny_dataset, "plain", method, **PLAIN)
    fast = records(tmp_path, tiny_model_dir, tiny_dataset, "fast", method, **FAST)
    assert [r["loss"] for r in fast] == pytest.approx([r["loss"] for r in plain], rel=1e-5)
    assert [r["grad_norm"] for r in fast] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-4)
    assert fast[-1]["eval_loss"] == pytest.approx(plain[-1]["eval_loss"], rel=1e-5)
    assert fast[-1]["tokens"] == plain[-1]["tokens"]  # both count real tokens only


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_compiled_blocks_with_the_compilers_recompute_and_combo_kernels_give_the_losses_of_the_plain_path(
        monkeypatch, tmp_path, tiny_model_dir, tiny_dataset):
    """Compiled blocks with every other lever of the fast path on (padding-free rows, the fused loss, half the blocks
    checkpointed), and the compiler's own: activation_memory_budget (the partitioner recomputes inside each compiled
    block's backward graph) and compile_combo_kernels (inductor's scheduler groups independent kernels; on GPUs: the
    CPU backend forms no groups, so here the test shows the key reaches every compile and leaves the losses alone).
    One compiled run for all of them: a compile from scratch is most of this test's minute."""
    from torch._functorch import partitioners
    from torch._inductor.scheduler import Scheduler

    budgets, choose = [], partitioners.choose_saved_values_set
    combos, group = [], Scheduler.create_combo_kernel_nodes

    def spy(joint_graph, node_info, memory_budget=1):
        budgets.append(memory_budget)
        return choose(joint_graph, node_info, memory_budget=memory_budget)

    def combo_spy(scheduler, *args, **kwargs):
        combos.append(len(scheduler.nodes))
        return group(scheduler, *args, **kwargs)

    monkeypatch.setattr(partitioners, "choose_saved_values_set", spy)
    monkeypatch.setattr(Scheduler, "create_combo_kernel_nodes", combo_spy)
    # the partition must happen here: no graph from an earlier test of this process, none from the on-disk caches
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # no evaluation: its no-grad forward would compile every block's graphs once more
    plain = records(tmp_path, tiny_model_dir, tiny_dataset, "plain", "lora", val_size=0, **PLAIN)
    # torch's config.patch, not monkeypatch: monkeypatch's undo would delete these keys from torch's config modules;
    # on exit it also restores combo_kernels, which compile_blocks sets for the whole process
    with inductor_config.patch(fx_graph_cache=False, combo_kernels=False), \
            functorch_config.patch(enable_autograd_cache=False):
        budget = records(tmp_path, tiny_model_dir, tiny_dataset, "budget", "lora", val_size=0, **FAST,
                         torch_compile=True, activation_memory_budget=0.05, compile_combo_kernels=True)
    assert not inductor_config.combo_kernels
    assert [r["loss"] for r in budget] == pytest.approx([r["loss"] for r in plain], rel=1e-4)
    assert [r["grad_norm"] for r in budget] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-3)
    seconds = [r["compile_s"] for r in budget]  # time spent compiling so far, logged with every step
    assert seconds[0] > 0 and seconds == sorted(seconds) and "compile_s" not in plain[0]
    assert budgets and set(budgets) == {0.05}  # every block's backward was partitioned under the budget
    assert len(combos) >= 2  # the block's forward and backward graphs were scheduled with combo kernels on


def test_auto_recomputation_chooses_from_measured_steps_and_trains_as_that_ratio_set_by_hand(
        monkeypatch, capsys, tmp_path, tiny_model_dir, tiny_dataset):
    """gradient_checkpointing_ratio auto on a stand-in card: every block recomputed peaks at 100 bytes and each
    kept block holds 10 more at the end of forward; a budget of 115 keeps one of the two blocks. The measured steps
    run the real forward and backward (dropout included), yet the run's losses are those of ratio 0.5 set by hand,
    bit for bit."""
    from meshtune.model.loading import transformer_blocks
    from meshtune.train import memory_fit

    def stand_in(step, device):  # (peak, bytes held when the forward ended)
        step()
        kept = [block for block in transformer_blocks(model_of[0]) if not block.gradient_checkpointing]
        return 100.0 + 10.0 * len(kept), 60.0 + 10.0 * len(kept)

    model_of = []
    fit = memory_fit.fit_recomputation
    monkeypatch.setattr(memory_fit, "fit_recomputation", lambda model, *a: (model_of.append(model), fit(model, *a))[1])
    monkeypatch.setattr(memory_fit, "can_measure", lambda device: True)
    monkeypatch.setattr("meshtune.plan.memory_measurable", lambda device: True)  # a GPU, as the plan sees it
    monkeypatch.setattr(memory_fit, "smallest_gpu_memory", lambda device, limit: 1000.0)
    monkeypatch.setattr(memory_fit, "pending_optimizer_bytes", lambda optimizer, params: 0)
    monkeypatch.setattr(memory_fit, "measured", stand_in)
    monkeypatch.setattr(memory_fit, "allocated", lambda device: 0.0)
    common = dict(PLAIN, gradient_checkpointing=True, lora_dropout=0.1)
    auto = records(tmp_path, tiny_model_dir, tiny_dataset, "auto", "lora", **common, memory_budget=0.115)
    assert "-> 1 of 2 blocks recomputed (ratio 0.50)" in capsys.readouterr().out
    plan = json.loads((tmp_path / "auto" / "run_plan.json").read_text())  # the measured ratio, not "measure"
    assert plan["recompute"] == 0.5 and "-> 1 of 2 blocks recomputed" in plan["why"]["gradient_checkpointing"]
    by_hand = records(tmp_path, tiny_model_dir, tiny_dataset, "by-hand", "lora", **common,
                      gradient_checkpointing_ratio=0.5)
    assert [r["loss"] for r in auto] == [r["loss"] for r in by_hand]
    assert auto[-1]["eval_loss"] == by_hand[-1]["eval_loss"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_step_that_does_not_fit_even_recomputing_every_block_stops_before_training(
        monkeypatch, tmp_path, tiny_model_dir, tiny_dataset, method):
    """On a stand-in card where every block recomputed peaks at 100 bytes, a budget of 50: a named error with the
    measured need, before the first step (no metrics, no config.yaml: the run never trained); full fine-tuning's
    also names bf16 master weights."""
    from meshtune.errors import MemoryFitError
    from meshtune.train import memory_fit

    monkeypatch.setattr(memory_fit, "can_measure", lambda device: True)
    monkeypatch.setattr("meshtune.plan.memory_measurable", lambda device: True)  # a GPU, as the plan sees it
    monkeypatch.setattr(memory_fit, "smallest_gpu_memory", lambda device, limit: 1000.0)
    monkeypatch.setattr(memory_fit, "pending_optimizer_bytes", lambda optimizer, params: 0)
    monkeypatch.setattr(memory_fit, "measured", lambda step, device: (step(), (100.0, 60.0))[1])
    monkeypatch.setattr(memory_fit, "allocated", lambda device: 0.0)
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", finetuning_type=method,
                                   max_steps=2, gradient_checkpointing=True, memory_budget=0.05, **PLAIN))
    with pytest.raises(MemoryFitError, match=r"takes 0\.00 GiB with every block recomputed.*does not fit even with "
                                             r"every block recomputed\. Lower per_device_train_batch_size") as error:
        run(cfg)
    assert ("master_weights: bf16" in str(error.value)) is (method == "full")
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / "config.yaml").exists()


@pytest.mark.parametrize("cached_gib,trains", [(0.58, True), (1.2, False)])
def test_a_step_over_the_default_share_that_the_card_holds_trains_with_every_block_recomputed(
        monkeypatch, tmp_path, tiny_model_dir, tiny_dataset, cached_gib, trains):
    """The measured Q-LoRA 32B step on a 24 GiB card, on a stand-in: 22.17 GiB with every block recomputed, over the
    default budget (90%: 21.6 GiB). With 0.58 GiB of allocator cache the card keeps 0.52 GiB for CUDA's context, so
    the run trains with every block recomputed and the plan says why; with 1.2 GiB of cache it does not, and the
    run stops before step 1 with the named error."""
    from meshtune.errors import MemoryFitError
    from meshtune.train import memory_fit

    gib = memory_fit.GIB
    monkeypatch.setattr(memory_fit, "can_measure", lambda device: True)
    monkeypatch.setattr("meshtune.plan.memory_measurable", lambda device: True)
    monkeypatch.setattr(memory_fit, "smallest_gpu_memory", lambda device, limit: 24 * gib)
    monkeypatch.setattr(memory_fit, "pending_optimizer_bytes", lambda optimizer, params: 0)
    monkeypatch.setattr(memory_fit, "measured", lambda step, device: (step(), (22.17 * gib, 10 * gib))[1])
    monkeypatch.setattr(memory_fit, "cached_beyond_allocated", lambda device: cached_gib * gib)
    monkeypatch.setattr(memory_fit, "allocated", lambda device: 0.0)
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", finetuning_type="lora",
                                   max_steps=2, gradient_checkpointing=True, **PLAIN))
    if not trains:
        with pytest.raises(MemoryFitError, match=r"does not fit even with every block recomputed\. Lower"):
            run(cfg)
        return
    assert len(run(cfg).records) == 2
    plan = json.loads((tmp_path / "out" / "run_plan.json").read_text())
    assert plan["recompute"] == 1.0
    assert ("over the default share, but the card has room for it -> every block recomputed (ratio 1.00), 0.56 GiB"
            in plan["why"]["gradient_checkpointing"]), plan["why"]["gradient_checkpointing"]


def test_auto_recomputation_arithmetic(monkeypatch):
    from types import SimpleNamespace

    from meshtune.train.memory_fit import (CONTEXT_BYTES, GIB, NCCL_BYTES, MemoryFit, blocks_to_keep, budget_bytes,
                                           pending_optimizer_bytes, smallest_gpu_memory)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    assert smallest_gpu_memory(torch.device("cpu"), None) == 80 * GIB
    assert smallest_gpu_memory(torch.device("cpu"), 24) == 24 * GIB  # gpu_memory_limit where it is lower
    assert budget_bytes(None, 80 * GIB) == pytest.approx(72 * GIB)  # 0.9 of the card
    assert budget_bytes(0.5, 24 * GIB) == 12 * GIB  # a share of the card (here of gpu_memory_limit)
    assert budget_bytes(6.49, 80 * GIB) == pytest.approx(6.49 * GIB)  # GiB above 1
    assert blocks_to_keep(5 * GIB, 0.5 * GIB, 10 * GIB, 28) == 9  # 9.7 - 5 = 4.7 GiB of room
    assert blocks_to_keep(5 * GIB, 0.5 * GIB, 100 * GIB, 28) == 28
    assert blocks_to_keep(11 * GIB, 0.5 * GIB, 10 * GIB, 28) == 0
    assert "does not fit even with every block recomputed" in MemoryFit(28, 0, 11 * GIB, 0, 10 * GIB, 4096).describe()
    line = MemoryFit(28, 4, 10 * GIB, GIB / 2, 20 * GIB, 4096, cached_all=3 * GIB).describe()
    assert ("holds 0.50 GiB of activations; the allocator held 3.00 GiB more at its peak; memory_budget 20.00 GiB"
            in line)
    assert "the allocator held" not in MemoryFit(28, 4, 10 * GIB, GIB / 2, 20 * GIB, 4096).describe()
    # Q-LoRA of a 32B model on a 24 GiB card (measured, 1 x H100 capped at 24 GiB): every block recomputed takes
    # 22.17 GiB and the allocator 0.58 more, over the default 90% share; with NCCL's buffers outside the allocator
    # too the 0.52 GiB left is short, and the refusal names the budget that trains it if CUDA's context alone fits
    refused = MemoryFit(64, 0, 22.17 * GIB, 0.0, 21.6 * GIB, 1894, cached_all=0.58 * GIB, card=24 * GIB,
                        outside=CONTEXT_BYTES + NCCL_BYTES).describe()
    assert "each block kept" not in refused  # not measured where nothing fits
    assert "memory_budget 21.60 GiB (the default, 90% of the card's 24.00 GiB)" in refused
    assert ("it does not fit even with every block recomputed. The card has room for it: memory_budget: 22.9 trains "
            "it with every block recomputed, 0.52 GiB of the card left" in refused), refused
    assert blocks_to_keep(22.17 * GIB, 0.0, 22.9 * GIB, 64) == 64  # that budget does fit the fit's own rule
    # one process: that step trains with the default budget, over the share but within the card less CUDA's context
    on_card = MemoryFit(64, 0, 22.17 * GIB, 0.0, 21.6 * GIB, 1894, cached_all=0.58 * GIB, card=24 * GIB)
    assert on_card.trains_on_the_card() and on_card.ratio == 1.0
    assert ("memory_budget 21.60 GiB (the default, 90% of the card's 24.00 GiB): over the default share, but the "
            "card has room for it -> every block recomputed (ratio 1.00), 0.56 GiB of the card left" in
            on_card.describe()), on_card.describe()
    # measured too: 0.61 GiB of cache (combo kernels) leaves 0.52 beside the step and its headroom, which trains; the
    # budget a user would write, rounded up to 22.9, is for the message alone
    assert MemoryFit(64, 0, 22.18 * GIB, 0.0, 21.6 * GIB, 1894, cached_all=0.61 * GIB, card=24 * GIB
                     ).trains_on_the_card()
    tight = MemoryFit(64, 0, 23.2 * GIB, 0.0, 21.6 * GIB, 1894, cached_all=0.58 * GIB, card=24 * GIB)
    assert not tight.trains_on_the_card()
    tight = tight.describe()
    assert "The card has room" not in tight and "Lower per_device_train_batch_size" in tight
    named = MemoryFit(64, 0, 22.17 * GIB, 0.0, 20 * GIB, 1894, cached_all=0.58 * GIB)  # a set budget binds
    assert not named.trains_on_the_card()
    named = named.describe()
    assert "The card has room" not in named and "(the default" not in named
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters())
    assert pending_optimizer_bytes(optimizer, list(layer.parameters())) == 2 * 15 * 4  # two fp32 moments
    layer(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert pending_optimizer_bytes(optimizer, list(layer.parameters())) == 0  # allocated already


@pytest.mark.parametrize("trains_head", [True, False])
def test_fused_loss_matches_cross_entropy_in_value_and_gradients(monkeypatch, trains_head):
    monkeypatch.setattr(loss_head, "ROWS_ELEMENTS", 7 * 50)  # 7-row chunks: several chunks and a ragged last one
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 23, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=trains_head)
    targets = torch.randint(0, 50, (2, 23), generator=generator)
    targets[0, :5] = IGNORE
    targets[1, -3:] = IGNORE
    flat = targets.reshape(-1)
    positions = (flat != IGNORE).nonzero().squeeze(1)
    fused = loss_head.linear_cross_entropy(hidden, weight, positions, flat[positions])
    (fused * 0.37).backward()
    got = [hidden.grad.clone()] + ([weight.grad.clone()] if trains_head else [])
    hidden.grad = None
    weight.grad = None
    plain = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), flat, ignore_index=IGNORE, reduction="sum")
    (plain * 0.37).backward()
    want = [hidden.grad] + ([weight.grad] if trains_head else [])
    torch.testing.assert_close(fused, plain)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_varlen_attention_keeps_samples_apart():
    """Each sample's output depends on that sample only, and equals causal attention over it alone (GQA)."""
    generator = torch.Generator().manual_seed(5)
    lengths = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q = torch.randn(15, 4, 8, generator=generator)
    k = torch.randn(15, 2, 8, generator=generator)
    v = torch.randn(15, 2, 8, generator=generator)
    out = causal_varlen(q, k, v, cu, max(lengths), None)
    for start, n in zip([0, 5, 6], lengths):
        sl = slice(start, start + n)
        want = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1).repeat_interleave(2, 0),
                                              v[sl].transpose(0, 1).repeat_interleave(2, 0), is_causal=True)
        torch.testing.assert_close(out[sl], want.transpose(0, 1))


def test_padding_free_batch_holds_every_sample_once(tiny_model_dir, tiny_dataset, tmp_path):
    from meshtune.data.tokenized import load_or_build
    from meshtune.model.model_dir import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    data = load_or_build([tiny_dataset], tokenizer, fmt=None, template=None, cutoff_len=64, skip_invalid=False,
                         cache_dir=tmp_path, show_progress=False)
    padded = collate([[0], [1], [2]], data, tokenizer.pad_token_id, packed=False)
    flat = collate([[0], [1], [2]], data, tokenizer.pad_token_id, packed=False, padding_free=True)
    assert flat.input_ids.shape == (1, padded.num_tokens) and flat.num_tokens == padded.num_tokens
    assert flat.cu_seqlens.tolist() == [0, *torch.tensor([len(data[i][0]) for i in range(3)]).cumsum(0).tolist()]
    assert flat.target_ids.tolist() == padded.target_ids.tolist()
    assert flat.num_targets == padded.num_targets


def test_flop_count_follows_torchtitan(tiny_model_dir):
    from meshtune.model.loading import load_model
    from meshtune.model.flops import FlopCounter

    model = load_model(tiny_model_dir)
    counter = FlopCounter.of(model)
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    assert counter.dense_params == total - config.vocab_size * config.hidden_size  # all but the input embedding
    head_dim = config.hidden_size // config.num_attention_heads
    want = (6 * counter.dense_params * 8
            + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * (9 + 25))
    assert counter.batch_flops([3, 5]) == want  # each token attends within its own sample only


def test_metrics_carry_throughput(tmp_path, tiny_model_dir, tiny_dataset):
    records = run(build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=3))).records
    for record in records:
        assert record["tokens_per_s"] > 0 and record["tflops_per_gpu"] > 0
        assert "mfu" not in record  # no measured peak on a CPU: no made-up utilisation


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_compiled_blocks_under_ddp_are_not_split_at_bucket_boundaries(monkeypatch, tiny_model_dir):
    """Dynamo's DDPOptimizer would cut each block's graph at DDP's bucket boundaries and compile the pieces
    apart (it did: 2-GPU scaling fell to 77% with compiled blocks, 105% without). compile_blocks turns it off."""
    import torch.distributed as dist
    from torch._dynamo.backends import distributed as dynamo_ddp
    from torch.nn.parallel import DistributedDataParallel

    from meshtune.model.loading import load_model
    from meshtune.model.compile import compile_blocks

    splits = []
    original = dynamo_ddp.DDPOptimizer.compile_fn
    monkeypatch.setattr(dynamo_ddp.DDPOptimizer, "compile_fn",
                        lambda self, gm, inputs: splits.append(gm) or original(self, gm, inputs))
    # dynamo splits (or not) before any backend runs: the eager backend keeps inductor's code generation, minutes
    # of C++ compiles on a CPU, out of a check that only counts splits (test_compiled_blocks_* run inductor)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: compile_module(self, backend="eager",
                                                                                            **options))
    # torch's default, set back afterwards by assignment: monkeypatch's undo deletes a key dynamo's config lacks in
    # its __dict__, which hides the key from every later compile in this process
    optimize_ddp = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1000)  # tiny blocks: tiny buckets, as 1.5B's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for compile_ in ("block.compile", "compile_blocks"):  # the first shows that the check can see a split
            torch._dynamo.reset()
            splits.clear()
            model = load_model(tiny_model_dir, dtype=torch.float32)
            if compile_ == "compile_blocks":
                compile_blocks(model)
            else:
                for block in model.model.layers:
                    block.compile(dynamic=True)
            model = DistributedDataParallel(model, bucket_cap_mb=0.01)
            model(input_ids=torch.randint(0, 100, (2, 12))).logits.sum().backward()
            assert bool(splits) == (compile_ == "block.compile"), compile_
            # DDP's reducer released here, while the group lives: dropped later by the garbage collector, it can
            # destroy the gloo group on the main thread, which then joins gloo's threads holding the GIL that one
            # of them needs to finish (a deadlock)
            del model
            gc.collect()
    finally:
        torch._dynamo.config.optimize_ddp = optimize_ddp
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_compile_watch_notes_steps_that_compiled_after_the_first():
    from meshtune.train.metrics import CompileWatch

    clock = iter([0.0, 9.0, 9.1, 11.0, 11.0, 14.0, 20.0])  # seconds in torch.compile so far, read after each step
    watch = CompileWatch(seconds=lambda: next(clock), threshold=0.5, limit=2)
    notes = [watch.after_step(step) for step in range(1, 7)]
    assert notes[0] is None and notes[1] is None and notes[3] is None  # step 1 compiles anyway; 0.1 s is noise
    assert notes[2].startswith("note: step 3 spent 1.9 s compiling") and "no further" not in notes[2]
    assert notes[4].startswith("note: step 5 spent 3.0 s") and "no further notes" in notes[4]
    assert notes[5] is None  # the limit
