"""Misconfigured nodes named as what they are, on every node, within seconds: launchers (`meshtune train`) on
127.0.0.1 given a second NODE_RANK 0, another MASTER_PORT, another NNODES, a MASTER_PORT another program holds,
a MASTER_ADDR that does not resolve; and a job relaunched on a new port right after a crash goes on as one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import base_config, kill_tree, read_metrics, write_config
from meshtune.doctor.reachability import RendezvousError, ask_store, check_port_free
from meshtune.launch.nodes import NodeSettings
from meshtune.launch.output_lock import LOCK
from ranks import free_port
from test_launch import clean_env

NAMED_WITHIN_S = 30  # what a node may take to name a misconfiguration once both are there


class Launcher:
    """`meshtune train cfg.yaml` as one node: its environment on top of a two-node job's, output in a log."""

    def __init__(self, directory: Path, name: str, config: Path, port: int, **env: str):
        self.log = directory / f"{name}.log"
        environ = clean_env(**{"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", **env})
        with self.log.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(config)], env=environ,
                                            stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.process.pid)
            pytest.fail(f"{self.log.stem} did not end within {timeout:.0f} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text()

    def last_line(self) -> str:
        return self.output().strip().splitlines()[-1]


@pytest.fixture
def launchers():
    started: list[Launcher] = []
    yield started
    for launcher in started:
        kill_tree(launcher.process.pid)


def wait_until(condition, timeout: float, what: str, launcher: Launcher | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if launcher is not None and launcher.process.poll() is not None:
            pytest.fail(f"{launcher.log.stem} ended before {what}:\n{launcher.output()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def job_config(tmp_path: Path, tiny_model_dir, tiny_dataset, **extra) -> Path:
    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "output", **{
        "max_steps": 2, "save_final": False, "tokenized_path": str(tmp_path / "tokenized"), **extra})
    del values["nproc_per_node"]
    return write_config(tmp_path / "cfg", **values)


def waiting_node_0(tmp_path, launchers, config, port, **env) -> Launcher:
    """Node 0 started and waiting for the others: its lock taken and its store on the port."""
    node0 = Launcher(tmp_path, "node0", config, port, **env)
    launchers.append(node0)
    wait_until(lambda: (tmp_path / "output" / LOCK).exists() and accepts(port), 120, "store of node 0", node0)
    return node0


def test_node_0_stops_at_once_when_master_addr_does_not_resolve(monkeypatch):
    """Looked up on node 0 before anything else; before, it went on, waited rdzv_timeout and blamed the port."""
    def no_such_name(host, *args, **kwargs):
        if host == "nosuchhost.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    settings = NodeSettings(nnodes="2", node_rank=0, master_addr="nosuchhost.invalid", master_port=29500,
                            nproc_per_node=1, run_id="job", source={})
    with pytest.raises(RendezvousError, match="node 0: MASTER_ADDR nosuchhost.invalid does not resolve on this node "
                                              r"\(Name or service not known\); set MASTER_ADDR"):
        check_port_free(settings)


@pytest.mark.slow
def test_a_store_answers_the_probe_and_a_listener_that_is_none_does_not():
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    for fork in (True, False):  # the client forked from this process, and in a fresh Python
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)  # accepts connections (the kernel's backlog) and never says a word
            assert ask_store("127.0.0.1", listener.getsockname()[1], 3, fork=fork) is False
        assert ask_store("127.0.0.1", store.port, 10, fork=fork) is True
        assert ask_store("127.0.0.1", store.port, 10, f"meshtune/job/refused-{fork}", "why", fork=fork) is True
        assert store.get(f"meshtune/job/refused-{fork}") == b"why"


def test_the_store_probe_forks_only_beside_threads_that_never_enter_torch(monkeypatch):
    """A joining node's launcher (or doctor) has torch imported and, beside its main thread, at most the output_dir
    lock's heartbeat: its store probes are forked, with no Python start-up. A fork beside any other thread could
    catch it inside torch, so those probes start a fresh Python."""
    import threading

    import torch.distributed  # noqa: F401 - imported, as in a launcher

    from meshtune.doctor import reachability
    from meshtune.launch.output_lock import HEARTBEAT_THREAD

    main, beat = threading.main_thread(), threading.Thread(name=HEARTBEAT_THREAD)
    monkeypatch.setattr(threading, "enumerate", lambda: [main, beat])
    assert reachability.can_fork_client()
    monkeypatch.setattr(threading, "enumerate", lambda: [main, beat, threading.Thread(name="store-watch")])
    assert not reachability.can_fork_client()


SILENT_CLIENT = "import time; print('ready', flush=True); time.sleep(60)"  # connected, and no answer comes
ENDING_CLIENT = "import os, time; print('ready', flush=True); os.close(1); time.sleep(5)"  # gave up, still exiting


@pytest.mark.slow
def test_the_probe_calls_a_silent_port_foreign_only_while_it_still_accepts(monkeypatch):
    """A store client (here a fresh Python's, whose script is swapped) that got no answer says "another program holds
    the port" only when the port still accepts:
    node 0 killed (or between its stores) mid-probe leaves a client retrying to connect, which is no verdict."""
    from meshtune.doctor import reachability

    monkeypatch.setattr(reachability, "STORE_CLIENT", SILENT_CLIENT)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        assert ask_store("127.0.0.1", port, 0.5, fork=False) is False
    assert ask_store("127.0.0.1", port, 0.5, fork=False) is None  # nothing listens there any more


@pytest.mark.slow
def test_a_client_that_ended_without_an_answer_is_no_verdict_while_it_exits(monkeypatch):
    from meshtune.doctor import reachability

    monkeypatch.setattr(reachability, "STORE_CLIENT", ENDING_CLIENT)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        assert ask_store("127.0.0.1", listener.getsockname()[1], 0.5, fork=False) is None


@pytest.mark.slow
def test_another_program_on_master_port_is_named_on_both_nodes_within_rdzv_timeout(tmp_path, launchers,
                                                                                   tiny_model_dir, tiny_dataset):
    """Before, node 1's store client waited forever on the listener (still waiting at 200 s)."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=30)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        node0 = Launcher(tmp_path, "node0", config, port)
        node1 = Launcher(tmp_path, "node1", config, port, NODE_RANK="1")
        launchers += [node0, node1]
        wait_until(lambda: "waiting for node 0" in node1.output(), 120, "wait for node 0", node1)
        waiting = time.monotonic()
        assert node1.wait(120) == 1 and time.monotonic() - waiting < 30  # within rdzv_timeout
        assert node0.wait(120) == 1
    assert f"port {port} on 127.0.0.1 is already in use" in node0.last_line(), node0.output()[-3000:]
    last = node1.last_line()
    assert (f"node 1: 127.0.0.1:{port} accepts connections but does not answer as a rendezvous store" in last
            and "another program listens on MASTER_PORT" in last), node1.output()[-3000:]
    waited = next(line for line in node1.output().splitlines() if "waiting for node 0" in line)
    assert "rdzv_timeout=30 s" in waited and "TCPStore" not in node1.output().replace("torch's TCPStore", "")


@pytest.mark.slow
def test_a_second_launcher_given_node_rank_0_is_named_on_both(tmp_path, launchers, tiny_model_dir, tiny_dataset):
    """Before, the second took the running node 0's lock over, then failed on the port in use, and the first
    waited out rdzv_timeout for node 1."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=120)
    port = free_port()
    node0 = waiting_node_0(tmp_path, launchers, config, port)
    second = Launcher(tmp_path, "second", config, port)
    launchers.append(second)
    assert second.wait(120) == 1
    told = time.monotonic()
    assert "Two nodes were given NODE_RANK 0" in second.last_line(), second.output()[-3000:]
    assert node0.wait(120) == 1 and time.monotonic() - told < NAMED_WITHIN_S
    last = node0.last_line()
    assert "a second launcher was started as node 0 of this job" in last and "NODE_RANK 0" in last, last
    assert not (tmp_path / "output" / LOCK).exists()


@pytest.mark.slow
def test_two_launchers_given_node_rank_1_are_named_within_seconds(tmp_path, launchers, tiny_model_dir,
                                                                  tiny_dataset):
    """Without the preflight, in torchrun's rendezvous: each launcher counts itself in under its NODE_RANK in node
    0's store, so the launchers of rank 1 see each other. Those whose workers have not started stop, naming the
    rank (and node 0 with them); if the job formed first, it trains on and only the spare stops. Before, the spare
    waited in the rendezvous for a round that never came."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=120, preflight=False)
    port = free_port()
    node0 = waiting_node_0(tmp_path, launchers, config, port)
    twins = [Launcher(tmp_path, f"node1-{n}", config, port, NODE_RANK="1") for n in range(2)]
    launchers += twins
    started = time.monotonic()
    codes = [twin.wait(180) for twin in twins]
    assert 1 in codes, [twin.output()[-2000:] for twin in twins]
    assert time.monotonic() - started < 90  # their start-up on 2 busy cores, then seconds; before, never
    for twin, code in zip(twins, codes):
        if code == 1:
            assert "two launchers were given NODE_RANK 1 of this job" in twin.last_line(), twin.output()[-3000:]
    code0 = node0.wait(180)
    if codes == [1, 1]:  # neither had started its workers: node 0 stops with them, naming the rank
        assert code0 == 1 and "two launchers were given NODE_RANK 1" in node0.last_line(), node0.output()[-3000:]
    else:  # the job formed with one of them, which said so and trained to the end
        assert code0 == 0, node0.output()[-3000:]
        assert "another launcher was given NODE_RANK 1" in twins[codes.index(0)].output()


@pytest.mark.slow
def test_a_node_given_another_master_port_is_named_on_both(tmp_path, launchers, tiny_model_dir, tiny_dataset):
    """Before, node 1 said "in use by another meshtune job" (its run id derives from the port) and node 0 named
    "wrong port, firewall" only after rdzv_timeout."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=120)
    port, other = free_port(), free_port()
    node0 = waiting_node_0(tmp_path, launchers, config, port)
    node1 = Launcher(tmp_path, "node1", config, other, NODE_RANK="1")
    launchers.append(node1)
    assert node1.wait(120) == 1
    told = time.monotonic()
    assert ("MASTER_PORT differs between nodes: node 0 of this job runs on" in node1.last_line()
            and f"MASTER_PORT={port}" in node1.last_line() and f"MASTER_PORT={other} (from env MASTER_PORT)"
            in node1.last_line()), node1.output()[-3000:]
    assert node0.wait(120) == 1 and time.monotonic() - told < NAMED_WITHIN_S
    assert "MASTER_PORT differs between nodes: node 1 (" in node0.last_line(), node0.output()[-3000:]
    assert f"MASTER_PORT={other}, not node 0's {port}" in node0.last_line()


@pytest.mark.slow
@pytest.mark.parametrize("nnodes", [("3", "2"), ("2", "3")], ids=["node-0-expects-more", "node-1-expects-more"])
def test_nnodes_that_differ_are_named_on_both_nodes(tmp_path, launchers, tiny_model_dir, tiny_dataset, nnodes):
    """Before, node 0 given 3 waited out rdzv_timeout for node rank 2; node 1 given 3 ended with "node rank(s) 2
    never joined within rdzv_timeout" seconds after its start."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=120)
    port = free_port()
    node0 = waiting_node_0(tmp_path, launchers, config, port, NNODES=nnodes[0])
    node1 = Launcher(tmp_path, "node1", config, port, NODE_RANK="1", NNODES=nnodes[1])
    launchers.append(node1)
    started = time.monotonic()
    assert node0.wait(120) == 1 and node1.wait(120) == 1
    assert time.monotonic() - started < 60  # node 1's start-up on 2 busy cores, then the table at once
    for launcher in (node0, node1):
        last = launcher.last_line()
        assert f"NNODES differs between nodes (node 0: {nnodes[0]}, node 1: {nnodes[1]})" in last, last
        assert "never joined" not in last, last


@pytest.mark.slow
def test_a_job_relaunched_on_a_new_port_right_after_a_crash_trains_as_one(tmp_path, launchers, tiny_model_dir,
                                                                          tiny_dataset):
    """Both nodes' trees killed mid-run, then relaunched at once with another MASTER_PORT, as advised when the
    old one is still busy: the dead node 0's lock (its heartbeat seconds old) is taken over by node 0 and node 1
    goes on with it. Before, node 1 refused it ("in use by another meshtune job") and node 0 waited for node 1."""
    config = job_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=120, max_steps=6, save_steps=2,
                        preflight=False)
    output = tmp_path / "output"
    port = free_port()
    first = [Launcher(tmp_path, "node0", config, port), Launcher(tmp_path, "node1", config, port, NODE_RANK="1")]
    launchers += first
    wait_until(lambda: (output / "metrics.jsonl").exists() and len(read_metrics(output)) >= 1, 240,
               "first step", first[0])
    held = json.loads((output / LOCK).read_text())
    for launcher in first:
        kill_tree(launcher.process.pid)
        launcher.process.wait(timeout=30)
    assert (output / LOCK).exists() and time.time() - (output / LOCK).stat().st_mtime < 60
    new_port = free_port()
    again = [Launcher(tmp_path, "node1-again", config, new_port, NODE_RANK="1")]  # node 1 first: the old lock is there
    launchers += again
    wait_until(lambda: "waiting for node 0" in again[0].output(), 120, "node 1 past the lock", again[0])
    again.append(Launcher(tmp_path, "node0-again", config, new_port))
    launchers.append(again[1])
    for launcher in again:
        assert launcher.wait(240) == 0, launcher.output()[-3000:]
    assert f"taking over the lock of output_dir {output} from run {held['run_id']}" in again[1].output()
    assert [r["step"] for r in read_metrics(output)][-1] == 6
