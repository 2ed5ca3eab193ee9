"""Activation checkpointing: recompute a chosen number of the transformer blocks in backward."""

from __future__ import annotations

import torch

from meshtune.model.loading import transformer_blocks


def enable_checkpointing(model: torch.nn.Module, ratio: float = 1.0) -> None:
    """Non-reentrant activation checkpointing of a `ratio` of the blocks, spread evenly (selective by layer, as
    torchtitan): recomputing fewer blocks costs memory and saves time. transformers >= 5.2x renamed the method."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recompute_blocks(model, round(len(transformer_blocks(model)) * ratio))


def recompute_blocks(model: torch.nn.Module, count: int) -> list[int]:
    """Recompute `count` of the blocks in backward, spread evenly; the rest keep their activations. The flag is
    read when a block is called, outside its compiled graph, so it can change between steps. Returns the indices."""
    blocks = transformer_blocks(model)
    count = max(0, min(count, len(blocks)))
    chosen = {int(i * len(blocks) / count) for i in range(count)} if count else set()
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i in chosen
    return sorted(chosen)
