"""One job per output_dir: a second job is refused naming the one running; a lock left by a dead job is taken
over; nodes of one job share it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import base_config, kill_tree, read_metrics, run_cli_here, write_config
from meshtune.errors import StorageError
from meshtune.launch.output_lock import LOCK, STALE_S, OutputLock, check_not_held_by_another_job


def leave_lock(directory, age_s: float = 0, **holder) -> None:
    held = {"run_id": "run-a", "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), **holder}
    path = directory / LOCK
    path.write_text(json.dumps(held))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


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


def test_a_holder_on_another_host_is_taken_over_only_once_its_heartbeat_is_stale(tmp_path, caplog):
    leave_lock(tmp_path, host="node-elsewhere", pid=1, age_s=5)
    with pytest.raises(StorageError, match="node-elsewhere"):
        OutputLock(tmp_path, "run-b").__enter__()
    leave_lock(tmp_path, host="node-elsewhere", pid=1, age_s=STALE_S + 30)
    with OutputLock(tmp_path, "run-b"):
        pass
    assert "no heartbeat for" in caplog.messages[0]


def test_nodes_of_one_job_share_the_lock_and_refuse_another_job(tmp_path, caplog):
    leave_lock(tmp_path, host="node-elsewhere", pid=1)
    check_not_held_by_another_job(tmp_path, "run-a")  # node 1 of the job holding it
    with pytest.raises(StorageError, match="while this node joins run run-b"):
        check_not_held_by_another_job(tmp_path, "run-b")
    with OutputLock(tmp_path, "run-a", same_job_takes_over=True):  # node 0 relaunched elsewhere
        pass
    assert "this job's own" in caplog.messages[0]


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
