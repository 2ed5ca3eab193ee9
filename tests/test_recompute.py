"""Where a recomputed block checkpoints: inside its compiled forward where it draws no random numbers (its forward
graph runs once a step), in its call, outside the compiled graph, where it has dropout."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import profile
from transformers import Qwen2Config, Qwen2ForCausalLM

from meshtune.model import recompute
from meshtune.model.compile import compile_blocks
from meshtune.model.loading import transformer_blocks


# the adapted layers of the models the compiled tests build: one each side of attention (inductor then compiles 43
# kernels for the counter-mask test instead of all-linear's 65, each about a second of g++ on a CI machine's core)
COMPILED_TARGETS = ["q_proj", "down_proj"]


def tiny_lora_model(dropout: float, device: str = "cpu", targets: str | list[str] = "all-linear") -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets)
    return get_peft_model(Qwen2ForCausalLM(config), lora).to(device).train()


TOKENS = (2, 12)  # the rows and length of `compiled_step`'s batch


def activations(saved: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes in `saved` with a vector for each token of the step's batch (hidden states and the like)."""
    return [shape for shape in saved if len(shape) == 3 and shape[:2] == TOKENS and shape[2] > 1]


def compiled_step(model: torch.nn.Module, recomputed: int = 3, seed: int = 3,
                  saved: list | None = None) -> tuple[list[torch.Tensor], Counter]:
    """Gradients of a compiled step (after one that compiles; `seed`: torch's, before the step) and the calls of
    compiled graphs in it. `saved`: gets the shape of each tensor the step's forward saved for backward that is not
    a parameter, once a storage (`activations` picks those of a token each)."""
    torch._dynamo.reset()
    recompute.enable_checkpointing(model, 1.0)
    recompute.recompute_blocks(model, recomputed)
    compile_blocks(model)
    device = next(model.parameters()).device
    tokens = torch.randint(0, 96, TOKENS, generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)
    model(input_ids=tokens, labels=tokens).loss.backward()
    model.zero_grad()
    torch.manual_seed(seed)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        if storage not in parameters:
            storages.setdefault(storage, tuple(tensor.shape))
        return tensor

    with profile() as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    if saved is not None:
        saved.extend(storages.values())
    calls = Counter(event.name for event in prof.events() if event.name.startswith("CompiledFunction"))
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], calls


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_a_block_without_dropout_recomputes_inside_its_compiled_graph(monkeypatch):
    """Without dropout each recomputed block's forward graph runs once a step and its backward graph recomputes
    it; checkpointed in its call instead, the forward graph runs a second time for the recompute. Both train the
    same: equal gradients."""
    inside_grads, inside = compiled_step(tiny_lora_model(dropout=0.0, targets=COMPILED_TARGETS))
    monkeypatch.setattr(recompute, "draws_random_numbers", lambda block: True)  # the placement a dropout block gets
    outside_grads, outside = compiled_step(tiny_lora_model(dropout=0.0, targets=COMPILED_TARGETS))
    assert inside == {"CompiledFunction": 3, "CompiledFunctionBackward": 3}
    assert outside == {"CompiledFunction": 6, "CompiledFunctionBackward": 3}  # 3 forwards, 3 recomputes
    assert any(g.abs().sum() > 0 for g in inside_grads)
    for a, b in zip(inside_grads, outside_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_a_block_with_dropout_recomputes_outside_its_compiled_graph_and_a_kept_block_runs_once():
    """LoRA's dropout: the checkpoint stays in the block's call (torch 2.11 cannot partition a compiled graph that
    replays its random state on CUDA), its forward graph run again for the recompute; a block that keeps its
    activations runs its forward graph once."""
    model = tiny_lora_model(dropout=0.1, targets=COMPILED_TARGETS)
    _, calls = compiled_step(model)
    assert calls == {"CompiledFunction": 6, "CompiledFunctionBackward": 3}
    _, calls = compiled_step(model, recomputed=1)
    assert calls == {"CompiledFunction": 4, "CompiledFunctionBackward": 3}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_placed_block_keeps_its_class_name_and_holds_one_checkpoint(dropout):
    """The block keeps its class's name (FSDP2, `_no_split_modules` and the logs find it by name); a subclass made
    later, as FSDP2's FSDP<name>, is not wrapped again by transformers: one checkpoint per block. The placement is
    made once."""
    model = tiny_lora_model(dropout)
    recompute.enable_checkpointing(model, 1.0)
    blocks = transformer_blocks(model)
    placed = type(blocks[0])
    assert placed.__name__ == "Qwen2DecoderLayer" and len(blocks) == 3 and all(type(b) is placed for b in blocks)
    inside = dropout == 0.0
    assert (placed.__call__ is torch.nn.Module.__call__) == inside
    sharded = type(f"FSDP{placed.__name__}", (placed,), {})
    assert sharded.forward is placed.forward and sharded.__call__ is placed.__call__
    recompute.enable_checkpointing(model, 1.0)
    assert type(transformer_blocks(model)[0]) is placed


def test_own_forward_unwraps_only_the_checkpointing_wrapper():
    """transformers >= 5.2x wraps each layer class's forward in `forward_with_checkpointing` (functools.wraps,
    again for each subclass); the placement checkpoints the layer's own forward, with its other decorators."""
    from functools import wraps

    def forward(self, hidden):
        return hidden

    def decorated(func):
        @wraps(func)
        def wrapped_func(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapped_func

    def checkpointing(func):
        @wraps(func)
        def forward_with_checkpointing(self, *args, **kwargs):
            return func(self, *args, **kwargs)
        return forward_with_checkpointing

    own = decorated(forward)
    layer = type("Layer", (), {"forward": checkpointing(checkpointing(own))})
    assert recompute.own_forward(layer) is own
    assert recompute.own_forward(type("Plain", (), {"forward": own})) is own


def test_a_block_samples_where_a_dropout_or_an_attention_dropout_rate_is_above_zero():
    block = tiny_lora_model(dropout=0.0).get_base_model().model.layers[0]
    assert not recompute.draws_random_numbers(block)
    block.self_attn.attention_dropout = 0.1
    assert recompute.draws_random_numbers(block)
    block.self_attn.attention_dropout = torch.nn.Dropout(0.0)  # some models keep a module under that name
    assert not recompute.draws_random_numbers(block)
    block.mlp.add_module("dropout", torch.nn.Dropout(0.2))
    assert recompute.draws_random_numbers(block)
