"""What every group of keys shares: its `Section` (the `--help` title and the keys' scope), the base model of a group,
and the checks several groups apply to their own keys."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MATH, JOB, NODE = "math", "job", "node"
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 value (torch.finfo(torch.float32).max)


class Section:
    """One group of keys: its title in `meshtune train --help`, and the scope its keys have unless one says otherwise.

    Scopes: `math` keys define what is computed (`TrainConfig.hash()`: the run's identity, kept in every checkpoint's
    manifest); `job` keys must be the same on every node without changing the math (they decide collectives, such as
    when to evaluate or save); `node` keys may differ from node to node (where this node writes, its address, its
    housekeeping). The startup agreement check compares the math and job keys of every node.
    """

    def __init__(self, title: str, scope: str):
        self.title, self.scope = title, scope

    def __call__(self, default: Any = ..., description: str = "", scope: str | None = None, **constraints) -> Any:
        return Field(default, description=description, **constraints,
                     json_schema_extra={"section": self.title, "scope": scope or self.scope})


class Keys(BaseModel):
    """The keys of one section and the checks that read only them; `TrainConfig` inherits every section's."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def split_commas(value: Any) -> Any:
    """LLaMA-Factory writes lists as comma-separated strings: `lora_target: q_proj,v_proj`."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def fits_fp32(value: float | None) -> float | None:
    """Keys that reach fp32 tensors (the optimizer's step, the clipping factor, the LoRA scale): a value beyond fp32's
    range would fail or turn inf only at the first step, after a restart of the workers."""
    if value is not None and not (math.isfinite(value) and abs(value) <= FP32_MAX):
        raise ValueError(f"{value!r} is beyond the range of a 32-bit float (at most {FP32_MAX:.4g}), in which "
                         f"the training computes it; give a finite value below that")
    return value
