"""Pinning each CUDA worker to host CPUs near its GPU (`cpu_affinity`).

A training step is a chain of kernel launches from one host thread; every collective waits for the slowest
process's host. Unpinned, the kernel's scheduler moves the workers across sockets (their memory then sits on the
far NUMA node) and lets two workers, or one worker and another's compile threads, share a core. The GPU's NUMA
node comes from sysfs (the PCI device's `numa_node`), as `nvidia-smi topo -m` shows it; the CPUs are those the
process may use (a container's cpuset), grouped by physical core so two processes never share one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SYS = Path("/sys")


def cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_numa_node(pci_bus_id: str, sys_root: Path = SYS) -> int | None:
    """The NUMA node of the PCI device `0000:18:00.0`; None where the system does not say (-1, or no file)."""
    try:
        node = int((sys_root / "bus/pci/devices" / pci_bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sys_root: Path = SYS) -> set[int]:
    try:
        return cpu_list((sys_root / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


def physical_cores(cpus: set[int], sys_root: Path = SYS) -> list[list[int]]:
    """`cpus` grouped by physical core (hyperthread siblings together), in CPU order."""
    cores: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = cpu_list((sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
        except OSError:
            siblings = {cpu}
        cores.setdefault(tuple(sorted(siblings)), []).append(cpu)
    return sorted(cores.values())


def share(cores: list[list[int]], index: int, count: int) -> set[int]:
    """The `index`-th of `count` disjoint, contiguous shares of whole cores (the first shares take the remainder);
    with fewer cores than shares, the cores are dealt round-robin and shared."""
    if len(cores) < count:
        return set(cores[index % len(cores)])
    size, extra = divmod(len(cores), count)
    start = index * size + min(index, extra)
    return {cpu for core in cores[start:start + size + (index < extra)] for cpu in core}


def choose_cpus(mode: str, gpu_nodes: list[int | None], local_rank: int, allowed: set[int],
                sys_root: Path = SYS) -> tuple[set[int] | None, str]:
    """The CPUs local rank `local_rank` runs on under `mode` (none, node or exclusive: the config's auto arrives as
    node), given the NUMA node of each local process's GPU, and why; None leaves the process as it is."""
    node = gpu_nodes[local_rank]
    if mode == "none":
        return None, "cpu_affinity: none"
    near = node_cpus(node, sys_root) & allowed if node is not None else set()
    if not near:
        if mode == "node" or len(gpu_nodes) == 1:
            return None, "cpu_affinity: the system tells no NUMA node for this GPU; not pinned"
        near, where = allowed, "all allowed CPUs (no NUMA node known)"
        peers = list(range(len(gpu_nodes)))
    else:
        where = f"NUMA node {node}"
        peers = [rank for rank, other in enumerate(gpu_nodes) if other == node]
    if mode == "node":
        return near, f"cpu_affinity node: {len(near)} CPUs of {where}"
    cpus = share(physical_cores(near, sys_root), peers.index(local_rank), len(peers))
    return cpus, f"cpu_affinity exclusive: {len(cpus)} of the {len(near)} CPUs of {where}, shared by {len(peers)} process(es)"


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it), and torch's CPU thread pool
    no wider than them."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(max(1, min(torch.get_num_threads(), len(cpus))))


def apply_cpu_affinity(mode: str, local_rank: int, local_world_size: int) -> str | None:
    """Pin this CUDA worker (local rank `local_rank` of `local_world_size`, GPU i = local rank i) as `mode` says.
    Returns the line to log, or None where nothing applies (CPU runs, Linux without sched_setaffinity)."""
    if not torch.cuda.is_available() or not hasattr(os, "sched_setaffinity") or mode == "none":
        return None
    count = min(local_world_size, torch.cuda.device_count())
    if local_rank >= count:
        return None
    nodes = [gpu_numa_node(pci_bus_id(i)) for i in range(count)]
    cpus, why = choose_cpus(mode, nodes, local_rank, os.sched_getaffinity(0))
    if cpus:
        pin_process(cpus)
    return why


def pci_bus_id(device_index: int) -> str:
    """The GPU's PCI address as sysfs names it: domain:bus:device.function in lower-case hex."""
    props = torch.cuda.get_device_properties(device_index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
