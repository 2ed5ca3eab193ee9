"""Activation checkpointing: recompute a chosen fraction of the transformer blocks in backward."""

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
    blocks = transformer_blocks(model)
    chosen = {int(i / ratio) for i in range(round(len(blocks) * ratio))}
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i in chosen
