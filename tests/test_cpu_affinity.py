"""cpu_affinity: which CPUs each CUDA worker is pinned to, read from a sysfs tree laid out as Linux lays it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtune.config import build_config
from meshtune.cpu_affinity import choose_cpus, cpu_list, gpu_numa_node, physical_cores, share

AUTO = build_config({"model_name_or_path": "m", "dataset": "d"}).cpu_pinning  # cpu_affinity auto, as applied


def fake_sys(root: Path, gpus: dict[str, int], nodes: dict[int, str], cores: int, threads: int = 2) -> Path:
    """GPUs at PCI addresses on NUMA nodes; CPUs 0..cores-1 each with its hyperthread sibling cpu + cores."""
    for address, node in gpus.items():
        (root / "bus/pci/devices" / address).mkdir(parents=True)
        (root / "bus/pci/devices" / address / "numa_node").write_text(f"{node}\n")
    for node, cpus in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for cpu in range(cores * threads):
        first = cpu % cores
        siblings = ",".join(str(first + t * cores) for t in range(threads))
        (root / f"devices/system/cpu/cpu{cpu}/topology").mkdir(parents=True)
        (root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").write_text(siblings + "\n")
    return root


def test_cpu_lists_read_as_linux_writes_them():
    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("") == set()


def test_gpu_numa_node_from_the_pci_device(tmp_path):
    root = fake_sys(tmp_path, {"0000:18:00.0": 0, "0000:9a:00.0": 1, "0000:c1:00.0": -1}, {}, 1)
    assert gpu_numa_node("0000:9A:00.0", root) == 1  # sysfs names are lower case
    assert gpu_numa_node("0000:c1:00.0", root) is None  # -1: the system does not say
    assert gpu_numa_node("0000:01:00.0", root) is None


def test_exclusive_gives_each_process_of_a_node_its_own_physical_cores(tmp_path):
    # two sockets of 4 cores x 2 threads: node 0 = CPUs 0-3 and 8-11, node 1 = 4-7 and 12-15
    root = fake_sys(tmp_path, {}, {0: "0-3,8-11", 1: "4-7,12-15"}, cores=8)
    assert physical_cores({0, 1, 8, 9}, root) == [[0, 8], [1, 9]]
    allowed = set(range(16))
    gpu_nodes = [0, 0, 1, 1]
    shares = [choose_cpus("exclusive", gpu_nodes, rank, allowed, root)[0] for rank in range(4)]
    assert shares == [{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}]
    cpus, why = choose_cpus("exclusive", gpu_nodes, 3, allowed, root)
    assert cpus == shares[3] and "exclusive: 4 of the 8 CPUs of NUMA node 1, shared by 2" in why
    cpus, why = choose_cpus(AUTO, gpu_nodes, 3, allowed, root)  # auto: the GPU's NUMA node
    assert cpus == {4, 5, 6, 7, 12, 13, 14, 15} and "node" in why
    cpus, why = choose_cpus("node", gpu_nodes, 1, allowed, root)
    assert cpus == {0, 1, 2, 3, 8, 9, 10, 11} and "node" in why


def test_only_allowed_cpus_are_used_and_unknown_nodes_fall_back(tmp_path):
    root = fake_sys(tmp_path, {}, {0: "0-7"}, cores=8, threads=1)
    # a container's cpuset of 5 CPUs: 3 + 2 for two processes
    assert share(physical_cores({1, 2, 3, 4, 5}, root), 0, 2) == {1, 2, 3}
    assert choose_cpus("exclusive", [0, 0], 1, {1, 2, 3, 4, 5}, root)[0] == {4, 5}
    # no NUMA node known: auto leaves the processes alone; exclusive splits the allowed CPUs between them
    assert choose_cpus(AUTO, [None], 0, set(range(8)), root)[0] is None
    assert choose_cpus(AUTO, [None, None], 1, set(range(8)), root)[0] is None
    assert choose_cpus("exclusive", [None, None], 1, set(range(8)), root)[0] == {4, 5, 6, 7}
    assert choose_cpus("none", [0, 0], 0, set(range(8)), root)[0] is None
    # more processes than cores: shared round-robin rather than none
    assert share([[0], [1]], 2, 3) == {0}


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_shares_cover_every_core_once(count):
    cores = [[c] for c in range(7)]
    shares = [share(cores, i, count) for i in range(count)]
    assert sorted(cpu for s in shares for cpu in s) == list(range(7))
