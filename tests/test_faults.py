"""Fault injection on a simulated cluster: 2 nodes x 2 processes, i.e. two torchrun agents (each started by
`meshtune train`, as a user would on each node) meeting on 127.0.0.1, training under hsdp (2 replicas x 2 shards).

On CPU/gloo with one thread per process the runs are bit-exact, so "resumes exactly" is checked with ==: the
losses after a recovery and the sha256 of the final weights equal the uninterrupted run's.

The tests share that uninterrupted run (the module-scoped `baseline`) and jobs started beside it or beside a later
test (`SideJobs`). Only file order, pytest's own, puts a side job's start before the test that reads its result, and
that is for speed: each such test runs its job itself when run alone.
"""

from __future__ import annotations

import hashlib
import os
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

from conftest import base_config, kill_tree, read_metrics, run_cli, run_cli_here, write_config
from ranks import free_port

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 24, 4
JOB_TIMEOUT = 240


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
def baseline(tmp_path_factory, tiny_model_dir, tiny_dataset, side_jobs):
    """An uninterrupted 2-node run: the losses of every step and the hash of the final weights. Alongside it, a
    lone node 0 waits out its rendezvous timeout (a node that never joins), and the same job runs across two network
    namespaces (two hosts)."""
    side_jobs.start("never joins", lambda: never_joining_node(tmp_path_factory, tiny_model_dir, tiny_dataset))
    side_jobs.start("two hosts", lambda: two_hosts_job(tmp_path_factory, tiny_model_dir, tiny_dataset))
    root = tmp_path_factory.mktemp("baseline")
    output = root / "output"
    config = job_config(root / "cfg", tiny_model_dir, tiny_dataset, output)
    c = Cluster(root)
    try:
        nodes = c.run(config)
    finally:
        c.cleanup()
        side_jobs.wait("never joins", "two hosts")
    assert "resumed" not in nodes[0].output() + nodes[1].output()
    records = read_metrics(output)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    return {"output": output, "losses": losses(output), "hash": final_hash(output), "root": root}


def test_the_uninterrupted_runs_checkpoints_are_complete_and_verified(baseline, capfd):
    steps = sorted(int(p.name.split("-")[1]) for p in baseline["output"].glob("checkpoint-*"))
    assert steps == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    result = run_cli_here(["ckpt", "verify", str(baseline["output"] / f"checkpoint-{STEPS}")], capfd)
    assert result.returncode == 0, result.stdout


def kill_a_node_and_relaunch_it(cluster: Cluster, config: Path, output: Path, baseline, victim: int) -> tuple[int, str]:
    """Node `victim` killed with kill -9 (agent and workers) after checkpoint-8, then relaunched alone with the
    same command, as an operator would: both nodes end as the uninterrupted run did. Returns the port and the
    survivor's output."""
    port = free_port()
    nodes = [cluster.start(0, config, port)]
    time.sleep(1)
    nodes.append(cluster.start(1, config, port))
    survivor = nodes[1 - victim]
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (output / "checkpoint-8" / "COMPLETE").exists():
        assert time.monotonic() < deadline and survivor.process.poll() is None, survivor.output()[-3000:]
        time.sleep(0.02)
    nodes[victim].kill()
    assert not (output / "final").exists(), "the job ended before the kill: nothing was tested"
    time.sleep(3)
    assert survivor.process.poll() is None, survivor.output()[-3000:]
    nodes[victim] = cluster.start(victim, config, port)
    for node in nodes:
        assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
    assert "resumed from" in nodes[0].output() + nodes[1].output()
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]
    return port, survivor.output()


def test_killed_node_1_relaunched_rejoins_and_the_job_ends_as_if_nothing_happened(cluster, tmp_path, baseline,
                                                                                   tiny_model_dir, tiny_dataset):
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    kill_a_node_and_relaunch_it(cluster, config, output, baseline, victim=1)


def test_killed_node_0_relaunched_alone_rejoins_the_survivors_and_the_job_ends_as_if_nothing_happened(
        cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset):
    """Node 0 hosts the rendezvous store: with it gone, node 1's launcher waits for it to come back and rejoins."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
    port, text = kill_a_node_and_relaunch_it(cluster, config, output, baseline, victim=0)
    assert f"lost the rendezvous store at 127.0.0.1:{port}" in text and "training failed" not in text, text[-4000:]


@pytest.mark.alone
def test_stopped_rank_is_caught_by_the_hang_watchdog_and_the_job_recovers_by_itself_while_a_straggler_is_named(
        cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset):
    """Rank 3 sleeps after every step (a straggler); rank 1 stops itself with SIGSTOP after step 9 (a hung process).
    The other ranks report their stacks within the hang timeout, the summary names rank 1 as silent, they exit, and
    torchrun restarts every worker from checkpoint-8: the job ends with the uninterrupted run's weights."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, hang_timeout=8,
                        straggler_threshold=0.5, straggler_intervals=2)
    nodes = cluster.run(config, env={"MESHTUNE_FAULT": "slow:0.4:3,stop:9:1"})
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
    assert final_hash(output) == baseline["hash"]
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
        cluster, tmp_path, etcd_server, baseline, tiny_model_dir, tiny_dataset):
    """The rendezvous outlives node 0 in etcd: node 1's torchrun restarts its workers into a new round, which the
    relaunched node 0 joins, as after any other node's death."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, rdzv_backend="etcd-v2",
                        rdzv_endpoint=etcd_server)
    kill_a_node_and_relaunch_it(cluster, config, output, baseline, victim=0)


def test_rank_killed_while_saving_never_publishes_that_checkpoint(cluster, tmp_path, baseline, side_jobs,
                                                                  tmp_path_factory, tiny_model_dir, tiny_dataset):
    """With the resumes from a flipped byte and on another world size alongside (side jobs)."""
    side_jobs.start("flipped byte", lambda: flipped_byte_resume(tmp_path_factory, baseline, tiny_model_dir,
                                                                tiny_dataset))
    side_jobs.start("world size", lambda: resume_on_another_world_size(tmp_path_factory, baseline, tiny_model_dir,
                                                                       tiny_dataset))
    try:
        output = tmp_path / "output"
        config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output)
        nodes = cluster.run(config, env={"MESHTUNE_FAULT": "save:8:3"})
    finally:
        side_jobs.wait("flipped byte", "world size")
    text = nodes[0].output() + nodes[1].output()
    assert "fault injection: killing rank 3 at save of step 8" in text
    assert "checkpoint-4 at step 4" in text and "checkpoint-8 at step 8" not in text
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


def flipped_byte_resume(tmp_path_factory, baseline, model_dir: Path, dataset: Path) -> dict:
    """The baseline's output with one byte of a shard of its last checkpoint flipped: `ckpt verify` on that
    checkpoint, then the 2-node job on the output."""
    root = tmp_path_factory.mktemp("flipped-byte")
    output = root / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    shard = output / f"checkpoint-{STEPS}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    verify, _ = run_cli(["ckpt", "verify", str(shard.parent)], timeout=60)
    config = job_config(root / "cfg", model_dir, dataset, output)
    c = Cluster(root)
    try:
        if verify.returncode != 1:  # the job would resume from the corrupt checkpoint: nothing more to learn
            return {"verify": verify}
        nodes = c.run(config)
        return {"verify": verify, "text": nodes[0].output() + nodes[1].output(), "output": output}
    finally:
        c.cleanup()


def test_flipped_byte_fails_verify_and_resume_falls_back(side_jobs, tmp_path_factory, baseline, tiny_model_dir,
                                                         tiny_dataset):
    run = side_jobs.result("flipped byte", lambda: flipped_byte_resume(tmp_path_factory, baseline, tiny_model_dir,
                                                                       tiny_dataset))
    assert run["verify"].returncode == 1 and "__1_0.distcp" in run["verify"].stdout, run["verify"].stdout
    text, output = run["text"], run["output"]
    assert f"warning: not resuming from checkpoint-{STEPS}" in text and "__1_0.distcp" in text
    assert f"checkpoint-{STEPS - SAVE_EVERY} at step {STEPS - SAVE_EVERY}" in text
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


def resume_on_another_world_size(tmp_path_factory, baseline, model_dir: Path, dataset: Path) -> dict:
    """The baseline's output up to checkpoint-12, resumed by one node of 2 processes."""
    root = tmp_path_factory.mktemp("world-size")
    output = root / "output"
    shutil.copytree(baseline["output"], output)
    shutil.rmtree(output / "final")
    for step in range(16, STEPS + 1, SAVE_EVERY):
        shutil.rmtree(output / f"checkpoint-{step}")
    config = job_config(root / "cfg", model_dir, dataset, output, nproc_per_node=2)
    result, _ = run_cli(["train", str(config)], timeout=JOB_TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    return {"result": result, "output": output}


def test_resume_on_another_world_size_keeps_the_losses(side_jobs, tmp_path_factory, baseline, tiny_model_dir,
                                                        tiny_dataset):
    """Saved by 2 nodes x 2 processes, resumed on 1 node x 2 (accumulation 1 -> 2 keeps the global batch)."""
    run = side_jobs.result("world size", lambda: resume_on_another_world_size(tmp_path_factory, baseline,
                                                                              tiny_model_dir, tiny_dataset))
    result, output = run["result"], run["output"]
    assert result.returncode == 0, result.stdout[-4000:]
    assert "gradient_accumulation_steps 1 -> 2" in result.stdout and "checkpoint-12 at step 12" in result.stdout
    got = losses(output)
    assert got[:12] == baseline["losses"][:12]
    for step, (a, b) in enumerate(zip(got[12:], baseline["losses"][12:]), start=13):
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
    config = job_config(root / "cfg", model_dir, dataset, root / "output", rdzv_timeout=20, preflight=False)
    c = Cluster(root)
    try:
        started = time.monotonic()
        node0 = c.start(0, config, free_port())  # node 1 never comes
        code = node0.wait(120)
        return {"code": code, "text": node0.output(), "seconds": time.monotonic() - started}
    finally:
        c.cleanup()


def test_node_that_never_joins_is_named_while_waiting_and_in_the_error(side_jobs, tmp_path_factory,
                                                                       tiny_model_dir, tiny_dataset):
    """torchrun's rendezvous diagnosis, as without the preflight (preflight: false; test_doctor has the
    preflight's own). Runs alongside the uninterrupted run (a side job)."""
    run = side_jobs.result("never joins", lambda: never_joining_node(tmp_path_factory, tiny_model_dir, tiny_dataset))
    text = run["text"]
    assert run["code"] == 1, text[-3000:]
    assert "rendezvous: 1 of 2 nodes joined (node ranks 0); waiting for node ranks 1" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "did not complete within rdzv_timeout=20 s" in last and "never joined: node ranks 1" in last, last
    assert run["seconds"] < 80


def test_node_with_another_config_aborts_naming_it(cluster, tmp_path, tiny_model_dir, tiny_dataset):
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


def wait_for_step(output: Path, step: int, nodes: list[Node], timeout: float = JOB_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not ((output / "metrics.jsonl").exists() and len(read_metrics(output)) >= step):
        for node in nodes:
            assert node.process.poll() is None, node.output()[-3000:]
        assert time.monotonic() < deadline, "the job never reached the step"
        time.sleep(0.05)


def stop_and_resume(cluster: Cluster, tmp_path: Path, baseline, model_dir: Path, dataset: Path, signal_node,
                    relaunch: bool = True) -> None:
    """A job signalled after step 5 of 24 (save_steps 4) by `signal_node(nodes)`: every node exits 143 (128 +
    SIGTERM) after writing a checkpoint between the periodic ones (the ranks' stop vote is read a step late, so
    checkpoint-6 or -7); relaunched, it resumes there and ends with the uninterrupted run's weights."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", model_dir, dataset, output)
    port = free_port()
    nodes = [cluster.start(0, config, port, env={"MESHTUNE_FAULT": "slow:0.3"})]
    time.sleep(1)
    nodes.append(cluster.start(1, config, port, env={"MESHTUNE_FAULT": "slow:0.3"}))
    wait_for_step(output, 5, nodes)
    signalled = time.monotonic()
    signal_node(nodes)
    codes = [node.wait(60) for node in nodes]
    text = nodes[0].output() + nodes[1].output()
    assert codes == [143, 143], text[-4000:]
    assert time.monotonic() - signalled < 30
    saved = max(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*") if (p / "COMPLETE").exists())
    assert saved in (6, 7), f"checkpoint-{saved}: no checkpoint written on SIGTERM"
    assert f"SIGTERM received: stopping after step {saved} of {STEPS}; writing checkpoint-{saved}" in text
    assert "run the same command again to resume" in text and not (output / "final").exists()
    if not relaunch:
        return
    cluster.run(config)
    text = "".join(node.output() for node in cluster.nodes[-2:])
    assert f"resumed from {output / f'checkpoint-{saved}'} at step {saved}" in text
    assert losses(output) == baseline["losses"]
    assert final_hash(output) == baseline["hash"]


@pytest.mark.alone
def test_sigterm_to_node_0s_launcher_saves_and_a_relaunch_resumes_exactly(cluster, tmp_path, baseline,
                                                                          tiny_model_dir, tiny_dataset):
    """Kubernetes signals only the container's first process: node 0's meshtune launcher."""
    stop_and_resume(cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset,
                    lambda nodes: nodes[0].process.send_signal(signal.SIGTERM))


@pytest.mark.alone
def test_sigterm_to_every_process_of_node_1_stops_both_nodes_after_a_checkpoint(cluster, tmp_path, baseline,
                                                                                tiny_model_dir, tiny_dataset):
    """SLURM signals every process of the job step: launcher, torchrun and workers of node 1 at once. (The
    relaunch from the checkpoint written is the same as after node 0's SIGTERM, whose test checks it.)"""
    stop_and_resume(cluster, tmp_path, baseline, tiny_model_dir, tiny_dataset,
                    lambda nodes: kill_tree(nodes[1].process.pid, signal.SIGTERM), relaunch=False)


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


def two_hosts_job(tmp_path_factory, model_dir: Path, dataset: Path) -> dict:
    """The baseline's job across a real (virtual) network: each node in its own namespace, talking over the veth
    pair; local_addr and GLOO_SOCKET_IFNAME pick the network. {"skip": why} where namespaces cannot be made."""
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
                time.sleep(1)
            for node in nodes:
                assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
            return {"node0": nodes[0].output(), "output": output}
        finally:
            c.cleanup()
    finally:
        spaces.delete()


def test_two_hosts_with_their_own_addresses_train_like_the_baseline(side_jobs, tmp_path_factory, baseline,
                                                                    tiny_model_dir, tiny_dataset):
    """The same job across a real (virtual) network, as on a cluster whose hostname resolves elsewhere. Runs
    alongside the baseline (a side job)."""
    run = side_jobs.result("two hosts", lambda: two_hosts_job(tmp_path_factory, tiny_model_dir, tiny_dataset))
    if "skip" in run:
        pytest.skip(run["skip"])
    # the doctor's checks ran first, between the two addresses, and found nothing to report
    assert "preflight: 2 nodes, all checks passed" in run["node0"], run["node0"][-4000:]
    assert losses(run["output"]) == baseline["losses"]
    assert final_hash(run["output"]) == baseline["hash"]
