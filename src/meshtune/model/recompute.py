"""Activation checkpointing: recompute a chosen number of the transformer blocks in backward."""

from __future__ import annotations

from functools import cache, partial

import torch

from meshtune.model.loading import transformer_blocks


def enable_checkpointing(model: torch.nn.Module, ratio: float = 1.0) -> None:
    """Non-reentrant activation checkpointing of a `ratio` of the blocks, spread evenly (selective by layer, as
    torchtitan): recomputing fewer blocks costs memory and saves time. transformers >= 5.2x renamed the method."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    place_checkpoints(model)
    recompute_blocks(model, round(len(transformer_blocks(model)) * ratio))


def recompute_blocks(model: torch.nn.Module, count: int) -> list[int]:
    """Recompute `count` of the blocks in backward, spread evenly; the rest keep their activations. The flag is
    read when a block is called (where the checkpoint is inside the compiled graph, the graph is guarded on it: one
    graph each way), so it can change between steps. Returns the indices."""
    blocks = transformer_blocks(model)
    count = max(0, min(count, len(blocks)))
    chosen = {int(i * len(blocks) / count) for i in range(count)} if count else set()
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i in chosen
    return sorted(chosen)


def place_checkpoints(model: torch.nn.Module) -> None:
    """Where each recomputed block checkpoints, whatever the installed transformers does (5.17 and earlier in the
    layer's call, later versions inside its forward):

    - a block that draws no random numbers in training checkpoints inside its forward. torch.compile of the block
      then traces the checkpoint and the block's backward graph recomputes it: one call of its compiled forward a
      step instead of two (each call is the host's guards, autograd's wrapper and the graph's launches, what a step
      waits for on a fast GPU; full 1.5B at the Liger peer's memory, every block recomputed: +30% in one pair of
      runs on one H200, docs/benchmarks/one-gpu.md);
    - a block with torch's dropout (LoRA's `lora_dropout`, attention dropout) checkpoints in its call, outside the
      compiled graph, which the recompute runs again under the random state checkpoint restores: torch 2.11 fails
      to partition a compiled graph that replays a random state on CUDA ("Node ... was invalid, but is output").
      LoRA's dropout with counter masks (model/counter_dropout.py) draws nothing inside the block: such a block
      checkpoints inside, its seed an input of the checkpoint.

    Each block keeps its class's name (FSDP2, `_no_split_modules` and the logs find it by name); FSDP2's hooks stay
    outside the checkpoint either way."""
    for block in transformer_blocks(model):
        if is_checkpointing_layer(type(block)):
            block.__class__ = checkpointed_class(type(block), inside=not draws_random_numbers(block))


def draws_random_numbers(block: torch.nn.Module) -> bool:
    """Whether `block` samples in training: a dropout module with p > 0, or attention dropout in its config."""
    def samples(module: torch.nn.Module) -> bool:
        rate = getattr(module, "attention_dropout", 0)  # a rate on HF attention modules (a Dropout on some)
        return (isinstance(module, torch.nn.Dropout) and module.p > 0) or (isinstance(rate, float) and rate > 0)

    return any(samples(module) for module in block.modules())


def checkpointing_layer() -> type | None:
    """transformers' GradientCheckpointingLayer; None before it existed (the model places its checkpoints itself)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def is_checkpointing_layer(cls: type) -> bool:
    layer = checkpointing_layer()
    return layer is not None and issubclass(cls, layer) and not getattr(cls, "_meshtune_placed", False)


def own_forward(cls: type):
    """The layer's forward without the checkpoint newer transformers wrap around it (`forward_with_checkpointing`,
    made by GradientCheckpointingLayer.__init_subclass__ with functools.wraps, once for each subclass)."""
    forward = cls.forward
    while forward.__code__.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward


def recomputes(block: torch.nn.Module) -> bool:
    return block.gradient_checkpointing and block.training and torch.is_grad_enabled()


@cache
def checkpointed_class(cls: type, inside: bool) -> type:
    """`cls` with its checkpoint inside its forward or in its call (`place_checkpoints`). Subclasses made later
    (FSDP2's FSDP<name>) are not wrapped again by transformers: one checkpoint per block."""
    forward = own_forward(cls)

    def checkpointed_forward(self, *args, **kwargs):
        if not recomputes(self):
            return forward(self, *args, **kwargs)
        seed = getattr(self, "counter_seed", None)  # counter dropout's (model/counter_dropout.py): an input of it
        if seed is not None:
            return self._gradient_checkpointing_func(partial(seed.run, forward, self, **kwargs), seed.seed, *args)
        return self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)

    def checkpointed_call(self, *args, **kwargs):
        if recomputes(self):
            return self._gradient_checkpointing_func(partial(torch.nn.Module.__call__, self, **kwargs), *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    def __init_subclass__(subclass, **kwargs):  # skips GradientCheckpointingLayer's, which wraps forward again
        super(checkpointing_layer(), subclass).__init_subclass__(**kwargs)

    placed = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                         "_meshtune_placed": True})
    placed.__init_subclass__ = classmethod(__init_subclass__)
    # set after the class exists: transformers' __init_subclass__ ran when it was made and wrapped its forward
    placed.forward = checkpointed_forward if inside else forward
    placed.__call__ = torch.nn.Module.__call__ if inside else checkpointed_call
    return placed
