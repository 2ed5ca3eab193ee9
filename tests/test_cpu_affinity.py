"""cpu_affinity: which CPUs each CUDA worker is pinned to, read from a sysfs tree laid out as Linux lays it out, and
who pins it: torchrun's --numa-binding where the installed torch has it and it would pin as meshtune does, else the
worker itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from meshtune import cpu_affinity
from meshtune.config import build_config
from meshtune.cpu_affinity import (apply_cpu_affinity, choose_cpus, cpu_list, gpu_numa_node, numa_nodes_named,
                                   physical_cores, share, torchrun_binding_modes, torchrun_binding_of,
                                   torchrun_numa_binding)
from meshtune.launch import detect_node_settings, torchrun_command
from meshtune.launch import torchrun as torchrun_module

GPUS = ["0000:18:00.0", "0000:9a:00.0"]

AUTO = build_config({"model_name_or_path": "m", "dataset": "d"}).cpu_pinning  # cpu_affinity auto, as applied


def fake_sys(root: Path, gpus: dict[str, int], nodes: dict[int, str], cores: int, threads: int = 2) -> Path:
    """GPUs at PCI addresses on NUMA nodes; CPUs 0..cores-1 each with its hyperthread sibling cpu + cores."""
    for address, node in gpus.items():
        (root / "bus/pci/devices" / address).mkdir(parents=True)
        (root / "bus/pci/devices" / address / "numa_node").write_text(f"{node}\n")
        (root / "bus/pci/devices" / address / "class").write_text("0x030200\n")  # a 3D controller
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


# who pins: torchrun or the worker


@pytest.fixture
def gpu_host(tmp_path, monkeypatch) -> Path:
    """Two sockets of 4 cores x 2 threads, GPU 0 on NUMA node 0 and GPU 1 on node 1, numactl installed, both GPUs
    visible."""
    root = fake_sys(tmp_path, dict(zip(GPUS, [0, 1])), {0: "0-3,8-11", 1: "4-7,12-15"}, cores=8)
    monkeypatch.setattr(cpu_affinity.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(cpu_affinity, "cuda_device_count", lambda: 2)
    return root


def cuda_worker(monkeypatch, agent: list[str]) -> list[set[int]]:
    """This process as a CUDA worker whose parent runs `agent`, on a machine allowing CPUs 0-15; returns the list the
    CPUs it pins itself to are recorded in (instead of pinning this process)."""
    pinned: list[set[int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(GPUS))
    monkeypatch.setattr(cpu_affinity, "pci_bus_id", GPUS.__getitem__)
    monkeypatch.setattr(cpu_affinity, "agent_command", lambda: agent)
    monkeypatch.setattr(cpu_affinity, "pin_process", pinned.append)
    monkeypatch.setattr(cpu_affinity, "narrow_thread_pool", lambda cpus: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
    return pinned


AGENT = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts", "0"]


def test_torchrun_pins_the_workers_where_the_installed_torch_has_numa_binding(gpu_host, monkeypatch):
    if not torchrun_binding_modes():
        pytest.skip(f"torch {torch.__version__}'s torchrun has no --numa-binding: each worker pins itself")
    assert {"node", "exclusive"} <= torchrun_binding_modes()
    assert torchrun_numa_binding(AUTO, 2, gpu_host) == "node"
    assert torchrun_numa_binding("node", 2, gpu_host) == "node"
    assert torchrun_numa_binding("exclusive", 2, gpu_host) == "exclusive"
    assert torchrun_numa_binding("none", 2, gpu_host) is None
    # torchrun would stop the job: a local rank past the visible GPUs, or no numactl to run the workers under
    assert torchrun_numa_binding(AUTO, 3, gpu_host) is None
    monkeypatch.setattr(cpu_affinity.shutil, "which", lambda name: None)
    assert torchrun_numa_binding(AUTO, 2, gpu_host) is None

    # the worker under that torchrun leaves its CPUs as they are
    pinned = cuda_worker(monkeypatch, [*AGENT, "--numa-binding=node", "-m", "meshtune", "train", "c.yaml"])
    assert apply_cpu_affinity(AUTO, 1, 2, gpu_host) == (
        "cpu_affinity node: torchrun's --numa-binding=node pinned this worker to 16 CPUs")
    assert pinned == []


def test_each_worker_pins_itself_where_torchrun_has_no_numa_binding(gpu_host, monkeypatch):
    monkeypatch.setattr(cpu_affinity, "torchrun_binding_modes", frozenset)  # an older torch
    assert torchrun_numa_binding(AUTO, 2, gpu_host) is None
    assert torchrun_numa_binding("exclusive", 2, gpu_host) is None
    pinned = cuda_worker(monkeypatch, [*AGENT, "-m", "meshtune", "train", "c.yaml"])
    assert apply_cpu_affinity(AUTO, 1, 2, gpu_host) == "cpu_affinity node: 8 CPUs of NUMA node 1"
    assert pinned == [{4, 5, 6, 7, 12, 13, 14, 15}]
    assert apply_cpu_affinity("exclusive", 0, 2, gpu_host).startswith("cpu_affinity exclusive: 8 of the 8 CPUs")
    assert pinned[-1] == {0, 1, 2, 3, 8, 9, 10, 11}
    assert apply_cpu_affinity("none", 0, 2, gpu_host) is None and len(pinned) == 2


def test_the_command_asks_torchrun_for_the_binding_it_can_do(monkeypatch):
    cfg = build_config({"model_name_or_path": "/models/x", "dataset": "train.jsonl", "output_dir": "runs/a"})
    one_node = detect_node_settings(cfg, environ={"NPROC_PER_NODE": "2"})
    two_nodes = detect_node_settings(cfg, environ={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3",
                                                   "MASTER_PORT": "29555", "NPROC_PER_NODE": "2"})
    asked = []
    monkeypatch.setattr(torchrun_module, "torchrun_numa_binding",
                        lambda mode, nproc: asked.append((mode, nproc)) or "node")
    for settings in (one_node, two_nodes):
        command = torchrun_command(settings, ["train", "c.yaml"], cfg)
        assert command[-5:] == ["--numa-binding=node", "-m", "meshtune", "train", "c.yaml"]
        assert torchrun_binding_of(command) == "node"
    assert asked == [(AUTO, 2), (AUTO, 2)]  # cpu_affinity auto, as the launcher asks for it
    monkeypatch.setattr(torchrun_module, "torchrun_numa_binding", lambda mode, nproc: None)
    command = torchrun_command(one_node, ["train", "c.yaml"], cfg)
    assert not any(arg.startswith("--numa-binding") for arg in command) and torchrun_binding_of(command) is None


def test_the_binding_is_read_from_torchruns_own_options_only():
    assert torchrun_binding_of(["/venv/bin/torchrun", "--numa_binding", "exclusive", "train.py"]) == "exclusive"
    assert torchrun_binding_of([*AGENT, "-m", "meshtune", "train", "--numa-binding=node"]) is None  # meshtune's
    assert torchrun_binding_of(["bash", "-c", "sleep 1"]) is None
    assert torchrun_binding_of([]) is None


def test_torchrun_is_left_out_where_it_would_bind_a_gpu_to_the_wrong_node(tmp_path):
    """torchrun takes a GPU whose NUMA node sysfs does not name for node 0: right on a host of one node only."""
    two = fake_sys(tmp_path / "two", {GPUS[0]: 0, GPUS[1]: -1}, {0: "0-3", 1: "4-7"}, cores=8, threads=1)
    assert not numa_nodes_named(two)
    (two / "bus/pci/devices" / GPUS[1] / "numa_node").write_text("1\n")
    nic = two / "bus/pci/devices/0000:3b:00.0"
    nic.mkdir()
    (nic / "class").write_text("0x020000\n")  # an Ethernet controller: its node does not matter
    (nic / "numa_node").write_text("-1\n")
    assert numa_nodes_named(two)
    assert numa_nodes_named(fake_sys(tmp_path / "one", {GPUS[0]: -1}, {0: "0-7"}, cores=8, threads=1))
    assert not numa_nodes_named(fake_sys(tmp_path / "none", {GPUS[0]: -1}, {}, cores=1))  # torchrun finds no node 0
