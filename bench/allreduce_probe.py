"""NCCL all-reduce alone, at the sizes DDP sends (25 MB buckets) and larger: the speed the links give when nothing
else runs, to compare with the all-reduce kernels of a profiled training step. Rank 0 prints one line per size.

  torchrun --nproc_per_node 4 bench/allreduce_probe.py            (NCCL_DEBUG=INFO shows the transport: P2P, SHM, NET)
  NCCL_PROTO=Simple torchrun --nproc_per_node 4 bench/allreduce_probe.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

SIZES_MB = (25, 100, 1000)
REPEATS = 10


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mb in SIZES_MB:
        x = torch.ones(mb * 2**20 // 4, device="cuda")  # fp32, as DDP's gradient buckets
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / REPEATS
        bus = mb / 2**10 * 2 * (world - 1) / world / seconds  # bus bandwidth, as nccl-tests defines it
        if rank == 0:
            print(f"NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')} {mb} MB: {seconds * 1e3:.2f} ms, "
                  f"bus bandwidth {bus:.0f} GiB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
