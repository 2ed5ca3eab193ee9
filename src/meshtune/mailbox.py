"""The files between a node's meshtune launcher and the torchrun workers it started: one directory per launch,
named to the workers in `MESHTUNE_ERROR_DIR`. Every name in it, its writers and its readers are here.

From the workers: a MeshtuneError for the launcher to print last and pass on to the other nodes, that a worker
got past the rendezvous (a later failure is no rendezvous timeout), that it finished or stopped for a signal, that
its hang watchdog found other nodes gone silent (a partition, or dead nodes: which, at which step, the node's line),
and each crash by attempt (one that repeats is not restarted again). From the launcher: a stop request (its own
SIGTERM, which the workers honour as if signalled) and `told` (a worker's error has reached the other nodes).

A file read while it may still be written (the other side polls) is written under a hidden temporary name and
renamed into place; a marker whose existence is the message is created empty.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

VARIABLE = "MESHTUNE_ERROR_DIR"

ERROR_REPORT = "rank-{rank}.txt"  # the rank zero-padded: in name order, the lowest rank's report comes first
STARTED = "started-{rank}"
FINISHED = "finished-{rank}"
STOPPED = "stopped-by-signal-{rank}"  # holds the signal's number
FAILURE = "failure-rank{rank}-attempt{attempt}.log"  # holds the error, for the next attempt to compare
STOP_REQUEST = "stop-requested"  # holds the signal's number
TOLD = "told"
PEERS_LOST = "peers-lost.json"  # {"line", "nodes", "step"}: the newest hang that lost whole nodes


class Mailbox:
    """The directory of one launch, for both sides."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @classmethod
    def of_launcher(cls, environ: Mapping[str, str] = os.environ) -> Mailbox | None:
        """In a torchrun worker, the mailbox of the meshtune launcher that started it; None when none did (the
        user's own torchrun, or a single process)."""
        directory = environ.get(VARIABLE)
        return cls(directory) if directory and os.path.isdir(directory) else None

    @classmethod
    @contextmanager
    def created(cls) -> Iterator[Mailbox]:
        """A new, empty mailbox for one launch, removed with everything in it at the end."""
        with tempfile.TemporaryDirectory(prefix="meshtune-errors-") as directory:
            yield cls(directory)

    def environment(self) -> dict[str, str]:
        """What the launcher gives its workers, for `of_launcher` to find this mailbox."""
        return {VARIABLE: str(self.directory)}

    # the workers' side

    def report_error(self, rank: int, message: str) -> None:
        self._write(ERROR_REPORT.format(rank=f"{rank:06d}"), message)

    def first_error(self) -> str | None:
        """The lowest rank's reported error, if a worker reported one."""
        reports = sorted(self.directory.glob(ERROR_REPORT.format(rank="*")))
        return reports[0].read_text() if reports else None

    def mark_started(self, rank: int) -> None:
        (self.directory / STARTED.format(rank=rank)).touch()

    def any_started(self) -> bool:
        return self._count(STARTED) > 0

    def mark_finished(self, rank: int) -> None:
        (self.directory / FINISHED.format(rank=rank)).touch()

    def finished_workers(self) -> int:
        return self._count(FINISHED)

    def mark_stopped(self, rank: int, signum: int) -> None:
        """This worker stopped for `signum` (it exits 0, so torchrun does not restart it; the launcher exits
        128 + signum)."""
        self._write(STOPPED.format(rank=rank), str(int(signum)))

    def stopped_workers(self) -> int:
        return self._count(STOPPED)

    def stopped_signal(self) -> int | None:
        """The signal a worker of this node stopped for, if any did."""
        for path in self.directory.glob(STOPPED.format(rank="*")):
            try:
                return int(path.read_text())
            except (OSError, ValueError):
                continue
        return None

    def record_failure(self, rank: int, attempt: int, error: str) -> list[int]:
        """Keep this attempt's error of `rank`; returns the earlier attempts in which it failed with the same one."""
        earlier = [int(path.stem.rsplit("attempt", 1)[1])
                   for path in self.directory.glob(FAILURE.format(rank=rank, attempt="*"))
                   if path.read_text() == error]
        self._write(FAILURE.format(rank=rank, attempt=attempt), error)
        return sorted(earlier)

    def mark_peers_lost(self, line: str, nodes: list[int], step: int) -> None:
        """The hang watchdog found `nodes` silent at `step`; `line` is what this node said of it."""
        self._write(PEERS_LOST, json.dumps({"line": line, "nodes": nodes, "step": step}))

    def peers_lost(self) -> dict | None:
        try:
            return json.loads((self.directory / PEERS_LOST).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def clear_peers_lost(self) -> None:
        (self.directory / PEERS_LOST).unlink(missing_ok=True)

    # the launcher's side

    def request_stop(self, signum: int) -> None:
        self._write(STOP_REQUEST, str(int(signum)))

    def stop_requested(self) -> int | None:
        """The signal the launcher received and left for its workers, if it did."""
        try:
            return int((self.directory / STOP_REQUEST).read_text())
        except FileNotFoundError:
            return None

    def mark_told(self) -> None:
        (self.directory / TOLD).touch()

    def told(self) -> bool:
        return (self.directory / TOLD).exists()

    def _count(self, name: str) -> int:
        return sum(1 for _ in self.directory.glob(name.format(rank="*")))

    def _write(self, name: str, text: str) -> None:
        """`text` under `name`, whole or not at all for a reader: the hidden temporary name matches no reader's
        pattern, and the rename replaces the file in one step."""
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / name)
