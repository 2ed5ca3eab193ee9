"""Fault injection on a simulated cluster: 2 nodes x 2 processes, i.e. two torchrun agents (each started by
`meshtune train`, as a user would on each node) meeting on 127.0.0.1, training under hsdp (2 replicas x 2 shards).

On CPU/gloo with one thread per process the runs are bit-exact, so "resumes exactly" is checked with ==: the
losses after a recovery and the sha256 of the final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import base_config, kill_tree, read_metrics, run_cli, write_config

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 24, 4
JOB_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One simulated machine: `meshtune train cfg.yaml` with this node's NODE_RANK, output in a log file."""

    def __init__(self, rank: int, config: Path, port: int, log: Path, overrides=(), env=None, prefix=(),
                 master="127.0.0.1"):
        self.rank, self.log = rank, log
        environ = {**os.environ, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port), "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1", **(env or {})}
        command = [*prefix, sys.executable, "-m", "meshtune", "train", str(config), *overrides]
        with log.open("a") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ)

    def kill(self) -> None:
        """A dead machine: the agent and every worker below it, at once (SIGKILL)."""
        kill_tree(self.process.pid)
        self.process.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"node {self.rank} did not finish in {timeout} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text()


class Cluster:
    """Starts nodes and guarantees that every process they started is gone when the test ends."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.nodes: list[Node] = []

    def start(self, rank: int, config: Path, port: int, **kwargs) -> Node:
        node = Node(rank, config, port, self.directory / f"node{rank}.log", **kwargs)
        self.nodes.append(node)
        return node

    def run(self, config: Path, timeout: float = JOB_TIMEOUT, **kwargs) -> list[Node]:
        """A whole job: node 0 first (it hosts the rendezvous store), then node 1; both must succeed."""
        port = free_port()
        nodes = [self.start(0, config, port, **kwargs)]
        time.sleep(1)
        nodes.append(self.start(1, config, port, **kwargs))
        for node in nodes:
            assert node.wait(timeout) == 0, node.output()[-4000:]
        return nodes

    def cleanup(self) -> None:
        for node in self.nodes:
            kill_tree(node.process.pid)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def job_config(directory: Path, model_dir: Path, dataset: Path, output_dir: Path, **extra) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    values = base_config(model_dir, dataset, output_dir, finetuning_type="full", parallel="hsdp",
                         learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                         max_steps=STEPS, save_steps=SAVE_EVERY, tokenized_path=str(directory.parent / "tokenized"),
                         rdzv_timeout=60, ddp_timeout=60, max_restarts=3, nproc_per_node=None)
    values.update(extra)
    return write_config(directory, **values)


def final_hash(output_dir: Path) -> str:
    return hashlib.sha256((output_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir, tiny_dataset):
    """a. An uninterrupted 2-node run: the losses of every step and the hash of the final weights."""
    root = tmp_path_factory.mktemp("baseline")
    output = root / "output"
    config = job_config(root / "cfg", tiny_model_dir, tiny_dataset, output)
    c = Cluster(root)
    try:
        nodes = c.run(config)
    finally:
        c.cleanup()
    assert "resumed" not in nodes[0].output() + nodes[1].output()
    records = read_metrics(output)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    return {"output": output, "losses": losses(output), "hash": final_hash(output), "root": root}


def test_a_baseline_checkpoints_are_complete_and_verified(baseline):
    steps = sorted(int(p.name.split("-")[1]) for p in baseline["output"].glob("checkpoint-*"))
    assert steps == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    result, _ = run_cli(["ckpt", "verify", str(baseline["output"] / f"checkpoint-{STEPS}")], timeout=60)
    assert result.returncode == 0, result.stdout


def test_b_killed_node_restarts_and_the_job_ends_as_if_nothing_happened(cluster, tmp_path, baseline,
                                                                         tiny_model_dir, tiny_dataset):
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    port = free_port()
    node0 = cluster.start(0, config, port)
    time.sleep(1)
    node1 = cluster.start(1, config, port)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (output / "checkpoint-8" / "COMPLETE").exists():
        assert time.monotonic() < deadline and node0.process.poll() is None, node0.output()[-3000:]
        time.sleep(0.02)
    node1.kill()  # kill -9 of the whole node: agent and workers
    assert not (output / "final").exists(), "the job ended before the kill: nothing was tested"
    time.sleep(2)
    node1 = cluster.start(1, config, port)  # the same command, as an operator would
    assert node0.wait(JOB_TIMEOUT) == 0, node0.output()[-4000:]
    assert node1.wait(JOB_TIMEOUT) == 0, node1.output()[-4000:]
    assert "resumed from" in node0.output() + node1.output()
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


def test_c_rank_killed_while_saving_never_publishes_that_checkpoint(cluster, tmp_path, baseline,
                                                                    tiny_model_dir, tiny_dataset):
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    nodes = cluster.run(config, env={"MESHTUNE_FAULT": "save:8:3"})
    text = nodes[0].output() + nodes[1].output()
    assert "fault injection: killing rank 3 at save of step 8" in text
    assert "checkpoint-4 at step 4" in text and "checkpoint-8 at step 8" not in text
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


def test_d_flipped_byte_fails_verify_and_resume_falls_back(cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset):
    output = tmp_path / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    shard = output / f"checkpoint-{STEPS}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result, _ = run_cli(["ckpt", "verify", str(shard.parent)], timeout=60)
    assert result.returncode == 1 and "__1_0.distcp" in result.stdout
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    nodes = cluster.run(config)
    text = nodes[0].output() + nodes[1].output()
    assert f"warning: not resuming from checkpoint-{STEPS}" in text and "__1_0.distcp" in text
    assert f"checkpoint-{STEPS - SAVE_EVERY} at step {STEPS - SAVE_EVERY}" in text
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


def test_e_resume_on_another_world_size(tmp_path, baseline, tiny_model_dir, tiny_dataset):
    """Saved by 2 nodes x 2 processes, resumed on 1 node x 2 (accumulation 1 -> 2 keeps the global batch)."""
    output = tmp_path / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    for step in range(16, STEPS + 1, SAVE_EVERY):
        shutil.rmtree(output / f"checkpoint-{step}")
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, nproc_per_node=2)
    result, _ = run_cli(["train", str(config)], timeout=JOB_TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    assert "gradient_accumulation_steps 1 -> 2" in result.stdout and "checkpoint-12 at step 12" in result.stdout
    got = losses(output)
    assert got[:12] == baseline["losses"][:12]
    for step, (a, b) in enumerate(zip(got[12:], baseline["losses"][12:]), start=13):
        assert abs(a - b) / abs(b) < 1e-4, f"step {step}: {a} vs {b}"


def test_f_unreachable_master_fails_within_the_timeout_and_says_why(cluster, tmp_path, tiny_model_dir, tiny_dataset):
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, tmp_path / "output", rdzv_timeout=5)
    port = free_port()  # nobody listens there: a wrong MASTER_PORT, or node 0 never started
    started = time.monotonic()
    node1 = cluster.start(1, config, port)
    assert node1.wait(120) != 0
    text = node1.output()
    assert f"node 1 could not reach the rendezvous at 127.0.0.1:{port} within rdzv_timeout=5 s" in text
    assert "firewall" in text and "NODE_RANK" in text
    assert time.monotonic() - started < 60


def test_g_node_with_another_config_aborts_naming_it(cluster, tmp_path, tiny_model_dir, tiny_dataset):
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, tmp_path / "output")
    port = free_port()
    node0 = cluster.start(0, config, port)
    time.sleep(1)
    node1 = cluster.start(1, config, port, overrides=["learning_rate=3e-3"])
    codes = [node0.wait(120), node1.wait(120)]
    assert codes[0] != 0 and codes[1] != 0
    text = node0.output() + node1.output()
    assert "config key learning_rate differs between nodes" in text and "node 1 (" in text and "node 0 (" in text
    assert not (tmp_path / "output" / "checkpoint-4").exists(), "it trained before noticing"


class NetworkNamespaces:
    """Two hosts with their own addresses: network namespaces joined by a veth pair (needs root and iproute2)."""

    def __init__(self):
        tag = f"mt{os.getpid() % 100000}"
        self.names = [f"{tag}n0", f"{tag}n1"]
        self.links = [f"{tag}v0", f"{tag}v1"]
        self.addresses = ["10.231.0.1", "10.231.0.2"]

    def create(self) -> None:
        self.ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses):
            self.ip("netns", "add", name)
            self.ip("link", "set", link, "netns", name)
            self.ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            self.ip("-n", name, "link", "set", link, "up")
            self.ip("-n", name, "link", "set", "lo", "up")

    def delete(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    @staticmethod
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip); the 127.0.0.1 cluster tests cover the rest")
    spaces = NetworkNamespaces()
    try:
        spaces.create()
    except subprocess.CalledProcessError as exc:
        spaces.delete()
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    yield spaces
    spaces.delete()


def test_two_hosts_with_their_own_addresses_train_like_the_baseline(cluster, namespaces, tmp_path, baseline,
                                                                    tiny_model_dir, tiny_dataset):
    """The same job across a real (virtual) network: each node in its own namespace, talking over the veth pair;
    local_addr and GLOO_SOCKET_IFNAME pick the network, as on a cluster whose hostname resolves elsewhere."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    port = free_port()
    nodes = []
    for rank, (name, link, address) in enumerate(zip(namespaces.names, namespaces.links, namespaces.addresses)):
        nodes.append(cluster.start(rank, config, port, prefix=["ip", "netns", "exec", name],
                                   master=namespaces.addresses[0], overrides=[f"local_addr={address}"],
                                   env={"GLOO_SOCKET_IFNAME": link}))
        time.sleep(1)
    for node in nodes:
        assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]
