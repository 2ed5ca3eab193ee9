"""What `auto` means for the values whose `auto` is no run decision (those the run plan makes concrete: plan/):
the chat template a manifest names, torchrun's process count, a foreign file's `"auto"`."""

from __future__ import annotations

from typing import Any


def template_choice(template: str | None) -> str | None:
    """A `template` value, the config's or a checkpoint manifest's (None where it predates the key): None for auto,
    the tokenizer's own chat template where it has one, else ChatML."""
    return None if template in (None, "auto") else template


def torchrun_nproc(raw: str) -> str:
    """NPROC_PER_NODE as meshtune reads it: torchrun's names for its default, auto and gpu (a process a GPU,
    meshtune's default too), as not set ("")."""
    return "" if raw in ("auto", "gpu") else raw


def without_autos(tree: Any) -> Any:
    """A foreign config (a DeepSpeed JSON) with each `"auto"` value as None, not given: there `auto` asks the program
    reading the file to fill in its own value, which for meshtune is the key as its config sets it, or its default."""
    if isinstance(tree, dict):
        return {key: without_autos(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [without_autos(value) for value in tree]
    return None if tree == "auto" else tree

