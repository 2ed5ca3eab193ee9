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
    checkpoint_inside_forward(model)
    recompute_blocks(model, round(len(transformer_blocks(model)) * ratio))


def recompute_blocks(model: torch.nn.Module, count: int) -> list[int]:
    """Recompute `count` of the blocks in backward, spread evenly; the rest keep their activations. The flag is
    read when a block is called (its compiled graph is guarded on it: one graph each way), so it can change between
    steps. Returns the indices."""
    blocks = transformer_blocks(model)
    count = max(0, min(count, len(blocks)))
    chosen = {int(i * len(blocks) / count) for i in range(count)} if count else set()
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i in chosen
    return sorted(chosen)


def checkpoint_inside_forward(model: torch.nn.Module) -> None:
    """Each block checkpoints inside its `forward`, as transformers does from 5.2x, also where the installed
    transformers checkpoints in the layer's `__call__` (5.17 and earlier). Inside `forward`, torch.compile of the
    block traces the checkpoint: the block's backward graph recomputes its forward, so a recomputed block costs one
    call of its compiled forward a step instead of two (each call is the host's guards, autograd's wrapper and the
    graph's launches, the time a step waits for on a fast GPU), and its random state (dropout) is replayed inside the
    graph. The class keeps its name; FSDP2's hooks stay outside the checkpoint."""
    for block in transformer_blocks(model):
        if checkpoints_in_call(type(block)):
            block.__class__ = checkpointing_in_forward(type(block))


def checkpoints_in_call(cls: type) -> bool:
    call = checkpointing_call()
    return call is not None and getattr(cls, "__call__", None) is call


def checkpointing_call():
    """transformers' layer call that checkpoints outside forward (GradientCheckpointingLayer.__call__ in 5.17 and
    earlier); None where the installed transformers checkpoints in forward."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return vars(GradientCheckpointingLayer).get("__call__")


@cache
def checkpointing_in_forward(cls: type) -> type:
    """`cls` with the plain module call, its forward checkpointed where the block recomputes (the newer
    transformers' `forward_with_checkpointing`; no key-value cache in training)."""
    forward = cls.forward

    def checkpointed_forward(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)
        return forward(self, *args, **kwargs)

    checkpointed_forward.__wrapped__ = forward
    return type(cls.__name__, (cls,), {"__call__": torch.nn.Module.__call__, "forward": checkpointed_forward,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})
