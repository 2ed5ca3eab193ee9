"""The reference model a preference loss compares the policy with: under LoRA and Q-LoRA the same model with its
adapters (and the modules they train in full) turned off, so no second copy is held; gradients off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from meshtune.model.parallel import unwrap


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within it, `model` (the wrapped one: DDP or FSDP2 run their forward as usual) computes as the base model it
    started from, without gradients."""
    with torch.no_grad(), unwrap(model).disable_adapter():
        yield model
