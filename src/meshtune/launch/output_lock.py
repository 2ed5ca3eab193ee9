"""One job per output_dir: a lock file that node 0's launcher holds for the whole job, restarts included.

Two jobs writing one output_dir interleave their metrics, overwrite each other's checkpoints and resume from each
other's state. The lock names its holder: run id, master address and port, and the machine (host name, boot id,
pid namespace) and process (pid and its start time) of node 0's launcher, which touches the file every
HEARTBEAT_S. Whether that holder is alive is judged the same way by every node, from the file alone:

- a holder on this machine by its process, at once (a pid that is gone, or reused by another process, is gone;
  so is one from before this host's last boot);
- a holder elsewhere by its heartbeat, watched: a beat seen means alive, none for STALE_S means gone.

Node 0 takes over a lock whose holder is gone and refuses a live one: another job's, or its own job's, which means
that another launcher was also given NODE_RANK 0. The other nodes never take the lock; they wait for the same
verdict (or for node 0 to have taken it) and refuse what node 0 refuses, so the nodes of a job reach one decision.
A live lock of node 0 with the same master address but another port means this node's MASTER_PORT differs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import psutil

from meshtune.doctor.reachability import HEARTBEAT_THREAD
from meshtune.errors import ConfigError, StorageError

LOCK = ".meshtune-lock"
HEARTBEAT_S = 10
STALE_S = 3 * HEARTBEAT_S  # three beats missed: its holder is gone
POLL_S = 0.5

ALIVE, GONE, REPLACED = "alive", "gone", "replaced"

logger = logging.getLogger(__name__)


class NodeMismatch(ConfigError):
    """This node and the live node 0 that holds output_dir's lock disagree on who they are (a second NODE_RANK 0,
    another MASTER_PORT). `note`: (master address, port, run id, message) for node 0, which waits for this node."""

    def __init__(self, message: str, note: tuple[str, int, str, str]):
        super().__init__(message)
        self.note = note


def this_machine() -> dict:
    """What tells this machine's processes from another's: a host name alone is shared by containers and by a
    host before and after a reboot, so pids are compared only where boot and pid namespace match too."""
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _link("/proc/self/ns/pid")}


def holder(run_id: str, master_addr: str | None = None, master_port: int | None = None) -> dict:
    """This process as a lock's holder."""
    return {"run_id": run_id, "master_addr": master_addr, "master_port": master_port, **this_machine(),
            "pid": os.getpid(), "pid_started": psutil.Process().create_time(), "started": time.time()}


class OutputLock:
    """`with OutputLock(output_dir, run_id):` around a job's whole run on node 0 (or its one process)."""

    def __init__(self, output_dir: str | Path, run_id: str, same_job_takes_over: bool = False,
                 master_addr: str | None = None, master_port: int | None = None):
        """`same_job_takes_over`: a lock with this run id is this job's own, left by node 0's earlier launcher
        (only meaningful across nodes, where the run id names the job; on one node every run derives the same)."""
        self.path = Path(output_dir) / LOCK
        self.run_id, self.same_job_takes_over = run_id, same_job_takes_over
        self.mine = holder(run_id, master_addr, master_port)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.rejoined = False  # took over this job's own lock: node 0 relaunched into its running job

    def __enter__(self) -> OutputLock:
        while True:
            held = read_lock(self.path)
            if held is None:
                if self._create():
                    break
                if read_lock(self.path) is None and self.path.exists():  # there, but no holder can be read in it
                    logger.warning(f"warning: taking over the lock of output_dir {self.path.parent}: it names no "
                                   f"holder that can be read")
                    self._write()
                    break
                continue  # another launcher created it just now: judge it
            state, why = judge(self.path, held)
            if state == REPLACED:
                continue
            if state == ALIVE:
                raise self._refusal(held, why)
            logger.warning(f"warning: taking over the lock of output_dir {self.path.parent} from run "
                           f"{held.get('run_id')} on {held.get('host')} (pid {held.get('pid')}): {why}")
            self.rejoined = self.same_job_takes_over and held.get("run_id") == self.run_id
            self._write()
            break
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name=HEARTBEAT_THREAD)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if read_lock(self.path) != self.mine:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:  # read-only or gone storage: the run's own error says so; never hide it
            logger.warning(f"warning: cannot remove {self.path} ({error.strerror}); the next launch takes it over, "
                           f"its process being gone")

    def _create(self) -> bool:
        """The lock written where there was none; False when another launcher's appeared first."""
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as out:
            out.write(json.dumps(self.mine))
        return True

    def _write(self) -> None:
        staged = self.path.with_name(f"{LOCK}.{os.getpid()}")
        staged.write_text(json.dumps(self.mine))
        os.replace(staged, self.path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the storage went away: the run itself reports that
                return

    def _refusal(self, held: dict, why: str) -> Exception:
        where = (f"run {held.get('run_id')} on {held.get('host')} (pid {held.get('pid')}), started "
                 f"{_when(held.get('started'))}: {why}")
        if self.same_job_takes_over and held.get("run_id") == self.run_id:
            message = (f"node 0 of this job is already running: its launcher holds output_dir {self.path.parent}'s "
                       f"lock ({where}), and this launcher was given NODE_RANK 0 too. Two nodes were given NODE_RANK "
                       f"0: give each node its own NODE_RANK from 0 to NNODES-1 (0 only on the MASTER_ADDR host); "
                       f"to relaunch node 0, stop that launcher first")
            mine = self.mine
            told = (f"a second launcher was started as node 0 of this job on {mine['host']} (pid {mine['pid']}) "
                    f"while node 0's launcher runs: two nodes were given NODE_RANK 0. Give each node its own "
                    f"NODE_RANK from 0 to NNODES-1 (0 only on the MASTER_ADDR host) and launch again")
            return NodeMismatch(message, (mine["master_addr"], mine["master_port"], self.run_id, told))
        return StorageError(
            f"output_dir {self.path.parent} is in use by another meshtune job: {where}. Use another output_dir, or "
            f"wait for that job to end (a lock whose job is gone is taken over: at once on its own host, else once "
            f"its heartbeat has stopped for {STALE_S} s)")


def follow_node0(output_dir: str | Path, run_id: str, node_rank: int, master_addr: str, master_port: int | None,
                 port_source: str = "") -> None:
    """Nodes other than 0: go on when output_dir's lock is free, node 0's of this job, or held by a job that is
    gone (node 0 takes it over, judging as this node does); refuse a live one, as node 0 does. Seen only where
    output_dir is shared; on node-local storage there is nothing to see, and node 0's lock decides."""
    path = Path(output_dir) / LOCK
    while True:
        held = read_lock(path)
        if held is None:
            return
        theirs = held.get("master_port")
        other_port = held.get("master_addr") == master_addr and isinstance(theirs, int) and theirs != master_port
        if held.get("run_id") == run_id and not other_port:
            return
        state, why = judge(path, held)
        if state == REPLACED:
            continue
        if state == GONE:
            logger.info(f"output_dir {path.parent}: the lock of run {held.get('run_id')} is left by a job that is "
                        f"gone ({why}); node 0 takes it over")
            return
        break
    who = f"{held.get('host')} (pid {held.get('pid')})"
    if other_port:
        source = f" (from {port_source})" if port_source else ""
        message = (f"MASTER_PORT differs between nodes: node 0 of this job runs on {who} with MASTER_PORT={theirs} "
                   f"and holds output_dir {path.parent}'s lock ({why}), while node {node_rank} was given MASTER_PORT="
                   f"{master_port}{source}. Set node 0's MASTER_PORT on every node and launch this node again")
        told = (f"MASTER_PORT differs between nodes: node {node_rank} ({socket.gethostname()}) was started with "
                f"MASTER_PORT={master_port}, not node 0's {theirs}, so it cannot join. Set the same MASTER_PORT "
                f"on every node and launch again")
        raise NodeMismatch(message, (master_addr, theirs, str(held.get("run_id")), told))
    raise StorageError(
        f"output_dir {path.parent} is in use by another meshtune job: run {held.get('run_id')} on {who}, started "
        f"{_when(held.get('started'))}: {why}, while node {node_rank} joins run {run_id}. Use another output_dir, "
        f"or wait for that job to end")


def judge(path: Path, held: dict) -> tuple[str, str]:
    """(ALIVE, GONE or REPLACED, why) for the holder `held` read from `path`: at once for a holder on this
    machine, else after watching its heartbeat (at most STALE_S). REPLACED: the file names another holder now."""
    here = this_machine()
    if held.get("host") == here["host"]:
        if held.get("boot") not in (None, here["boot"]):
            return GONE, "its host has restarted since"
        if held.get("pid_ns") in (None, here["pid_ns"]) and isinstance(held.get("pid"), int):
            return _process_state(held)
    announced = False
    first = _beat_time(path)
    while True:
        if read_lock(path) != held:  # rewritten by another holder, or removed by its own at its end
            return REPLACED, ""
        age = time.time() - (_beat_time(path) or 0.0)
        if age > STALE_S:
            return GONE, f"no heartbeat for {age:.0f} s"
        if (_beat_time(path) or 0.0) > (first or 0.0):
            return ALIVE, f"its heartbeat is live ({age:.0f} s ago)"
        if not announced:
            announced = True
            logger.info(f"output_dir {path.parent}: its lock is held by run {held.get('run_id')} on "
                        f"{held.get('host')} (pid {held.get('pid')}), last alive {age:.0f} s ago; watching its "
                        f"heartbeat (up to {STALE_S} s) to tell a running job from one that is gone")
        time.sleep(POLL_S)


def _process_state(held: dict) -> tuple[str, str]:
    try:
        process = psutil.Process(held["pid"])
        started = process.create_time()
    except psutil.NoSuchProcess:
        return GONE, "its process is gone"
    except psutil.AccessDenied:  # another user's process: alive
        return ALIVE, f"its process (pid {held['pid']}) runs on this host"
    if isinstance(held.get("pid_started"), (int, float)) and abs(started - held["pid_started"]) > 1:
        return GONE, "its process is gone (its pid now belongs to another process)"
    return ALIVE, f"its process (pid {held['pid']}) runs on this host"


def read_lock(path: Path) -> dict | None:
    """The holder a lock file names; None when there is none (or it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _beat_time(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _when(timestamp: object) -> str:
    if not isinstance(timestamp, (int, float)):
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
