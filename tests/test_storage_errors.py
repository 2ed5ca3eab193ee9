"""Storage that cannot be written ends in one named error: an output_dir that cannot exist stops before any process
starts; a disk that fills during a save leaves the checkpoint unpublished and the previous one the resume point."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import base_config, run_cli_here, write_config
from meshtune.checkpoint import CheckpointError, list_checkpoints, select_resume
from meshtune.config import build_config
from meshtune.train.loop import run


@pytest.mark.parametrize("where, cause", [("under_a_file", "a part of the path is a file, not a directory"),
                                          ("proc", "a part of the path cannot be created there")])
def test_an_output_dir_that_cannot_be_written_is_named_before_any_process_starts(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset, where, cause, capfd):
    (tmp_path / "a_file").write_text("")
    output = tmp_path / "a_file" / "out" if where == "under_a_file" else "/proc/meshtune-test/out"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, output, nproc_per_node=2))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"output_dir: cannot write to {output}: {cause}" in result.stdout
    assert "Traceback" not in result.stdout and "torch.distributed" not in result.stdout  # no worker started


def test_an_unwritable_tokenized_path_is_named_on_one_process_too(tmp_path, tiny_model_dir, tiny_dataset, capfd):
    (tmp_path / "a_file").write_text("")
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out",
                                                  tokenized_path=str(tmp_path / "a_file" / "cache")))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 1 and "tokenized_path: cannot write to" in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stdout


@pytest.fixture
def small_disk(tmp_path):
    """A 1.1 MB tmpfs: room for the tiny model's first full checkpoint, not for a second (root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs",
                                                        str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_during_a_save_publishes_nothing_and_keeps_the_previous_resume_point(tmp_path, small_disk,
                                                                                        tiny_model_dir, tiny_dataset):
    output = small_disk / "out"
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, output, finetuning_type="full", save_steps=2,
                                   max_steps=4, tokenized_path=str(tmp_path / "tokenized"), save_final=False))
    with pytest.raises(CheckpointError) as failure:
        run(cfg)
    message = str(failure.value)
    assert f"writing {output / 'checkpoint-4.tmp'} failed" in message and "free of 1.1 MiB" in message
    assert "free space or lower save_total_limit" in message and "checkpoint-2 stays the resume point" in message
    assert [(c.step, c.complete) for c in list_checkpoints(output)] == [(2, True), (4, False)]
    assert select_resume(output, None)[0] == output / "checkpoint-2"


@pytest.mark.slow
def test_output_dir_turning_read_only_mid_run_stops_at_once_naming_the_cause(tmp_path, small_disk, tiny_model_dir,
                                                                              tiny_dataset):
    """A read-only, full or forbidden output_dir fails every restart the same way: the job stops without restarts,
    the cause its last line (the storage remounted read-only once checkpoint-2 is published)."""
    import os
    import sys
    import time

    from processes import kill_tree

    output = small_disk / "out"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, output, nproc_per_node=2,
                                                  max_steps=400, save_steps=2, save_total_limit=1,
                                                  tokenized_path=str(tmp_path / "tokenized"), save_final=False))
    process = subprocess.Popen([sys.executable, "-m", "meshtune", "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (output / "checkpoint-2" / "COMPLETE").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        started = time.monotonic()
        out, _ = process.communicate(timeout=90)
        stopped_in = time.monotonic() - started
    finally:
        kill_tree(process.pid)
    assert process.returncode == 1, out[-3000:]
    assert "the file system is read-only" in out.strip().splitlines()[-1] and "a restart cannot fix" in out, out[-3000:]
    assert "Restarting" not in out and stopped_in < 30, (stopped_in, out[-3000:])


def test_a_write_failure_on_a_full_storage_says_so_even_when_the_error_lost_its_errno(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as "unexpected pos": the storage's free space names the cause."""
    from meshtune.checkpoint import manager

    saves = manager.CheckpointManager(tmp_path, save_total_limit=1, async_save=False, rank=0, world_size=1)
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    usage = {"free": 0}
    monkeypatch.setattr(manager.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(1_126_400, 1_126_400 - usage["free"], usage["free"]))
    message = saves._write_failure(tmp_path / "checkpoint-4.tmp", lost)
    assert "failed: No space left on device (0 B free of 1.1 MiB" in message, message
    assert "free space or lower save_total_limit" in message and "unexpected pos 704 vs 598" in message
    usage["free"] = 900_000  # room left: the write failed for another reason, and the message does not guess
    message = saves._write_failure(tmp_path / "checkpoint-4.tmp", lost)
    assert "No space left" not in message and "save_total_limit" not in message, message


def test_a_save_failing_on_several_ranks_is_named_in_one_line_with_its_ranks():
    """DCP's CheckpointException holds every failing rank's traceback: the message names each error once."""
    from torch.distributed.checkpoint.api import CheckpointException

    from meshtune.checkpoint.manager import one_line

    full = OSError(errno.ENOSPC, "No space left on device")
    failure = CheckpointException("save failed", {0: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                                   "unexpected pos 704 vs 598\nmore"), None),
                                                  1: (full, None), 3: (full, None)})
    assert "Traceback" in str(failure)
    assert one_line(failure) == ("OSError: [Errno 28] No space left on device (ranks 1, 3); RuntimeError: [enforce "
                                 "fail at inline_container.cc:672] . unexpected pos 704 vs 598 (rank 0)")


def test_a_lock_that_cannot_be_removed_never_hides_the_runs_own_error(tmp_path, monkeypatch, caplog):
    from meshtune.launch.output_lock import LOCK, OutputLock

    with pytest.raises(RuntimeError, match="the run's own error"):
        with OutputLock(tmp_path, "run-1"):
            def read_only(self, missing_ok=False):
                raise OSError(errno.EROFS, "Read-only file system", str(self))

            monkeypatch.setattr(Path, "unlink", read_only)
            raise RuntimeError("the run's own error")
    said = caplog.messages
    assert (tmp_path / LOCK).exists() and "cannot remove" in said[-1] and "Read-only file system" in said[-1]
