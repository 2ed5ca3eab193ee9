"""What this process's torch and device can do: the facts the run plan is resolved from.

torch's variable-length attention (padding-free rows), bf16 on the GPU, the smallest GPU of the job (one choice
for nodes with different cards), the card's measured bf16 matmul rate (the denominator of MFU) and, on CPU, the
processes' fp32 matmul rate and host memory (what the link choice weighs a CPU job's step with).
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch
import torch.distributed as dist


def varlen_available(device: torch.device) -> bool:
    """Whether this torch has variable-length flash attention for `device`. Found without importing it: its import
    brings in torch's compiler (seconds), which only the training processes need (model/attention.py)."""
    return device.type == "cuda" and importlib.util.find_spec("torch.nn.attention.varlen") is not None


def bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def smallest_gpu_memory(device: torch.device, limit_gib: float | None = None) -> float:
    """Bytes of the smallest GPU among all ranks, or of `limit_gib` where that is less (a collective: every rank
    calls it)."""
    total = torch.cuda.get_device_properties(device).total_memory
    smallest = torch.tensor([min(total, limit_gib * 2**30) if limit_gib else total], dtype=torch.float64,
                            device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return smallest.item()


def measure_peak_flops(device: torch.device, size: int = 8192, repeats: int = 20) -> float | None:
    """Dense bf16 matmul FLOP/s of this card, measured (datasheet numbers overstate what a kernel reaches)."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * size**3 * repeats / seconds


CPU_MATMUL = 512  # a square fp32 matmul of a small model's width, what a CPU job's layers multiply


def measure_cpu_flops(size: int = CPU_MATMUL, seconds: float = 0.25) -> float:
    """fp32 matmul FLOP/s of this process's CPU threads (a CPU job computes in fp32), over `seconds`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        a @ b
        count += 1
    return 2.0 * size**3 * count / elapsed


def cpu_flops_a_process(processes_a_node: int) -> float:
    """`measure_cpu_flops` on the share of this machine's cores one of `processes_a_node` training processes gets
    (torchrun's OMP_NUM_THREADS: the cores over the processes), the intra-op threads put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(processes_a_node, 1)))
    try:
        return measure_cpu_flops()
    finally:
        torch.set_num_threads(threads)


def host_bytes_a_process(per_node: int) -> float:
    """This machine's memory over the node's processes: what a CPU job's process may hold."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(per_node, 1)


def slowest_peak_flops(device: torch.device) -> float | None:
    """The lowest measured matmul rate among all ranks (a collective: every rank calls it), so that a choice made
    from it is the same on every rank: bf16 on GPUs; fp32 on CPU, every rank measuring at once, as the node's
    processes share its cores when they train."""
    if device.type == "cpu":
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        measured = measure_cpu_flops()
    else:
        measured = measure_peak_flops(device)
    if measured is None:
        return None
    slowest = torch.tensor([measured], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    return slowest.item()


def limit_gpu_memory(device: torch.device, limit_gib: float | None) -> bool:
    """Cap what this process may allocate on its GPU at `limit_gib` (torch's caching allocator then fails an
    allocation beyond it as out of memory). True where a cap was set."""
    if not limit_gib or device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * 2**30 / total), device)
    return True
