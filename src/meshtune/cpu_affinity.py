"""Pinning each CUDA worker to host CPUs near its GPU (`cpu_affinity`).

A training step is a chain of kernel launches from one host thread; every collective waits for the slowest
process's host. Unpinned, the kernel's scheduler moves the workers across sockets (their memory then sits on the
far NUMA node) and lets two workers, or one worker and another's compile threads, share a core. The GPU's NUMA
node comes from sysfs (the PCI device's `numa_node`), as `nvidia-smi topo -m` shows it; the CPUs are those the
process may use (a container's cpuset), grouped by physical core so two processes never share one.

Where the installed torch's torchrun has `--numa-binding`, the launcher hands the pinning to it: torchrun starts
each worker under numactl, so the worker runs near its GPU from its first instruction (its threads and its first
memory too), where meshtune's own pinning moves the threads only once the worker runs Python. meshtune's own pinning
is the fallback wherever torchrun's would fail or pin elsewhere (see `torchrun_numa_binding`), and for one process
trained without torchrun.

torch is imported inside the functions that use it: the launcher (`launch --dry-run` too) decides on torchrun's
option without importing torch wherever numactl is missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil

SYS = Path("/sys")
# meshtune's mode (the config's auto arrives as node: TrainConfig.cpu_pinning) -> the value of torchrun's
# --numa-binding that pins the same CPUs
TORCHRUN_MODES = {"node": "node", "exclusive": "exclusive"}


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
    return cpus, (f"cpu_affinity exclusive: {len(cpus)} of the {len(near)} CPUs of {where}, "
                  f"shared by {len(peers)} process(es)")


def numa_nodes_named(sys_root: Path = SYS) -> bool:
    """Whether sysfs lists the host's NUMA nodes and, on a host of several, names the node of every display-class
    PCI device (class 0x03...: the GPUs among them, found without CUDA in the launcher). torchrun's binding takes a
    GPU whose node is not named (-1) for node 0, which is right only on a host of one node."""
    nodes = list((sys_root / "devices/system/node").glob("node[0-9]*"))
    if len(nodes) <= 1:
        return bool(nodes)
    devices = sys_root / "bus/pci/devices"
    for device in devices.iterdir() if devices.is_dir() else ():
        try:
            display = (device / "class").read_text().startswith("0x03")
        except OSError:
            continue
        if display and gpu_numa_node(device.name, sys_root) is None:
            return False
    return True


def torchrun_binding_modes() -> frozenset[str]:
    """The values the installed torchrun's `--numa-binding` takes; none where it has no such option (older torch).
    argparse lists a parser's options only in its private table."""
    from torch.distributed.run import get_args_parser

    option = get_args_parser()._option_string_actions.get("--numa-binding")
    return frozenset(option.choices or ()) if option is not None else frozenset()


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_numa_binding(mode: str, nproc_per_node: int, sys_root: Path = SYS) -> str | None:
    """The value of torchrun's `--numa-binding` that pins this node's workers as `mode` asks, or None where each
    worker pins itself (`apply_cpu_affinity`) or nothing is pinned."""
    value = TORCHRUN_MODES.get(mode)
    # torchrun stops the job where it cannot bind a worker (no numactl on PATH, or a local rank past the visible GPUs,
    # as on CPU), and binds a GPU whose NUMA node sysfs does not name to node 0
    if value is None or shutil.which("numactl") is None or not numa_nodes_named(sys_root):
        return None
    if value not in torchrun_binding_modes() or cuda_device_count() < nproc_per_node:
        return None
    return value


def torchrun_binding_of(command: list[str]) -> str | None:
    """The `--numa-binding` of a torchrun command line (`python -m torch.distributed.run ...` or `torchrun ...`), read
    by torchrun's own parser; None for any other command."""
    start = next((i + 1 for i, arg in enumerate(command)
                  if arg == "torch.distributed.run" or Path(arg).name == "torchrun"), None)
    if start is None:
        return None
    from torch.distributed.run import get_args_parser

    try:
        given, _ = get_args_parser().parse_known_args(command[start:])
    except SystemExit:  # not a command line this torchrun reads
        return None
    return getattr(given, "numa_binding", None)


def agent_command() -> list[str]:
    """The command line of this process's parent: in a torchrun worker, the agent's (torchrun's numactl replaced
    itself with the worker)."""
    try:
        return psutil.Process().parent().cmdline()
    except (psutil.Error, AttributeError):  # no parent any more, or not ours to read
        return []


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it), and torch's CPU thread pool
    no wider than them."""
    for thread in psutil.Process().threads():
        try:
            os.sched_setaffinity(thread.id, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    narrow_thread_pool(len(cpus))


def narrow_thread_pool(cpus: int) -> None:
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), cpus)))


def apply_cpu_affinity(mode: str, local_rank: int, local_world_size: int, sys_root: Path = SYS) -> str | None:
    """Pin this CUDA worker (local rank `local_rank` of `local_world_size`, GPU i = local rank i) as `mode` says,
    unless torchrun's `--numa-binding` pinned it already. Returns the line to log, or None where nothing applies
    (CPU runs, Linux without sched_setaffinity)."""
    import torch

    if not torch.cuda.is_available() or not hasattr(os, "sched_setaffinity") or mode == "none":
        return None
    bound = torchrun_binding_of(agent_command())
    if bound is not None:
        cpus = os.sched_getaffinity(0)
        narrow_thread_pool(len(cpus))
        return f"cpu_affinity {mode}: torchrun's --numa-binding={bound} pinned this worker to {len(cpus)} CPUs"
    count = min(local_world_size, torch.cuda.device_count())
    if local_rank >= count:
        return None
    nodes = [gpu_numa_node(pci_bus_id(i), sys_root) for i in range(count)]
    cpus, why = choose_cpus(mode, nodes, local_rank, os.sched_getaffinity(0), sys_root)
    if cpus:
        pin_process(cpus)
    return why


def pci_bus_id(device_index: int) -> str:
    """The GPU's PCI address as sysfs names it: domain:bus:device.function in lower-case hex."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
