"""One job per output_dir: a lock file that node 0's launcher holds for the whole job, restarts included.

Two jobs writing one output_dir interleave their metrics, overwrite each other's checkpoints and resume from each
other's state. The lock names its holder (run id, host, process, start time) and is kept fresh by a heartbeat, so
a second job is refused with who holds it, and a lock left by a dead job is taken over: at once when its process
is gone from this host, else once its heartbeat is older than STALE_S. Across nodes the lock also carries the
job's run id (the scheduler's job id, or one derived from master address, port and output_dir): node 0 relaunched
on another host takes over its own job's lock, and the other nodes refuse to join a job whose output_dir another
job holds.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from meshtune.errors import StorageError

LOCK = ".meshtune-lock"
HEARTBEAT_S = 10
STALE_S = 60

logger = logging.getLogger(__name__)


class OutputLock:
    """`with OutputLock(output_dir, run_id):` around a job's whole run on node 0 (or its one process)."""

    def __init__(self, output_dir: str | Path, run_id: str, same_job_takes_over: bool = False):
        """`same_job_takes_over`: a lock with this run id is this job's own, left by node 0's earlier launcher
        (only meaningful across nodes, where the run id names the job; on one node every run derives the same)."""
        self.path = Path(output_dir) / LOCK
        self.run_id, self.same_job_takes_over = run_id, same_job_takes_over
        self.mine = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.rejoined = False  # took over this job's own lock: node 0 relaunched into its running job

    def __enter__(self) -> OutputLock:
        held = self._read()
        if held is not None and held != self.mine:
            gone = self._gone(held)
            if gone is None:
                raise StorageError(
                    f"output_dir {self.path.parent} is in use by another meshtune job: run {held.get('run_id')} on "
                    f"{held.get('host')} (pid {held.get('pid')}), started {_when(held.get('started'))}, alive "
                    f"{self._age():.0f} s ago. Use another output_dir, or wait for that job to end (a lock left by a "
                    f"dead job is taken over, at once on its own host, else after {STALE_S} s)")
            logger.warning(f"warning: taking over the lock of output_dir {self.path.parent} from run "
                           f"{held.get('run_id')} on {held.get('host')} (pid {held.get('pid')}): {gone}")
            self.rejoined = self.same_job_takes_over and held.get("run_id") == self.run_id
        self.path.write_text(json.dumps(self.mine))
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._read() != self.mine:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:  # read-only or gone storage: the run's own error says so; never hide it
            logger.warning(f"warning: cannot remove {self.path} ({error.strerror}); the next launch takes it over, "
                           f"its process being gone")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the storage went away: the run itself reports that
                return

    def _read(self) -> dict | None:
        return read_lock(self.path)

    def _age(self) -> float:
        return lock_age(self.path)

    def _gone(self, held: dict) -> str | None:
        """Why the holder is no more (its process is gone from this host, or its heartbeat stopped), or None."""
        if self.same_job_takes_over and held.get("run_id") == self.run_id:
            return "it is this job's own (same run id), left by an earlier launcher of node 0"
        if held.get("host") == self.mine["host"] and isinstance(held.get("pid"), int):
            try:
                os.kill(held["pid"], 0)
            except ProcessLookupError:
                return "its process is gone"
            except PermissionError:
                pass  # alive, another user's
            else:
                return None
        age = self._age()
        return f"no heartbeat for {age:.0f} s" if age > STALE_S else None


def check_not_held_by_another_job(output_dir: str | Path, run_id: str) -> None:
    """Nodes other than 0: refuse to join when a live job with another run id holds output_dir (seen when it is
    shared; on node-local storage there is nothing to see, and node 0's lock decides)."""
    path = Path(output_dir) / LOCK
    held, age = read_lock(path), lock_age(path)
    if held is None:
        return
    if held.get("run_id") != run_id and age <= STALE_S:
        raise StorageError(
            f"output_dir {path.parent} is in use by another meshtune job: run {held.get('run_id')} on "
            f"{held.get('host')} (pid {held.get('pid')}), alive {age:.0f} s ago, while this node joins run {run_id}. "
            f"Use another output_dir, or wait for that job to end")


def read_lock(path: Path) -> dict | None:
    """The holder a lock file names; None when there is none (or it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def lock_age(path: Path) -> float:
    """Seconds since the lock's last heartbeat; infinite when it is gone."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def _when(timestamp: object) -> str:
    if not isinstance(timestamp, (int, float)):
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
