"""Data parallelism: DDP, or FSDP2 `fully_shard` per transformer block then the root (ZeRO-2 / ZeRO-3)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshtune.distributed import DistEnv


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers, found by the class names HF models list in `_no_split_modules`."""
    base = getattr(model, "get_base_model", lambda: model)()
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise RuntimeError(f"cannot find the transformer blocks of {type(base).__name__} to shard")
    return blocks


def wrap_model(model: torch.nn.Module, parallel: str, env: DistEnv, bf16: bool) -> torch.nn.Module:
    """Apply the data-parallel wrapper; fp32 master weights stay fp32 in every mode."""
    if parallel == "ddp":
        if env.world_size == 1:
            return model  # nothing to synchronise; DDP's hooks cost a fifth of a LoRA step on one GPU (measured)
        if env.device.type == "cuda":
            return DistributedDataParallel(model, device_ids=[env.device.index])
        return DistributedDataParallel(model)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    reshard = parallel == "zero3"
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mixed)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mixed)
    return model


def gradient_sync(model: torch.nn.Module, sync: bool) -> ContextManager:
    """Skip the gradient all-reduce on all but the last micro-step of an optimizer step."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
