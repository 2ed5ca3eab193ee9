"""The launcher's mailbox: what each side writes, the other reads back; a file a reader polls is never seen half
written; and no other module names a file in it."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import meshtune.mailbox as mailbox_module
from meshtune.mailbox import VARIABLE, Mailbox

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "meshtune"


def test_only_a_launchers_worker_finds_a_mailbox(tmp_path):
    with Mailbox.created() as mailbox:
        assert mailbox.directory.is_dir() and not any(mailbox.directory.iterdir())
        found = Mailbox.of_launcher(mailbox.environment())
        assert found is not None and found.directory == mailbox.directory
    assert not mailbox.directory.exists()  # removed with the launch
    assert Mailbox.of_launcher({}) is None  # the user's own torchrun
    assert Mailbox.of_launcher({VARIABLE: str(tmp_path / "gone")}) is None


def test_what_the_workers_leave_the_launcher_reads(tmp_path):
    mailbox = Mailbox(tmp_path)
    assert mailbox.first_error() is None and not mailbox.any_started()
    assert (mailbox.finished_workers(), mailbox.stopped_workers(), mailbox.stopped_signal()) == (0, 0, None)
    mailbox.mark_started(3)
    mailbox.report_error(12, "rank 12's error")
    mailbox.report_error(2, "output_dir: the file system is read-only")
    assert mailbox.any_started()
    assert mailbox.first_error() == "output_dir: the file system is read-only"  # the lowest rank's, not by text
    mailbox.mark_finished(0)
    mailbox.mark_finished(1)
    mailbox.mark_stopped(2, signal.SIGTERM)
    assert (mailbox.finished_workers(), mailbox.stopped_workers(), mailbox.stopped_signal()) == (2, 1, signal.SIGTERM)


def test_a_failure_repeated_in_a_later_attempt_is_recognised(tmp_path):
    mailbox = Mailbox(tmp_path)
    assert mailbox.record_failure(1, 0, "RuntimeError: boom") == []
    assert mailbox.record_failure(0, 0, "RuntimeError: boom") == []  # another rank's failures are its own
    assert mailbox.record_failure(1, 1, "RuntimeError: other") == []
    assert mailbox.record_failure(1, 2, "RuntimeError: boom") == [0]
    assert mailbox.record_failure(1, 3, "RuntimeError: boom") == [0, 2]


def test_what_the_launcher_leaves_the_workers_read(tmp_path):
    mailbox = Mailbox(tmp_path)
    assert mailbox.stop_requested() is None and not mailbox.told()
    mailbox.request_stop(signal.SIGTERM)
    mailbox.mark_told()
    assert mailbox.stop_requested() == signal.SIGTERM and mailbox.told()


def test_a_polled_file_is_never_read_half_written(tmp_path, monkeypatch):
    """A writer stopped between writing and renaming: the readers see nothing yet, never a part."""
    mailbox = Mailbox(tmp_path)
    written, go_on = threading.Event(), threading.Event()
    replace = os.replace

    def slow_replace(source, target):
        written.set()
        go_on.wait(10)
        replace(source, target)

    monkeypatch.setattr(mailbox_module.os, "replace", slow_replace)
    writer = threading.Thread(target=mailbox.report_error, args=(0, "a long message " * 1000))
    writer.start()
    assert written.wait(10)
    assert [p.name.startswith(".") for p in tmp_path.iterdir()] == [True]  # only the hidden temporary file
    assert mailbox.first_error() is None
    go_on.set()
    writer.join(10)
    assert mailbox.first_error() == "a long message " * 1000 and len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(mailbox_module.os, "replace", replace)
    mailbox.request_stop(signal.SIGTERM)
    mailbox.mark_stopped(0, signal.SIGTERM)
    mailbox.record_failure(0, 0, "an error")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # every write renamed into place


def test_no_other_module_names_a_file_of_the_mailbox():
    """Each name's fixed parts, in order on one line (an f-string building the path), in no other module."""
    templates = (mailbox_module.ERROR_REPORT, mailbox_module.STARTED, mailbox_module.FINISHED, mailbox_module.STOPPED,
                 mailbox_module.FAILURE, mailbox_module.STOP_REQUEST, f'"{mailbox_module.TOLD}"', VARIABLE)
    patterns = [re.compile(".*".join(re.escape(part) for part in re.split(r"\{[^}]*\}", t) if part))
                for t in templates]
    found = [f"{path.relative_to(PACKAGE)}: {line.strip()}" for path in PACKAGE.rglob("*.py")
             if path.name != "mailbox.py" for line in path.read_text().splitlines()
             if any(pattern.search(line) for pattern in patterns)]
    assert not found, found
    assert patterns[0].search('Path(directory, f"rank-{rank:06d}.txt")')  # what it would catch
