"""SIGTERM, as schedulers send before preempting: the run finishes its step, writes a checkpoint when the grace
period leaves room, exits 143 (128 + SIGTERM), and the same command resumes exactly. The multi-node forms (only
node 0's launcher signalled; every process of node 1 signalled) are in test_faults.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import base_config, kill_tree, read_metrics, run_cli_here, write_config
from meshtune.mailbox import Mailbox
from meshtune.train.preemption import StopRequest, exit_code


def test_the_save_is_skipped_when_the_grace_period_cannot_hold_it():
    stop = StopRequest()
    stop.signum, stop.received_at = signal.SIGTERM, time.monotonic() - 50
    cpu = torch.device("cpu")
    assert stop.save_fits(60, None, cpu)[0]  # no save measured yet: try (an unfinished save is never published)
    assert stop.save_fits(60, 5.0, cpu)[0]
    fits, why = stop.save_fits(60, 20.0, cpu)
    assert not fits and "the last save took 20 s" in why and "10 s of stop_grace_period=60 s are left" in why
    assert stop.save_fits(0, None, cpu) == (False, "stop_grace_period is 0")
    assert exit_code(signal.SIGTERM) == 143


def test_a_stop_file_left_by_the_launcher_counts_as_a_signal(tmp_path):
    stop = StopRequest(mailbox=Mailbox(tmp_path))
    assert stop.vote == 0.0
    Mailbox(tmp_path).request_stop(signal.SIGTERM)  # as the launcher's SIGTERM handler leaves it
    assert stop.vote == 1.0 and stop.signum == signal.SIGTERM
    stop.tally(torch.tensor(1.0, dtype=torch.float64))
    assert stop.due() == signal.SIGTERM and stop.due() == 0  # each tally is read once


def adapter_hash(output) -> str:
    return hashlib.sha256((output / "final" / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.mark.alone
@pytest.mark.slow
def test_sigterm_to_a_one_process_run_saves_exits_143_and_the_relaunch_resumes_exactly(tmp_path, tiny_model_dir,
                                                                                       tiny_dataset, capfd,
                                                                                       untimed_from_here):
    """The signalled run is a process of its own; the uninterrupted run and the relaunch train in this one (a run
    on one process trains in `meshtune train`'s own), the signalled one with as many threads. Only the signalled
    run is timed (its steps against the signal): the other two run beside other tests."""
    def config(name: str):
        (tmp_path / name).mkdir()
        return write_config(tmp_path / name, **base_config(tiny_model_dir, tiny_dataset, tmp_path / name / "out",
                                                           max_steps=12, save_steps=5))
    stopped = config("stopped")
    output = tmp_path / "stopped" / "out"
    process = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(stopped)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "MESHTUNE_FAULT": "slow:0.3",
                                    "OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        deadline = time.monotonic() + 180
        while not ((output / "metrics.jsonl").exists() and len(read_metrics(output)) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        text, _ = process.communicate(timeout=60)
    finally:
        kill_tree(process.pid)
    assert process.returncode == 143, text[-3000:]
    saved = max(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*"))
    assert saved in (3, 4) and (output / f"checkpoint-{saved}" / "COMPLETE").exists(), text[-3000:]
    assert f"stopped by SIGTERM at step {saved} of 12" in text and not (output / "final").exists()
    untimed_from_here()
    clean = config("clean")
    assert run_cli_here(["train", str(clean)], capfd).returncode == 0
    result = run_cli_here(["train", str(stopped)], capfd)
    assert (result.returncode == 0
            and f"checkpoint-{saved} at step {saved} of 12" in result.stdout), result.stdout[-3000:]
    assert [r["loss"] for r in read_metrics(output)] == [r["loss"] for r in read_metrics(tmp_path / "clean" / "out")]
    assert adapter_hash(output) == adapter_hash(tmp_path / "clean" / "out")


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_resumes_at_its_last_step_and_ends_cleanly(tmp_path, tiny_model_dir, tiny_dataset,
                                                                           capfd):
    """No step is left to run (and so no stop vote is ever read): the run still ends with its final export. Both
    runs train on one process, this one."""
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2,
                                                  save_steps=2))
    assert run_cli_here(["train", str(config)], capfd).returncode == 0
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 0 and "checkpoint-2 at step 2 of 2" in result.stdout, result.stdout[-3000:]
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()
