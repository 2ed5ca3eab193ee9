"""A network partition between two nodes, for real: each node in a network namespace of its own, joined by a veth
pair (as tests/test_faults.py's two-host job), and the link set down from node 1's side once checkpoint-8 is
published. Needs root and iproute2; skipped, with the reason, elsewhere.

Each node's hang watchdog (hang_timeout 10 s) catches the stuck collective, says in one line on its node's console
which node it lost and at which step, and its workers exit; then the nodes wait for each other up to rdzv_timeout.
Brought back, the link lets the job resume and end as the uninterrupted run did; left down, every node exits with
the retryable code, naming the partition, within hang_timeout + 60 s, and no worker outlives its launcher.

The job whose link stays down mostly waits (for the hang timeout, then rdzv_timeout): it runs beside the healed
job from that job's cut on (a side job, in namespaces of its own), and its test takes the result, or runs it
itself when run alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import read_metrics
from processes import alive, descendants
from ranks import free_port
from network_namespaces import NetworkNamespaces
from test_faults import (JOB_TIMEOUT, Cluster, Node, SideJobs, final_hash, job_config, losses,
                         shared_uninterrupted_run)

pytestmark = pytest.mark.slow  # bounds of a minute or more after the cut: they hold beside another test
HANG_TIMEOUT = 10
EXIT_RETRYABLE = 75


def two_namespaces() -> NetworkNamespaces:
    """Two hosts joined by a veth pair, created (the caller deletes them); skips where that cannot be done."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    made = NetworkNamespaces(tag="rn")
    try:
        made.create()
    except subprocess.CalledProcessError as exc:
        made.delete()
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    return made


@pytest.fixture
def spaces():
    made = two_namespaces()
    yield made
    made.delete()


@pytest.fixture(scope="module")
def side_jobs():
    jobs = SideJobs()
    yield jobs
    jobs.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, tiny_dataset) -> dict:
    """The job on 2 x 1 ranks without a fault: its losses and final weights."""
    return shared_uninterrupted_run(tmp_path_factory, tiny_model_dir, tiny_dataset, 1)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def start_hosts(cluster: Cluster, spaces: NetworkNamespaces, config: Path) -> list[Node]:
    """Node 0 then node 1, each in its namespace, node 1 once node 0's launcher has logged its settings."""
    port, nodes = free_port(), []
    for rank, (name, link, address) in enumerate(zip(spaces.names, spaces.links, spaces.addresses)):
        nodes.append(cluster.start(rank, config, port, prefix=["ip", "netns", "exec", name],
                                   master=spaces.addresses[0], overrides=[f"local_addr={address}"],
                                   env={"GLOO_SOCKET_IFNAME": link, "MESHTUNE_FAULT": "slow:0.3"}))
        if rank == 0:
            wait_for(lambda: "this node's rank" in nodes[0].output(), nodes, 120)
    return nodes


def wait_for(condition, nodes: list[Node], timeout: float) -> float:
    """Until `condition()`; every node must still run. When it held (monotonic)."""
    deadline = time.monotonic() + timeout
    while not condition():
        for node in nodes:
            assert node.process.poll() is None, node.output()[-4000:]
        assert time.monotonic() < deadline, [node.output()[-3000:] for node in nodes]
        time.sleep(0.1)
    return time.monotonic()


def cut_after_checkpoint_8(spaces: NetworkNamespaces, output: Path, nodes: list[Node]) -> float:
    """The link down once checkpoint-8 is published and step 9 logged: in a step, not in the save (whose
    collectives the hang watchdog does not time)."""
    wait_for(lambda: (output / "checkpoint-8" / "COMPLETE").exists() and len(read_metrics(output)) >= 9, nodes,
             JOB_TIMEOUT)
    assert not (output / "final").exists(), "the job ended before the cut: nothing was tested"
    spaces.ip("-n", spaces.names[1], "link", "set", spaces.links[1], "down")
    return time.monotonic()


def said_lost(node: Node, other: int) -> bool:
    return f"lost node {other} (" in node.output()


def test_a_partition_healed_after_both_nodes_named_it_resumes_exactly(spaces, cluster, tmp_path, reference,
                                                                       tiny_model_dir, tiny_dataset, side_jobs,
                                                                       tmp_path_factory):
    """The link is down until both nodes have said, each on its own console, that they lost the other (and the
    step): then restored. The job resumes from the newest checkpoint and ends with the uninterrupted run's losses
    and weights; the hang folder holds a summary. From the cut on, the partition for good runs beside it."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, hang_timeout=HANG_TIMEOUT,
                        rdzv_timeout=120)
    nodes = start_hosts(cluster, spaces, config)
    cut = cut_after_checkpoint_8(spaces, output, nodes)
    side_jobs.start("for good", lambda: partition_for_good(tmp_path_factory, tiny_model_dir, tiny_dataset))
    try:
        said = wait_for(lambda: said_lost(nodes[0], 1) and said_lost(nodes[1], 0), nodes, HANG_TIMEOUT + 60)
        assert said - cut < HANG_TIMEOUT + 60
        wait_for(lambda: "lost node 0 at step" in nodes[1].output() and "cannot reach" in nodes[1].output(), nodes, 30)
        spaces.ip("-n", spaces.names[1], "link", "set", spaces.links[1], "up")
        for node in nodes:
            assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
        for node, other in zip(nodes, (1, 0)):
            line = next(line for line in node.output().splitlines() if f"lost node {other} (" in line)
            assert f"meshtune: node {node.rank}: no optimizer step completed" in line and "at step " in line, line
            assert "network partition" in line, line
        summaries = list(output.glob("hang-*/summary.txt"))
        assert summaries, sorted(p.name for p in output.iterdir())
        assert any("did not report" in summary.read_text() for summary in summaries)
        assert losses(output) == reference["losses"]
        assert final_hash(output) == reference["hash"]
    finally:  # it ends within this test: no `alone` test elsewhere starts beside it
        side_jobs.wait("for good")


def partition_for_good(tmp_path_factory, model_dir: Path, dataset: Path) -> dict:
    """The job whose link stays down after checkpoint-8, in namespaces of its own: each node's output and exit code,
    the seconds from the cut until both had exited, and which processes of each node (taken once checkpoint-4 is
    published) were still alive then."""
    root = tmp_path_factory.mktemp("partition-for-good")
    spaces = two_namespaces()
    c = Cluster(root)
    try:
        output = root / "output"
        config = job_config(root / "cfg", model_dir, dataset, output, hang_timeout=HANG_TIMEOUT, rdzv_timeout=30)
        nodes = start_hosts(c, spaces, config)
        wait_for(lambda: (output / "checkpoint-4" / "COMPLETE").exists(), nodes, JOB_TIMEOUT)
        trees = [descendants(node.process.pid) for node in nodes]
        assert all(trees), trees
        cut = cut_after_checkpoint_8(spaces, output, nodes)
        for node in nodes:
            node.wait(HANG_TIMEOUT + 60 - (time.monotonic() - cut))
        return {"seconds": time.monotonic() - cut, "outliving": [[pid for pid in tree if alive(pid)] for tree in trees],
                "codes": [node.process.returncode for node in nodes], "texts": [node.output() for node in nodes]}
    finally:
        c.cleanup()
        spaces.delete()


def test_a_partition_for_good_ends_every_node_naming_it_within_hang_timeout_plus_60_s(side_jobs, tmp_path_factory,
                                                                                     tiny_model_dir, tiny_dataset):
    """The link stays down: each node names the node it lost and exits 75 (retryable) within hang_timeout + 60 s of
    the cut, without a traceback, and none of its processes outlives it."""
    run = side_jobs.result("for good", lambda: partition_for_good(tmp_path_factory, tiny_model_dir, tiny_dataset))
    assert run["seconds"] < HANG_TIMEOUT + 60
    for rank, (text, code, other) in enumerate(zip(run["texts"], run["codes"], (1, 0))):
        last = text.strip().splitlines()[-1]
        assert code == EXIT_RETRYABLE, text[-4000:]
        assert f"node {rank} lost node {other} at step" in last and "network partition" in last, last
        assert "retryable" in last, last
        assert f"lost node {other} (" in text, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
    assert run["outliving"] == [[], []], "a process outlived its launcher"
