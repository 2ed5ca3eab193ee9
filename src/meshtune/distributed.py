"""Process group, device and the few collectives the loop needs.

Every code path runs in a process group, also a single process (world size 1), so one-GPU, one-node and
many-node runs execute the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshtune.worker_env import torchrun_worker


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments(enabled: bool) -> bool:
    """Before this process allocates on CUDA: let the caching allocator grow segments instead of allocating new ones
    (fewer fragmentation retries; torchtitan runs with it). Through torch's setter, which takes effect whether or not
    torch has already read the environment; a variable the user set wins. True where it was set."""
    if not enabled or any(name in os.environ for name in ALLOC_CONF_VARS) or not torch.cuda.is_available():
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


def init_distributed(timeout_s: int) -> DistEnv:
    """Join the process group torchrun prepared, or form a group of one."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if torchrun_worker():
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:
        rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum across all ranks; returns the tensor for chaining."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """In-place maximum across all ranks; returns the tensor for chaining."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` (any picklable value) on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
