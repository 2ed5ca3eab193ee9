"""What the tests of the parallel layouts share to resolve a run plan in this process, with no model and no GPU: the
Qwen2.5-7B shape, a DistEnv of any size and rank, and `plan_for`."""

from __future__ import annotations

import torch

from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.plan import ModelSize, RunPlan, resolve

QWEN_7B = ModelSize(7_615_616_512, 233_057_792, 28, attention_heads=28, kv_heads=4, model_type="qwen2", hidden=3584,
                    head_parameters=152_064 * 3_584)


def env(world_size: int, local_world_size: int | None = None, rank: int = 0, device: str = "cpu") -> DistEnv:
    local = local_world_size or world_size
    return DistEnv(rank, world_size, rank % local, local, torch.device(device))


def plan_for(values: dict, world_size: int = 4, local: int | None = None, size: ModelSize = QWEN_7B) -> RunPlan:
    """The plan of a job of `world_size` processes (`local` a node) for the config `values`."""
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **values})
    return resolve(cfg, env(world_size, local), None, lambda: size)
