"""NCCL collectives alone, at the sizes training sends: all-reduce of DDP's fp32 buckets (25 MB) and larger, and
FSDP2's per-unit all-gather (bf16 weights) and reduce-scatter (fp32 gradients) for one Qwen2.5-1.5B block (46.8M
parameters) and one 7B block (233M). The speed the links give when nothing else runs, to compare with the
collective kernels of a profiled training step: a kernel much slower in training than here waited for its peers.
Rank 0 prints one line per collective and size.

  torchrun --nproc_per_node 4 bench/allreduce_probe.py            (NCCL_DEBUG=INFO shows the transport: P2P, SHM, NET)
  NCCL_PROTO=Simple torchrun --nproc_per_node 4 bench/allreduce_probe.py
  torchrun --nproc_per_node 4 bench/allreduce_probe.py --unit-params-m 93.6   (two 1.5B blocks a unit)
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

SIZES_MB = (25, 100, 1000)
UNIT_PARAMS_M = (46.8, 233.0)  # one decoder block of Qwen2.5-1.5B and of Qwen2.5-7B, millions of parameters
REPEATS = 10
# torch 2.12's names; earlier releases have only the old ones
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def timed(run, device: torch.device) -> float:
    """Seconds per call of `run`, after 3 warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        run()
    sync()
    started = time.perf_counter()
    for _ in range(REPEATS):
        run()
    sync()
    return (time.perf_counter() - started) / REPEATS


def report(rank: int, what: str, full_bytes: int, seconds: float, world: int, factor: float) -> None:
    """Bus bandwidth as nccl-tests defines it: all-reduce moves 2(n-1)/n of the buffer, the others (n-1)/n."""
    bus = full_bytes / 2**30 * factor * (world - 1) / world / seconds
    if rank == 0:
        print(f"{dist.get_backend()} NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')} {what} "
              f"{full_bytes / 2**20:.0f} MB: {seconds * 1e3:.2f} ms, bus bandwidth {bus:.0f} GiB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default=",".join(map(str, SIZES_MB)), help="all-reduce sizes, comma-separated")
    parser.add_argument("--unit-params-m", default=",".join(map(str, UNIT_PARAMS_M)),
                        help="FSDP unit sizes to probe, millions of parameters, comma-separated")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo on CPU: the script itself runs without a GPU
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    for mb in (float(m) for m in args.sizes_mb.split(",")):
        x = torch.ones(int(mb * 2**20) // 4, device=device)  # fp32, as DDP's gradient buckets
        report(rank, "all_reduce fp32", x.numel() * 4, timed(lambda: dist.all_reduce(x), device), world, 2)
    for millions in (float(m) for m in args.unit_params_m.split(",")):
        n = int(millions * 1e6) // world * world
        weights = torch.empty(n, dtype=torch.bfloat16, device=device)
        shard = torch.ones(n // world, dtype=torch.bfloat16, device=device)
        report(rank, f"all_gather bf16 ({millions:g}M params)", n * 2,
               timed(lambda: all_gather(weights, shard), device), world, 1)
        grads, grad_shard = torch.ones(n, device=device), torch.empty(n // world, device=device)
        report(rank, f"reduce_scatter fp32 ({millions:g}M params)", n * 4,
               timed(lambda: reduce_scatter(grad_shard, grads), device), world, 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
