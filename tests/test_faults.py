"""Fault injection on a simulated cluster: two torchrun agents (each started by `meshtune train`, as a user would
on each node) meeting on 127.0.0.1, training under hsdp. What a node does (dies, is relaunched, is signalled,
never joins, resumes) runs on 2 nodes of 1 process (into a bucket: of 2); what a rank does among the others of its
node (hangs and is ended by its node's reporting rank, straggles) on 2 nodes of 2 processes (2 replicas x 2
shards).

On CPU/gloo with one thread per process the runs are bit-exact, so "resumes exactly" is checked with ==: the
losses after a recovery and the sha256 of the final weights equal the uninterrupted run's. That run (`baseline`,
one per layout, module-scoped) is the training code on the same ranks and mesh without the launchers: the ranks
torchrun would start, forked (tests/ranks.py); it gives the 2-node job's losses and weights bit for bit (test
test_two_hosts_with_their_own_addresses_train_like_the_baseline holds an uninterrupted 2-node job to it).

Jobs also start beside a later test's job (`SideJobs`). Only file order, pytest's own, puts a side job's start
before the test that reads its result, and that is for speed: each such test runs its job itself when run alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import base_config, kill_tree, read_metrics, run_cli_here, write_config
from network_namespaces import NetworkNamespaces
from ranks import free_port, run_meshtune_ranks, wait_for_port

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 16, 4
JOB_TIMEOUT = 240


class Node:
    """One simulated machine: `meshtune train cfg.yaml` with this node's NODE_RANK, output in a log file."""

    def __init__(self, rank: int, config: Path, port: int, log: Path, overrides=(), env=None, prefix=(),
                 master="127.0.0.1", per_node: int = 1):
        self.rank, self.log = rank, log
        environ = {**os.environ, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port), "NPROC_PER_NODE": str(per_node), "OMP_NUM_THREADS": "1",
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
        """Node `rank`, its output in node<rank>.log (node<rank>-<n>.log when it is the n-th start of that rank)."""
        earlier = sum(node.rank == rank for node in self.nodes)
        node = Node(rank, config, port, self.directory / f"node{rank}{f'-{earlier}' if earlier else ''}.log", **kwargs)
        self.nodes.append(node)
        return node

    def start_job(self, config: Path, port: int, store_on_port: bool = True, **kwargs) -> list[Node]:
        """Both nodes: node 0 first, then node 1 once node 0's launcher hosts the rendezvous store on `port`. Without
        `store_on_port` (an etcd rendezvous: the store on `port` opens only once every node joined) both at once."""
        nodes = [self.start(0, config, port, **kwargs)]
        if store_on_port:
            wait_for_port(port, nodes[0].process, kwargs.get("master", "127.0.0.1"), timeout=JOB_TIMEOUT)
        return nodes + [self.start(1, config, port, **kwargs)]

    def run(self, config: Path, timeout: float = JOB_TIMEOUT, **kwargs) -> list[Node]:
        """A whole job: both nodes must succeed."""
        nodes = self.start_job(config, free_port(), **kwargs)
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


class SideJobs:
    """Scenarios that run while another test's job runs, to use the cores its single-threaded phases (start-up,
    waits) leave idle: each is a job of its own (own ports, output_dir and processes) with nothing timed against
    its training steps (no kill, signal or straggler measure), nor in the job it runs beside. Each scenario's test
    takes the result, and starts the job itself when run alone. A test that starts side jobs waits for them
    before it ends, so none runs beside the step-timed tests (the hang watchdog's and the SIGTERM ones), which are
    marked `alone`: under pytest-xdist no other module's test runs beside them either."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, Future] = {}

    def start(self, name: str, job: Callable[[], dict]) -> Future:
        if name not in self.futures:
            self.futures[name] = self.pool.submit(job)
        return self.futures[name]

    def result(self, name: str, job: Callable[[], dict]) -> dict:
        return self.start(name, job).result()

    def wait(self, *names: str) -> None:
        """Until these have ended, however they ended (their tests report how)."""
        futures.wait([self.futures[name] for name in names if name in self.futures])


@pytest.fixture(scope="module")
def side_jobs():
    jobs = SideJobs()
    yield jobs
    jobs.pool.shutdown(wait=True)


def job_config(directory: Path, model_dir: Path, dataset: Path, output_dir: Path, per_node: int = 1,
               **extra) -> Path:
    """The job's config for nodes of `per_node` processes (each node one replica of `per_node` shards); the
    process count comes from NPROC_PER_NODE."""
    directory.mkdir(parents=True, exist_ok=True)
    values = base_config(model_dir, dataset, output_dir, finetuning_type="full", parallel="hsdp",
                         hsdp_shard_size=per_node, learning_rate=1e-3, per_device_train_batch_size=2,
                         gradient_accumulation_steps=1, max_steps=STEPS, save_steps=SAVE_EVERY,
                         tokenized_path=str(directory.parent / "tokenized"), rdzv_timeout=60, ddp_timeout=60,
                         max_restarts=3, nproc_per_node=None)
    values.update(extra)
    return write_config(directory, **values)


def final_hash(output_dir: Path) -> str:
    return hashlib.sha256((output_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


def uninterrupted_run(root: Path, model_dir: Path, dataset: Path, per_node: int) -> dict:
    """The job of nodes of `per_node` processes without a fault, on 2 x `per_node` ranks of this machine: the
    losses of every step and the hash of the final weights."""
    output = root / "output"
    config = job_config(root / "cfg", model_dir, dataset, output, per_node)
    result = run_meshtune_ranks(["train", str(config)], 2 * per_node, root / "ranks", timeout=JOB_TIMEOUT,
                                env={"OMP_NUM_THREADS": "1"})  # as each node's processes have
    assert result.returncode == 0, result.stdout[-4000:]
    assert "resumed" not in result.stdout
    records = read_metrics(output)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    return {"output": output, "losses": losses(output), "hash": final_hash(output)}


def shared_uninterrupted_run(tmp_path_factory, model_dir: Path, dataset: Path, per_node: int) -> dict:
    """`uninterrupted_run`, once in a test run: this module, test_partition.py and test_rendezvous_churn.py compare
    against the same job. Under pytest-xdist the first worker to need it runs it, holding a file lock in the run's
    temp folder, and leaves its result there for the others; the run is keyed by the model's and the data's bytes
    (each worker builds its own, the same)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    digest = hashlib.sha256(str(per_node).encode())
    for path in [*sorted(p for p in model_dir.iterdir() if p.is_file()), dataset]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = shared / f"uninterrupted-{per_node}-{digest.hexdigest()[:16]}"
    result = root.with_suffix(".json")
    with (shared / f"{root.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            run = uninterrupted_run(root, model_dir, dataset, per_node)
            result.write_text(json.dumps({**run, "output": str(run["output"])}))
    run = json.loads(result.read_text())  # floats written by repr: read back exactly
    return {**run, "output": Path(run["output"])}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir, tiny_dataset):
    """`baseline(per_node)`: the uninterrupted run of the job on nodes of `per_node` processes (run once)."""
    runs: dict[int, dict] = {}

    def of(per_node: int) -> dict:
        if per_node not in runs:
            runs[per_node] = shared_uninterrupted_run(tmp_path_factory, tiny_model_dir, tiny_dataset, per_node)
        return runs[per_node]
    return of


def test_the_uninterrupted_runs_checkpoints_are_complete_and_verified(baseline, capfd):
    output = baseline(2)["output"]
    steps = sorted(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*"))
    assert steps == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    result = run_cli_here(["ckpt", "verify", str(output / f"checkpoint-{STEPS}")], capfd)
    assert result.returncode == 0, result.stdout


def wait_for_checkpoint(output: Path, step: int, survivor: Node) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (output / f"checkpoint-{step}" / "COMPLETE").exists():
        assert time.monotonic() < deadline and survivor.process.poll() is None, survivor.output()[-3000:]
        time.sleep(0.02)


def kill_and_relaunch(cluster: Cluster, config: Path, port: int, output: Path, nodes: list[Node], victim: int,
                      step: int) -> Node:
    """Node `victim` killed with kill -9 (agent and workers) once checkpoint-`step` is published, then relaunched
    alone with the same command, as an operator would. The other node must still run 3 s after the kill. Returns
    the relaunched node (nodes[victim] becomes it)."""
    survivor = nodes[1 - victim]
    wait_for_checkpoint(output, step, survivor)
    nodes[victim].kill()
    assert not (output / "final").exists(), "the job ended before the kill: nothing was tested"
    still_running_until = time.monotonic() + 3
    while time.monotonic() < still_running_until:  # what is checked is a duration: alive for 3 s after the kill
        assert survivor.process.poll() is None, survivor.output()[-3000:]
        time.sleep(0.05)
    nodes[victim] = cluster.start(victim, config, port)
    return nodes[victim]


def end_as_the_baseline(nodes: list[Node], output: Path, reference: dict) -> None:
    for node in nodes:
        assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
    assert losses(output) == reference["losses"]
    assert final_hash(output) == reference["hash"]


@pytest.fixture(scope="module")
def nodes_killed_in_turn(tmp_path_factory, baseline, side_jobs, tiny_model_dir, tiny_dataset):
    """One job that loses each node in turn and gets it back by a relaunch: node 1 after checkpoint-8, then node
    0 (which hosts the rendezvous store) after checkpoint-12. Each node's output, by start, and the port.
    Alongside it, a lone node 0 waits out its rendezvous timeout (a node that never joins), and the job runs
    uninterrupted across two network namespaces (two hosts)."""
    reference = baseline(1)
    side_jobs.start("never joins", lambda: never_joining_node(tmp_path_factory, tiny_model_dir, tiny_dataset))
    side_jobs.start("two hosts", lambda: two_hosts_job(tmp_path_factory, tiny_model_dir, tiny_dataset))
    root = tmp_path_factory.mktemp("killed-in-turn")
    output = root / "output"
    config = job_config(root / "cfg", tiny_model_dir, tiny_dataset, output)
    c = Cluster(root)
    try:
        port = free_port()
        nodes = c.start_job(config, port)
        kill_and_relaunch(c, config, port, output, nodes, victim=1, step=8)
        kill_and_relaunch(c, config, port, output, nodes, victim=0, step=12)
        end_as_the_baseline(nodes, output, reference)
        return {"port": port, "output": output, "texts": [node.output() for node in c.nodes]}
    finally:
        c.cleanup()
        side_jobs.wait("never joins", "two hosts")


def test_killed_node_1_relaunched_rejoins_and_the_job_ends_as_if_nothing_happened(nodes_killed_in_turn):
    """(The job ended as the uninterrupted run did: nodes_killed_in_turn checks its losses and weights.)"""
    node0, node1, relaunched_1, _ = nodes_killed_in_turn["texts"]
    checkpoint = nodes_killed_in_turn["output"] / "checkpoint-8"
    assert f"resumed from {checkpoint} at step 8" in node0 + relaunched_1, (node0 + relaunched_1)[-4000:]


def test_killed_node_0_relaunched_alone_rejoins_the_survivors_and_the_job_ends_as_if_nothing_happened(
        nodes_killed_in_turn):
    """Node 0 hosts the rendezvous store: with it gone, node 1's launcher waits for it to come back and rejoins."""
    _, _, survivor, relaunched_0 = nodes_killed_in_turn["texts"]
    port, checkpoint = nodes_killed_in_turn["port"], nodes_killed_in_turn["output"] / "checkpoint-12"
    assert f"lost the rendezvous store at 127.0.0.1:{port}" in survivor, survivor[-4000:]
    assert "training failed" not in survivor, survivor[-4000:]
    assert f"resumed from {checkpoint} at step 12" in survivor + relaunched_0, (survivor + relaunched_0)[-4000:]


@pytest.mark.alone
def test_stopped_rank_is_caught_by_the_hang_watchdog_and_the_job_recovers_by_itself_while_a_straggler_is_named(
        cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset):
    """Rank 3 sleeps after every step (a straggler); rank 1 stops itself with SIGSTOP after step 9 (a hung process).
    The other ranks report their stacks within the hang timeout, the summary names rank 1 as silent, they exit, and
    torchrun restarts every worker from checkpoint-8: the job ends with the uninterrupted run's weights."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, per_node=2, hang_timeout=8,
                        straggler_threshold=0.5, straggler_intervals=2)
    nodes = cluster.run(config, env={"MESHTUNE_FAULT": "slow:0.4:3,stop:9:1"}, per_node=2)
    text = nodes[0].output() + nodes[1].output()
    hangs = list(output.glob("hang-*"))
    assert len(hangs) == 1, text[-4000:]
    reports = sorted(p.name for p in hangs[0].glob("rank*.txt"))
    assert reports == ["rank0.txt", "rank2.txt", "rank3.txt"], reports
    assert "Python stacks of every thread" in (hangs[0] / "rank0.txt").read_text()
    assert "summing the step's loss" in (hangs[0] / "rank0.txt").read_text()
    assert "flight recorder" in (hangs[0] / "rank0.txt").read_text()
    summary = (hangs[0] / "summary.txt").read_text()
    assert "another collective" not in summary
    assert "rank 1 (node 0, host" in summary and "did not report" in summary, summary
    assert "rank 1 (node 0" in text and "resumed from" in text, text[-4000:]
    assert "killing rank 1 (pid" in text, text[-4000:]  # its node's reporting rank ended it: no 30 s SIGTERM wait
    assert final_hash(output) == baseline(2)["hash"]
    records = read_metrics(output)
    assert [r["slowest_rank"] for r in records[2:]] == [3] * (STEPS - 2), records
    # by how much is timing: an interval around the restart also holds every rank's slow first step
    assert all(r["slowest_node"] == 1 and r["slowest_over_median"] > 0 for r in records[2:]), records
    assert statistics.median(r["slowest_over_median"] for r in records[2:]) > 0.5, records
    assert "warning: rank 3 (node 1, host" in text and "straggler" in text, text[-4000:]


@pytest.fixture
def etcd_server(tmp_path):
    """Debian's etcd (package etcd-server) on free loopback ports, v2 API on, for torchrun's etcd-v2 rendezvous."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd server here (Debian: apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd is not installed (pip install 'meshtune[etcd]')")
    client, peer = free_port(), free_port()
    log = (tmp_path / "etcd.log").open("w")
    process = subprocess.Popen(["etcd", "--data-dir", str(tmp_path / "etcd"), "--enable-v2=true",
                                "--listen-client-urls", f"http://127.0.0.1:{client}",
                                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()
                time.sleep(0.2)
        yield f"127.0.0.1:{client}"
    finally:
        kill_tree(process.pid)
        log.close()


def test_with_an_etcd_rendezvous_a_killed_node_0_relaunched_alone_completes_recovery(
        cluster, tmp_path, etcd_server, baseline, side_jobs, tmp_path_factory, tiny_model_dir, tiny_dataset):
    """The rendezvous outlives node 0 in etcd: node 1's torchrun restarts its workers into a new round, which the
    relaunched node 0 joins, as after any other node's death. With two nodes of differing configs alongside (a side
    job)."""
    side_jobs.start("another config", lambda: node_with_another_config(tmp_path_factory, tiny_model_dir,
                                                                       tiny_dataset))
    try:
        output = tmp_path / "output"
        config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, rdzv_backend="etcd-v2",
                            rdzv_endpoint=etcd_server)
        port = free_port()
        nodes = cluster.start_job(config, port, store_on_port=False)
        kill_and_relaunch(cluster, config, port, output, nodes, victim=0, step=8)
        end_as_the_baseline(nodes, output, baseline(1))
        assert "resumed from" in "".join(node.output() for node in cluster.nodes)
    finally:
        side_jobs.wait("another config")


def test_rank_killed_while_saving_never_publishes_that_checkpoint(cluster, tmp_path, baseline, side_jobs,
                                                                  tmp_path_factory, tiny_model_dir, tiny_dataset):
    """Rank 1 (node 1's) killed once it wrote its shards of checkpoint-8. With the resumes from a flipped byte and
    on another world size alongside (side jobs)."""
    side_jobs.start("flipped byte", lambda: flipped_byte_resume(tmp_path_factory, baseline(1), tiny_model_dir,
                                                                tiny_dataset))
    side_jobs.start("world size", lambda: resume_on_another_world_size(tmp_path_factory, baseline(2),
                                                                       tiny_model_dir, tiny_dataset))
    try:
        output = tmp_path / "output"
        config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
        nodes = cluster.run(config, env={"MESHTUNE_FAULT": "save:8:1"})
    finally:
        side_jobs.wait("flipped byte", "world size")
    text = nodes[0].output() + nodes[1].output()
    assert "fault injection: killing rank 1 at save of step 8" in text
    assert "checkpoint-4 at step 4" in text and "checkpoint-8 at step 8" not in text
    assert losses(output) == baseline(1)["losses"]
    assert final_hash(output) == baseline(1)["hash"]


def flipped_byte_resume(tmp_path_factory, baseline: dict, model_dir: Path, dataset: Path) -> dict:
    """The baseline's output with one byte of rank 1's shard of its last checkpoint flipped (a copy of that
    checkpoint kept aside for `ckpt verify`), then the 2-node job on the output."""
    root = tmp_path_factory.mktemp("flipped-byte")
    output = root / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    shard = output / f"checkpoint-{STEPS}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    flipped = shutil.copytree(shard.parent, root / "as-flipped" / shard.parent.name)
    config = job_config(root / "cfg", model_dir, dataset, output)
    c = Cluster(root)
    try:
        nodes = c.run(config)
        return {"flipped": flipped, "text": nodes[0].output() + nodes[1].output(), "output": output}
    finally:
        c.cleanup()


def test_flipped_byte_fails_verify_and_resume_falls_back(side_jobs, tmp_path_factory, baseline, tiny_model_dir,
                                                         tiny_dataset, capfd):
    run = side_jobs.result("flipped byte", lambda: flipped_byte_resume(tmp_path_factory, baseline(1),
                                                                       tiny_model_dir, tiny_dataset))
    verify = run_cli_here(["ckpt", "verify", str(run["flipped"])], capfd)
    assert verify.returncode == 1 and "__1_0.distcp" in verify.stdout, verify.stdout
    text, output = run["text"], run["output"]
    assert f"warning: not resuming from checkpoint-{STEPS}" in text and "__1_0.distcp" in text
    assert f"checkpoint-{STEPS - SAVE_EVERY} at step {STEPS - SAVE_EVERY}" in text
    assert losses(output) == baseline(1)["losses"]
    assert final_hash(output) == baseline(1)["hash"]


def resume_on_another_world_size(tmp_path_factory, baseline: dict, model_dir: Path, dataset: Path) -> dict:
    """The output of the run on 2 x 2 up to checkpoint-12, resumed by one node of 2 processes (the ranks torchrun
    would start there: what is tested is the resume, not the launch)."""
    root = tmp_path_factory.mktemp("world-size")
    output = root / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    for step in range(16, STEPS + 1, SAVE_EVERY):
        shutil.rmtree(output / f"checkpoint-{step}")
    config = job_config(root / "cfg", model_dir, dataset, output, per_node=2, nproc_per_node=2)
    return {"result": run_meshtune_ranks(["train", str(config)], 2, root / "ranks", timeout=JOB_TIMEOUT,
                                         env={"OMP_NUM_THREADS": "1"}), "output": output}


def test_resume_on_another_world_size_keeps_the_losses(side_jobs, tmp_path_factory, baseline, tiny_model_dir,
                                                        tiny_dataset):
    """Saved by 4 processes (2 replicas x 2 shards), resumed on 1 node x 2 (accumulation 1 -> 2 keeps the global
    batch)."""
    run = side_jobs.result("world size", lambda: resume_on_another_world_size(tmp_path_factory, baseline(2),
                                                                              tiny_model_dir, tiny_dataset))
    result, output = run["result"], run["output"]
    assert result.returncode == 0, result.stdout[-4000:]
    assert "gradient_accumulation_steps 1 -> 2" in result.stdout and "checkpoint-12 at step 12" in result.stdout
    got, reference = losses(output), baseline(2)["losses"]
    assert got[:12] == reference[:12]
    for step, (a, b) in enumerate(zip(got[12:], reference[12:]), start=13):
        assert abs(a - b) / abs(b) < 1e-4, f"step {step}: {a} vs {b}"


def test_unreachable_master_fails_within_the_timeout_and_says_why(cluster, tmp_path, tiny_model_dir, tiny_dataset):
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, tmp_path / "output", rdzv_timeout=5)
    port = free_port()  # nobody listens there: a wrong MASTER_PORT, or node 0 never started
    started = time.monotonic()
    node1 = cluster.start(1, config, port)
    assert node1.wait(120) != 0
    text = node1.output()
    assert f"node 1 could not reach the rendezvous at 127.0.0.1:{port} within rdzv_timeout=5 s" in text
    assert "firewall" in text and "NODE_RANK" in text and "a MASTER_PORT that differs between nodes" in text
    assert time.monotonic() - started < 60


def never_joining_node(tmp_path_factory, model_dir: Path, dataset: Path) -> dict:
    """Node 0 of 2 alone (preflight: false), its output and how long it ran."""
    root = tmp_path_factory.mktemp("never-joins")
    # 40 s: the launcher says who joined every 15 s, and beside another job on 2 busy cores its first connect to the
    # store can take one 5 s timeout or more
    config = job_config(root / "cfg", model_dir, dataset, root / "output", rdzv_timeout=40, preflight=False)
    c = Cluster(root)
    try:
        started = time.monotonic()
        node0 = c.start(0, config, free_port())  # node 1 never comes
        code = node0.wait(240)
        return {"code": code, "text": node0.output(), "seconds": time.monotonic() - started}
    finally:
        c.cleanup()


def test_node_that_never_joins_is_named_while_waiting_and_in_the_error(side_jobs, tmp_path_factory,
                                                                       tiny_model_dir, tiny_dataset):
    """torchrun's rendezvous diagnosis, as without the preflight (preflight: false; test_doctor has the
    preflight's own). Runs alongside the job whose nodes are killed in turn (a side job)."""
    run = side_jobs.result("never joins", lambda: never_joining_node(tmp_path_factory, tiny_model_dir, tiny_dataset))
    text = run["text"]
    assert run["code"] == 1, text[-3000:]
    assert "rendezvous: 1 of 2 nodes joined (node ranks 0); waiting for node ranks 1" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "did not complete within rdzv_timeout=40 s" in last and "never joined: node ranks 1" in last, last
    assert run["seconds"] < 200  # rdzv_timeout 40 s, beside another job's four processes on 2 busy cores


def node_with_another_config(tmp_path_factory, model_dir: Path, dataset: Path) -> dict:
    """Node 1 given another learning_rate than node 0: both nodes' exit codes and output, and whether the job
    trained to its first checkpoint."""
    root = tmp_path_factory.mktemp("another-config")
    output = root / "output"
    config = job_config(root / "cfg", model_dir, dataset, output)
    port = free_port()
    c = Cluster(root)
    try:
        node0 = c.start(0, config, port)
        wait_for_port(port, node0.process, timeout=JOB_TIMEOUT)
        node1 = c.start(1, config, port, overrides=["learning_rate=3e-3"])
        codes = [node0.wait(120), node1.wait(120)]
        return {"codes": codes, "text": node0.output() + node1.output(),
                "trained": (output / "checkpoint-4").exists()}
    finally:
        c.cleanup()


def test_node_with_another_config_aborts_naming_it(side_jobs, tmp_path_factory, tiny_model_dir, tiny_dataset):
    """Runs alongside the etcd rendezvous job (a side job)."""
    run = side_jobs.result("another config", lambda: node_with_another_config(tmp_path_factory, tiny_model_dir,
                                                                              tiny_dataset))
    codes, text = run["codes"], run["text"]
    assert codes[0] != 0 and codes[1] != 0
    assert "config key learning_rate differs between nodes" in text and "node 1 (" in text and "node 0 (" in text
    assert not run["trained"], "it trained before noticing"


def wait_for_step(output: Path, step: int, nodes: list[Node], timeout: float = JOB_TIMEOUT) -> float:
    """When metrics.jsonl first held `step` steps (monotonic time); every node must run until then."""
    deadline = time.monotonic() + timeout
    while not ((output / "metrics.jsonl").exists() and len(read_metrics(output)) >= step):
        for node in nodes:
            assert node.process.poll() is None, node.output()[-3000:]
        assert time.monotonic() < deadline, "the job never reached the step"
        time.sleep(0.05)
    return time.monotonic()


def published_after(output: Path, periodic: int, nodes: list[Node], timeout: float = 30) -> tuple[int, float]:
    """The checkpoint written on a stop (the first complete one past `periodic`) and when it appeared."""
    deadline = time.monotonic() + timeout
    while True:
        found = [int(p.parent.name.split("-")[1]) for p in output.glob("checkpoint-*/COMPLETE")
                 if not p.parent.name.endswith(".tmp")]
        if any(step > periodic for step in found):
            return max(found), time.monotonic()
        assert time.monotonic() < deadline, [node.output()[-2000:] for node in nodes]
        time.sleep(0.02)


EXIT_AFTER_SAVE_S = 8  # a worker's exit (~1 s), the launchers learning that every node's workers are done (~1 s),
# torchrun's grace (1 s): a few seconds on 2 busy cores; before, 13-15 s went to torchrun's exit barrier and the
# interpreters' teardown


@pytest.mark.alone
def test_sigterm_to_node_0s_launcher_saves_ends_every_node_within_seconds_and_a_relaunch_resumes_exactly(
        cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset, untimed_from_here):
    """Kubernetes signals only the container's first process: node 0's meshtune launcher. Signalled after step 5
    (save_steps 4), every node writes a checkpoint between the periodic ones (the ranks' stop vote is read a step
    late, so checkpoint-6 or -7) and exits 143 (128 + SIGTERM) within seconds of it; relaunched, the job resumes
    there and ends with the uninterrupted run's weights. (Every process of node 1 signalled, as SLURM does:
    test_node_exits.py.)"""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    nodes = cluster.start_job(config, free_port(), env={"MESHTUNE_FAULT": "slow:0.3"})
    wait_for_step(output, 5, nodes)
    signalled = time.monotonic()
    nodes[0].process.send_signal(signal.SIGTERM)
    saved, published = published_after(output, SAVE_EVERY, nodes)
    codes = [node.wait(60) for node in nodes]
    text = nodes[0].output() + nodes[1].output()
    assert codes == [143, 143], text[-4000:]
    assert time.monotonic() - published < EXIT_AFTER_SAVE_S, [node.output()[-2000:] for node in nodes]
    assert time.monotonic() - signalled < 30
    assert saved in (6, 7), f"checkpoint-{saved}: no checkpoint written on SIGTERM"
    assert f"SIGTERM received: stopping after step {saved} of {STEPS}; writing checkpoint-{saved}" in text
    assert "run the same command again to resume" in nodes[0].output().strip().splitlines()[-1], text[-4000:]
    assert not (output / "final").exists()
    untimed_from_here()  # the relaunch and its comparison beside other tests
    cluster.run(config)
    text = "".join(node.output() for node in cluster.nodes[-2:])
    assert f"resumed from {output / f'checkpoint-{saved}'} at step {saved}" in text
    assert losses(output) == baseline(1)["losses"]
    assert final_hash(output) == baseline(1)["hash"]


def two_hosts_job(tmp_path_factory, model_dir: Path, dataset: Path) -> dict:
    """The job, uninterrupted, across a real (virtual) network: each node in its own namespace, talking over the
    veth pair; local_addr and GLOO_SOCKET_IFNAME pick the network. {"skip": why} where namespaces cannot be
    made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return {"skip": "network namespaces need root and iproute2 (ip); the 127.0.0.1 cluster tests cover the rest"}
    spaces = NetworkNamespaces()
    try:
        try:
            spaces.create()
        except subprocess.CalledProcessError as exc:
            return {"skip": f"cannot create network namespaces here: {exc.stderr.decode().strip()}"}
        root = tmp_path_factory.mktemp("two-hosts")
        output = root / "output"
        config = job_config(root / "cfg", model_dir, dataset, output)
        port = free_port()
        c = Cluster(root)
        try:
            nodes = []
            for rank, (name, link, address) in enumerate(zip(spaces.names, spaces.links, spaces.addresses)):
                nodes.append(c.start(rank, config, port, prefix=["ip", "netns", "exec", name],
                                     master=spaces.addresses[0], overrides=[f"local_addr={address}"],
                                     env={"GLOO_SOCKET_IFNAME": link}))
                if rank == 0:  # node 0 hosts the rendezvous store
                    wait_for_port(port, nodes[0].process, spaces.addresses[0], JOB_TIMEOUT,
                                  prefix=["ip", "netns", "exec", name])
            for node in nodes:
                assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
            return {"node0": nodes[0].output(), "output": output}
        finally:
            c.cleanup()
    finally:
        spaces.delete()


def test_two_hosts_with_their_own_addresses_train_like_the_baseline(side_jobs, tmp_path_factory, baseline,
                                                                    tiny_model_dir, tiny_dataset):
    """The job across a real (virtual) network, as on a cluster whose hostname resolves elsewhere: two launchers,
    two agents and their workers give the uninterrupted run's losses and weights. Runs alongside the job whose
    nodes are killed in turn (a side job)."""
    run = side_jobs.result("two hosts", lambda: two_hosts_job(tmp_path_factory, tiny_model_dir, tiny_dataset))
    if "skip" in run:
        pytest.skip(run["skip"])
    # the doctor's checks ran first, between the two addresses, and found nothing to report
    assert "preflight: 2 nodes, all checks passed" in run["node0"], run["node0"][-4000:]
    assert losses(run["output"]) == baseline(1)["losses"]
    assert final_hash(run["output"]) == baseline(1)["hash"]


@pytest.fixture(scope="module")
def job_into_a_bucket(tmp_path_factory, baseline, tiny_model_dir, tiny_dataset):
    """The job of 2 nodes x 2 processes with checkpoint_dir in s3:// on a local S3 server (moto): node 1 killed
    once checkpoint-4 is sealed in the bucket, as a spot node is reclaimed, and node 0 with it (the job is ended);
    then the job launched again on fresh nodes: new output folders (node 1's its own, not shared), a new tokenized
    cache, only the URL in common with the first."""
    from s3_server import S3Server, client

    root = tmp_path_factory.mktemp("s3-job")
    server = S3Server(root / "moto.log")
    c = Cluster(root)
    try:
        server.make_bucket("meshtune-job")
        url, bucket = "s3://meshtune-job/run", client(server)
        first = job_config(root / "cfg-first", tiny_model_dir, tiny_dataset, root / "first", per_node=2,
                           checkpoint_dir=url)
        nodes = c.start_job(first, free_port(), env=server.env, per_node=2)
        deadline = time.monotonic() + JOB_TIMEOUT
        while not bucket.exists("meshtune-job/run/checkpoint-4/COMPLETE"):
            assert time.monotonic() < deadline and nodes[0].process.poll() is None, nodes[0].output()[-3000:]
            time.sleep(0.05)
        for node in reversed(nodes):
            node.kill()
        assert not bucket.exists("meshtune-job/run/final/COMPLETE"), "the job ended before the kill"
        sealed = {name.rsplit("/", 2)[-2]: json.loads(bucket.cat_file(name.replace("COMPLETE", "manifest.json")))
                  for name in bucket.glob("meshtune-job/run/checkpoint-*/COMPLETE")}  # the manifests a resume reads
        fresh = root / "fresh"
        again = job_config(root / "cfg-again", tiny_model_dir, tiny_dataset, fresh / "node0", per_node=2,
                           checkpoint_dir=url, tokenized_path=str(fresh / "tokenized"))
        port, reads_before = free_port(), server.object_reads("meshtune-job/run")
        relaunched = [c.start(0, again, port, env=server.env, per_node=2)]
        wait_for_port(port, relaunched[0].process, timeout=JOB_TIMEOUT)
        relaunched.append(c.start(1, again, port, env=server.env, per_node=2,
                                  overrides=[f"output_dir={fresh / 'node1'}"]))
        for node in relaunched:
            assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
        return {"url": url, "reads": server.object_reads("meshtune-job/run") - reads_before, "sealed": sealed,
                "copies": sorted(str(p) for p in fresh.rglob(".resume-copy/*/*")),
                "texts": [node.output() for node in relaunched], "losses": losses(fresh / "node0"),
                "final": hashlib.sha256(bucket.cat_file("meshtune-job/run/final/model.safetensors")).hexdigest(),
                "objects": bucket.ls("meshtune-job/run", detail=False), "reference": baseline(2)}
    finally:
        c.cleanup()
        server.stop()


def test_nodes_lost_after_checkpoint_4_in_a_bucket_resume_on_fresh_nodes_from_the_url_alone(job_into_a_bucket):
    run = job_into_a_bucket
    node0 = run["texts"][0]
    resumed = re.search(rf"resumed from {re.escape(run['url'])}/checkpoint-(\d+) at step (\d+)", node0)
    assert resumed and int(resumed.group(1)) >= 4, node0[-4000:]
    step = int(resumed.group(1))
    assert run["losses"] == run["reference"]["losses"][step:]  # bit for bit, from the resumed step on
    assert run["final"] == run["reference"]["hash"]  # the final weights, as sealed in the bucket
    assert "final" in {name.rsplit("/", 1)[-1] for name in run["objects"]}
    # each node read every object of the checkpoint once: fetched, checked and loaded from its copy, then deleted
    listed = run["sealed"][f"checkpoint-{step}"]["files"]
    reads = {name: run["reads"][f"checkpoint-{step}/{name}"] for name in listed}
    assert reads == dict.fromkeys(listed, 2), run["reads"]
    assert not run["copies"]
