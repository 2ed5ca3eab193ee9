"""The job's ranks as the checkpoint component sees them: where this process is, and the three collectives its
saving, publishing and resuming use (each a no-op with one process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class RankGroup:
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    distributed: bool = False  # a process group of several ranks exists

    @classmethod
    def of(cls, rank: int, world_size: int, local_rank: int = 0, local_world_size: int = 1) -> RankGroup:
        return cls(rank, world_size, local_rank, local_world_size, dist.is_initialized() and world_size > 1)

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on rank 0 (in rank order); [] elsewhere."""
        if not self.distributed:
            return [obj]
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered or []

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
