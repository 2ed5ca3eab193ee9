"""Where a recomputed block checkpoints: inside its forward, so that its compiled graph runs once a step."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
from torch.profiler import profile

from meshtune.model import recompute
from meshtune.model.compile import compile_blocks


class CheckpointingInCall(torch.nn.Module):
    """transformers <= 5.17's GradientCheckpointingLayer: the checkpoint wraps the module call, outside forward."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


class ToyBlock(CheckpointingInCall):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.dropout = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), \
            torch.nn.Dropout(0.25)

    def forward(self, hidden: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return hidden + scale * self.down(self.dropout(torch.nn.functional.silu(self.up(hidden))))


class ToyModel(torch.nn.Module):
    _no_split_modules = ["ToyBlock"]

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ToyBlock(width) for _ in range(depth))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict) -> None:
        for block in self.blocks:
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint,
                                                         **gradient_checkpointing_kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden, scale=torch.tensor(0.5))
        return hidden.square().mean()


def trained(monkeypatch, inside: bool, recomputed: int = 3) -> tuple[list[torch.Tensor], Counter]:
    """Gradients of two compiled steps of the toy model and the compiled graphs' calls in the second."""
    monkeypatch.setattr(recompute, "checkpointing_call", lambda: CheckpointingInCall.__call__ if inside else None)
    torch.manual_seed(0)
    model = ToyModel().train()
    recompute.enable_checkpointing(model, 1.0)
    recompute.recompute_blocks(model, recomputed)
    compile_blocks(model)
    hidden = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    model(hidden).backward()  # compiles
    with profile() as prof:
        model(hidden).backward()
    calls = Counter(event.name for event in prof.events() if event.name.startswith("CompiledFunction"))
    return [p.grad.clone() for p in model.parameters()], calls


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_a_block_that_checkpoints_in_its_call_recomputes_inside_its_compiled_graph(monkeypatch):
    """transformers <= 5.17 checkpoints a layer in its `__call__`: a compiled block then runs its forward graph
    again for the recompute. Moved inside forward, each block's forward graph runs once a step and its backward
    graph recomputes it, dropout's masks replayed: the same gradients, bit for bit."""
    torch._dynamo.reset()
    outside_grads, outside = trained(monkeypatch, inside=False)
    torch._dynamo.reset()
    inside_grads, inside = trained(monkeypatch, inside=True)
    assert outside == {"CompiledFunction": 6, "CompiledFunctionBackward": 3}  # 3 forwards, 3 recomputes
    assert inside == {"CompiledFunction": 3, "CompiledFunctionBackward": 3}
    assert all(torch.equal(a, b) for a, b in zip(outside_grads, inside_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in inside_grads)


@pytest.mark.slow  # inductor compiles C++ kernels (g++)
def test_the_moved_checkpoint_keeps_the_class_name_and_follows_each_blocks_flag(monkeypatch):
    """The block keeps its class's name (FSDP2, `_no_split_modules` and the logs find it by name); a block that
    keeps its activations runs its forward graph once and saves them, as before."""
    torch._dynamo.reset()
    monkeypatch.setattr(recompute, "checkpointing_call", lambda: CheckpointingInCall.__call__)
    model = ToyModel()
    recompute.enable_checkpointing(model, 1.0)
    block = model.blocks[0]
    assert type(block).__name__ == "ToyBlock" and isinstance(block, ToyBlock)
    assert type(block).__call__ is torch.nn.Module.__call__
    assert type(model.blocks[1]) is type(block)  # one class for every block of a kind
    torch._dynamo.reset()
    kept_grads, kept = trained(monkeypatch, inside=True, recomputed=1)
    assert kept == {"CompiledFunction": 3, "CompiledFunctionBackward": 3}


@pytest.mark.parametrize("installed", ["checkpointing in __call__", "checkpointing in forward"])
def test_the_placement_is_moved_only_where_the_installed_transformers_checkpoints_in_call(monkeypatch, installed):
    calls = CheckpointingInCall.__call__ if installed == "checkpointing in __call__" else None
    monkeypatch.setattr(recompute, "checkpointing_call", lambda: calls)
    model = ToyModel()
    recompute.enable_checkpointing(model, 1.0)
    assert (type(model.blocks[0]) is ToyBlock) == (calls is None)
