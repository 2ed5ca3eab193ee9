"""lora_dropout_masks: counter: dropout masks hashed from a per-block seed and each element's position."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import LLAMAFACTORY_DATA, base_config
from meshtune.config import build_config
from meshtune.model import counter_dropout
from meshtune.model.counter_dropout import CounterDropout, keep_mask, salt_bits, use_counter_dropout
from meshtune.model.loading import transformer_blocks
from meshtune.train.loop import run
from test_recompute import COMPILED_TARGETS, activations, compiled_step, tiny_lora_model

SEED = torch.tensor(123456789, dtype=torch.int64)


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_masks_keep_each_element_with_probability_one_minus_p_independently(p):
    """Over 2^20 elements: the kept share within 5 standard errors of 1 - p; neighbours, two layers (salts) and two
    seeds each kept together as often as independent draws would be."""
    like = torch.empty(1024, 1024)
    drawn = lambda seed, layer: keep_mask(like, seed, salt_bits(layer), p).flatten().double()  # noqa: E731
    mask = drawn(SEED, 1)
    n, q = mask.numel(), 1 - p
    tolerance = 5 * (q * (1 - q) / n) ** 0.5
    assert abs(mask.mean().item() - q) < tolerance
    both = lambda a, b: (a * b).mean().item()  # noqa: E731
    assert abs(both(mask[1:], mask[:-1]) - q * q) < 2 * tolerance  # neighbours
    assert abs(both(mask, drawn(SEED, 2)) - q * q) < 2 * tolerance  # layers
    assert abs(both(mask, drawn(SEED + 1, 1)) - q * q) < 2 * tolerance  # seeds
    assert torch.equal(mask, drawn(SEED.clone(), 1))  # a function of its inputs

def test_the_dropout_scales_what_it_keeps_and_is_the_identity_in_eval():
    dropout = CounterDropout(0.25, 3)
    x = torch.ones(64, 64)
    out = dropout(x)
    assert set(out.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}
    assert torch.equal(dropout.eval()(x), x)


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_compiled_dropout_is_the_eager_dropout():
    """The same masks compiled (with dynamic shapes, as the blocks compile) as eager: integer arithmetic wraps the
    same way in both."""
    x = torch.randn(37, 53)

    for salt in (salt_bits(9),):
        def dropped(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
            return x * keep_mask(x, seed, salt, 0.1)

        compiled = torch.compile(dropped, dynamic=True)
        assert torch.equal(compiled(x, SEED), dropped(x, SEED))
        assert torch.equal(compiled(x[:20], SEED + 1), dropped(x[:20], SEED + 1))


def test_every_lora_dropout_is_replaced_and_the_state_dict_is_unchanged():
    model = tiny_lora_model(dropout=0.1)
    keys = set(model.state_dict())
    assert use_counter_dropout(model) == 3 * 7  # 7 adapted linears a block
    assert set(model.state_dict()) == keys
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    blocks = transformer_blocks(model)
    assert all(m.block_seed is blocks[0].counter_seed for m in blocks[0].modules() if isinstance(m, CounterDropout))


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_a_recomputed_compiled_block_rebuilds_its_masks_inside_its_backward_graph():
    """With counter masks a block with dropout checkpoints inside its compiled forward (its forward graph once a
    step) and its recompute rebuilds the forward's masks: every block recomputed gives the gradients of none, and
    keeps no activation but its input (not its dropped inputs: model/compile.py). The blocks share one graph (their
    dropouts' salts alike), as blocks without counter masks do."""
    recomputed = tiny_lora_model(dropout=0.1, targets=COMPILED_TARGETS)
    use_counter_dropout(recomputed)
    graphs = counters["stats"]["unique_graphs"]
    saved = []
    grads, calls = compiled_step(recomputed, recomputed=3, saved=saved)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the blocks' graph and the pre-hook's seed draw
    assert len(activations(saved)) == 3 + 1, saved  # each block's input, and the final norm's
    kept = tiny_lora_model(dropout=0.1, targets=COMPILED_TARGETS)
    use_counter_dropout(kept)
    kept_grads, kept_calls = compiled_step(kept, recomputed=0)
    assert calls == kept_calls == {"CompiledFunction": 3, "CompiledFunctionBackward": 3}
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads, strict=True))


def test_a_recompute_after_other_forwards_uses_its_own_forwards_seed():
    """A pipeline schedule runs later micro-batches' forwards before an earlier one's backward: the recompute takes
    the seed its forward drew (an input of the checkpoint), not the block's latest."""
    from meshtune.model.recompute import enable_checkpointing

    def grads(interleaved: bool) -> list[torch.Tensor]:
        model = tiny_lora_model(dropout=0.3)
        use_counter_dropout(model)
        enable_checkpointing(model, 1.0 if interleaved else 0.0)
        tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        first = model(input_ids=tokens, labels=tokens).loss
        model(input_ids=tokens, labels=tokens)  # another forward before the first's backward
        first.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(interleaved=True), grads(interleaved=False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_a_run_with_counter_masks_trains_reproducibly_and_recomputes_as_it_keeps(
        tmp_path, tiny_model_dir, tiny_dataset):
    """Two runs with counter masks give the same losses; every block recomputed gives the losses of none; the
    dropout acts (other losses than without it)."""
    def losses(name: str, **extra) -> list[float]:
        cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / name, finetuning_type="lora",
                                       learning_rate=1e-3, max_steps=2, **extra))
        return [r["loss"] for r in run(cfg).records if "loss" in r]

    counter = dict(lora_dropout=0.2, lora_dropout_masks="counter")
    first = losses("a", **counter, gradient_checkpointing=True, gradient_checkpointing_ratio=1.0)
    assert len(first) == 2
    assert first == losses("b", **counter, gradient_checkpointing=True, gradient_checkpointing_ratio=1.0)
    assert first == pytest.approx(losses("kept", **counter, gradient_checkpointing=False), rel=1e-6)
    assert first != pytest.approx(losses("none", lora_dropout=0.0), rel=1e-6)
    assert counter_dropout.MASK_BITS == 24


def test_a_dpo_run_with_counter_masks_recomputes_as_it_keeps(tmp_path, tiny_model_dir):
    """stage: dpo (the policy's chosen and rejected responses in one row, the reference with its adapters turned
    off): every block recomputed gives the first step's gradient norm of none, and the dropout acts on it (the first
    loss is log 2 whatever the masks: the adapters start as the identity)."""
    def first_step(name: str, **extra) -> dict:
        cfg = build_config(base_config(tiny_model_dir, "dpo_en_demo", tmp_path / name, stage="dpo",
                                       dataset_dir=str(LLAMAFACTORY_DATA), cutoff_len=256, max_steps=1, **extra))
        return next(r for r in run(cfg).records if "loss" in r)

    counter = dict(lora_dropout=0.2, lora_dropout_masks="counter")
    recomputed = first_step("all", **counter, gradient_checkpointing=True, gradient_checkpointing_ratio=1.0)
    kept = first_step("kept", **counter, gradient_checkpointing=False)
    assert recomputed["grad_norm"] == pytest.approx(kept["grad_norm"], rel=1e-6)
    assert recomputed["grad_norm"] != pytest.approx(first_step("none", lora_dropout=0.0)["grad_norm"], rel=1e-3)
