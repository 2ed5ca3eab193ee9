"""One job per output_dir: a second job is refused naming the one running; a lock left by a dead job is taken
over; nodes of one job share it, and every node reaches the same verdict on a lock it finds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import base_config, kill_tree, read_metrics, run_cli_here, write_config
from meshtune.errors import StorageError
from meshtune.launch import output_lock
from meshtune.launch.nodes import NodeSettings
from meshtune.launch.output_lock import LOCK, OutputLock, NodeMismatch, follow_node0, this_machine
from meshtune.launch.supervise import output_lock as launcher_lock

NO_SUCH_PID = 2**22 + 17  # above any pid_max: never a live process


def leave_lock(directory, age_s: float = 0, **holder) -> None:
    held = {"run_id": "run-a", "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), **holder}
    path = directory / LOCK
    path.write_text(json.dumps(held))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


@pytest.fixture
def quick_heartbeat(monkeypatch):
    """A holder elsewhere is gone after 2 s without a beat (STALE_S), so the tests need not wait 30 s."""
    monkeypatch.setattr(output_lock, "STALE_S", 2)
    monkeypatch.setattr(output_lock, "POLL_S", 0.05)


def beating(path, stop: threading.Event) -> threading.Thread:
    """A live holder on another machine: its heartbeat touches the lock."""
    def beat():
        while not stop.wait(0.2):
            os.utime(path)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def node(rank: int, port: int, run_id: str, nnodes: str = "2") -> NodeSettings:
    return NodeSettings(nnodes=nnodes, node_rank=rank, master_addr="127.0.0.1", master_port=port, nproc_per_node=1,
                        run_id=run_id, source={"master_port": "env MASTER_PORT"})


@pytest.fixture
def notes(monkeypatch):
    """What a refused node tells node 0 through its store: (host, port, key, message) per note."""
    from meshtune.doctor import reachability

    told = []
    monkeypatch.setattr(reachability, "post_note", lambda *note: told.append(note) or True)
    return told


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    kill_tree(process.pid)


@pytest.mark.slow
def test_a_live_holder_on_this_host_is_refused_by_name_and_a_dead_one_taken_over(tmp_path, sleeper, caplog):
    leave_lock(tmp_path, pid=sleeper.pid)
    with pytest.raises(StorageError, match=rf"in use by another meshtune job: run run-a on .* \(pid {sleeper.pid}\)"):
        OutputLock(tmp_path, "run-b").__enter__()
    sleeper.kill()
    sleeper.wait()
    with OutputLock(tmp_path, "run-b"):
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "run-b"
    assert "its process is gone" in caplog.messages[0] and not (tmp_path / LOCK).exists()


def test_a_holder_on_another_host_is_refused_while_it_beats_and_taken_over_once_it_stops(tmp_path, caplog,
                                                                                         quick_heartbeat):
    leave_lock(tmp_path, host="node-elsewhere", pid=1, age_s=1)
    stop = threading.Event()
    beat = beating(tmp_path / LOCK, stop)
    try:
        with pytest.raises(StorageError, match="node-elsewhere .*its heartbeat is live"):
            OutputLock(tmp_path, "run-b").__enter__()
    finally:
        stop.set()
        beat.join()
    with OutputLock(tmp_path, "run-b"):
        pass
    assert "no heartbeat for" in caplog.messages[-1]


def test_a_holder_on_this_host_from_before_its_last_boot_or_with_its_pid_reused_is_gone(tmp_path):
    leave_lock(tmp_path, boot="an-earlier-boot")  # this very process's pid, but another boot of the host
    with OutputLock(tmp_path, "run-b"):
        pass
    me = this_machine()
    leave_lock(tmp_path, pid_started=1.0, **me)  # this process's pid, started long before it
    with OutputLock(tmp_path, "run-b"):
        pass


def test_a_lock_that_names_no_readable_holder_is_taken_over(tmp_path, caplog):
    (tmp_path / LOCK).write_text('{"run_id": "run-a", "ho')  # cut short
    with OutputLock(tmp_path, "run-b"):
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "run-b"
    assert "names no holder that can be read" in caplog.messages[-1]


def test_nodes_of_one_job_share_the_lock_and_refuse_another_job(tmp_path, caplog, quick_heartbeat):
    leave_lock(tmp_path, host="node-elsewhere", pid=NO_SUCH_PID)
    follow_node0(tmp_path, "run-a", 1, "node01", 29500)  # node 1 of the job holding it
    stop = threading.Event()
    beat = beating(tmp_path / LOCK, stop)
    try:
        with pytest.raises(StorageError, match="while node 1 joins run run-b"):
            follow_node0(tmp_path, "run-b", 1, "node01", 29500)
    finally:
        stop.set()
        beat.join()
    leave_lock(tmp_path, host="node-elsewhere", pid=NO_SUCH_PID, age_s=5)
    with OutputLock(tmp_path, "run-a", same_job_takes_over=True) as lock:  # node 0 relaunched elsewhere
        assert lock.rejoined
    assert "no heartbeat for" in caplog.messages[-1]


def test_after_a_crash_both_nodes_relaunched_on_a_new_port_go_on_as_one_job(tmp_path, notes):
    """The dead job's node 0 left its lock, its heartbeat seconds old, and its process gone: node 1 relaunched with
    the new port's run id goes on, whether it looks before node 0 took the lock over or after, and node 0 takes
    it over. Before, node 1 refused ("in use by another meshtune job") while node 0 waited for it."""
    leave_lock(tmp_path, run_id="run-old-port", pid=NO_SUCH_PID, master_addr="127.0.0.1", master_port=29500,
               age_s=5, **{k: v for k, v in this_machine().items() if k != "host"})
    with launcher_lock(str(tmp_path), node(1, 29501, "run-new-port")) as nothing:  # node 1 first
        assert nothing is None
    with launcher_lock(str(tmp_path), node(0, 29501, "run-new-port")) as lock:
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "run-new-port" and not lock.rejoined
        with launcher_lock(str(tmp_path), node(1, 29501, "run-new-port")):  # node 1 after node 0
            pass
    assert not notes


def test_after_a_crash_of_node_0_on_another_host_node_1_waits_for_the_verdict_node_0_reaches(tmp_path,
                                                                                           quick_heartbeat):
    leave_lock(tmp_path, run_id="run-old-port", host="node-elsewhere", pid=NO_SUCH_PID, master_addr="node01",
               master_port=29500, age_s=1)
    started = time.monotonic()
    follow_node0(tmp_path, "run-new-port", 1, "node01", 29501)  # no beat: the job is gone, as node 0 finds
    assert 0.5 < time.monotonic() - started < 10
    with OutputLock(tmp_path, "run-new-port", same_job_takes_over=True) as lock:
        assert not lock.rejoined


def test_a_second_launcher_given_node_rank_0_is_refused_and_the_first_is_told(tmp_path, notes):
    """The running node 0 is this test process (its pid, on this host). Before, the second took its lock over
    as "left by an earlier launcher of node 0"."""
    running = node(0, 29500, "run-a")
    leave_lock(tmp_path, run_id="run-a", master_addr="127.0.0.1", master_port=29500, **this_machine())
    with pytest.raises(NodeMismatch, match="node 0 of this job is already running.*Two nodes were given NODE_RANK 0"):
        with launcher_lock(str(tmp_path), running):
            pass
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()  # never taken over
    [(host, port, key, message)] = notes
    assert (host, port, key) == ("127.0.0.1", 29500, "meshtune/run-a/refused")
    assert "a second launcher was started as node 0 of this job" in message and "NODE_RANK 0" in message


def test_a_node_given_another_master_port_names_it_and_tells_node_0(tmp_path, notes):
    """Node 0 runs on port 29500 (this test process holds its lock); node 1 was given 29501, so its derived run id
    differs too. Before, node 1 said "in use by another meshtune job" and node 0 waited out rdzv_timeout."""
    leave_lock(tmp_path, run_id="run-29500", master_addr="127.0.0.1", master_port=29500, **this_machine())
    with pytest.raises(NodeMismatch, match="MASTER_PORT differs between nodes: node 0 of this job runs on .* with "
                                           "MASTER_PORT=29500 .* node 1 was given MASTER_PORT=29501 "
                                           r"\(from env MASTER_PORT\)"):
        with launcher_lock(str(tmp_path), node(1, 29501, "run-29501")):
            pass
    [(host, port, key, message)] = notes
    assert (host, port, key) == ("127.0.0.1", 29500, "meshtune/run-29500/refused")
    assert "node 1 (" in message and "MASTER_PORT=29501, not node 0's 29500" in message


@pytest.mark.slow
def test_a_second_job_on_a_running_jobs_output_dir_is_refused_until_that_job_dies(tmp_path, tiny_model_dir,
                                                                                   tiny_dataset, capfd):
    """The first job is a process of its own (the lock names its pid); the second runs in this process."""
    output = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, output, max_steps=40)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_config(tmp_path / "a", **values)
    second = write_config(tmp_path / "b", **{**values, "learning_rate": 1e-3, "max_steps": 3})
    job_a = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(first)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT, env={**os.environ, "MESHTUNE_FAULT": "slow:0.5"})
    try:
        deadline = time.monotonic() + 120
        while not ((output / "metrics.jsonl").exists() and read_metrics(output)):
            assert job_a.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        result = run_cli_here(["train", str(second)], capfd)
        assert result.returncode == 1 and time.monotonic() - started < 30, result.stdout[-2000:]
        last = result.stdout.strip().splitlines()[-1]
        assert "is in use by another meshtune job" in last and f"(pid {job_a.pid})" in last, last
        assert not (output / "checkpoint-3").exists()
    finally:
        kill_tree(job_a.pid)
        job_a.wait()
    result = run_cli_here(["train", str(second), "resume_from_checkpoint=none"], capfd)
    assert result.returncode == 0, result.stdout[-2000:]
    assert f"taking over the lock of output_dir {output}" in result.stdout and "its process is gone" in result.stdout
    assert not (output / LOCK).exists()
