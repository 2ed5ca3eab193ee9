"""Fail in seconds, with the reason, instead of hanging at rendezvous: before torchrun starts, node 0 checks that
its address resolves and it can take the rendezvous port, and every other node waits (up to rdzv_timeout) until a
rendezvous store answers there."""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from meshtune.errors import MeshtuneError
from meshtune.doctor.launch_settings import LaunchSettings

logger = logging.getLogger(__name__)

CAUSES = ("likely causes: a firewall or security group blocking the port; a wrong MASTER_ADDR (on a cluster: node 0's "
          "address on the network all nodes share, not 127.0.0.1 or a docker/VPN interface's); a MASTER_PORT that "
          "differs between nodes (every node must use node 0's); node 0 not started or already failed; two nodes "
          "given the same NODE_RANK")


class RendezvousError(MeshtuneError):
    """This node cannot meet the others. `last_error`: the last connection error, when one was met."""

    def __init__(self, message: str, last_error: str | None = None):
        super().__init__(message)
        self.last_error = last_error


STORE_ANSWER_S = 10.0  # a TCPStore answers a client at once; a listener silent this long is not one
PROBE_IMPORT_S = 120.0  # the probe's own start-up (Python and torch on busy cores), before its deadline starts


class NotAStore(RendezvousError):
    """MASTER_PORT on node 0's host accepts connections but is no TCPStore: another program holds it."""


def check_port_free(settings: LaunchSettings) -> None:
    """Node 0 will host the c10d store on master_port: say so now if its address does not resolve or something
    else holds the port."""
    try:
        infos = socket.getaddrinfo(settings.master_addr, settings.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:  # node 0 is the host named there: a name it cannot look up is wrong
        raise RendezvousError(
            f"node 0: MASTER_ADDR {settings.master_addr} does not resolve on this node ({exc.strerror}); set "
            f"MASTER_ADDR to node 0's hostname or IP, the same on every node (on Kubernetes, the master's service "
            f"name, which may not be in DNS yet as the pod starts: launch again)") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RendezvousError(
                    f"node 0: port {settings.master_port} on {settings.master_addr} is already in use (another job, "
                    f"or an earlier run still exiting); pick a free MASTER_PORT and use it on every node") from None
            # not one of this host's addresses: torchrun's c10d decides who hosts; nothing to check here


def reach_node0(settings: LaunchSettings, timeout_s: int, prefix: str = "") -> None:
    """Node 0: its port is free; the other nodes: node 0 answers within `timeout_s` (rdzv_timeout)."""
    if settings.node_rank == 0:
        check_port_free(settings)
    else:
        logger.info(f"{prefix}waiting for node 0 at {settings.master_addr}:{settings.master_port} (up to "
                    f"rdzv_timeout={timeout_s} s)")
        wait_for_master(settings, timeout_s)


def wait_for_master(settings: LaunchSettings, timeout_s: float, poll_s: float = 1.0) -> float:
    """Non-zero nodes: connect to master_addr:master_port until a store answers there; seconds waited, or
    RendezvousError (also for a listener there that is no store: any client of it would wait forever)."""
    where = f"{settings.master_addr}:{settings.master_port}"

    def is_store(deadline: float) -> bool:
        answered = answers_as_store(settings.master_addr, settings.master_port,
                                    max(1.0, min(STORE_ANSWER_S, deadline - time.monotonic())))
        if answered is False:
            raise NotAStore(
                f"node {settings.node_rank}: {where} accepts connections but does not answer as a rendezvous store "
                f"(torch's TCPStore, which node 0's launcher hosts there) within {STORE_ANSWER_S:g} s: another "
                f"program listens on MASTER_PORT {settings.master_port} on node 0's host (node 0 then stops with "
                f"\"port ... is already in use\"). Pick a free MASTER_PORT and use it on every node")
        return bool(answered)

    return wait_for_endpoint(settings.master_addr, settings.master_port, timeout_s,
                             f"node {settings.node_rank} could not reach the rendezvous at {where}", CAUSES, poll_s,
                             answers=is_store)


def wait_for_endpoint(host: str, port: int, timeout_s: float, failure: str, causes: str, poll_s: float = 1.0,
                      answers=None) -> float:
    """Connect to host:port until it answers (and `answers(deadline)` says what answers is the service sought;
    it may raise); seconds waited, or RendezvousError: `failure`, the timeout and the last error, then `causes`."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    last_error = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(poll_s, 5.0)):
                pass
            if answers is None or answers(deadline):
                return time.monotonic() - started
            last_error = "no store answered"
        except OSError as exc:
            last_error = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{failure} within rdzv_timeout={timeout_s:g} s ({last_error}); {causes}",
                                  last_error)
        time.sleep(poll_s)


def rendezvous_failure(settings: LaunchSettings, timeout_s: int, joined: set[int] | None = None) -> RendezvousError:
    """torchrun gave up before any worker of this node started: the nodes never all met. `joined`: the node
    ranks seen in the rendezvous store (joining.py), when it answered."""
    seen = ""
    if joined:
        missing = [rank for rank in range(settings.max_nodes) if rank not in joined]
        seen = (f" (joined: node ranks {', '.join(map(str, sorted(joined)))}; never joined: node ranks "
                f"{', '.join(map(str, missing)) or 'none'})")
    return RendezvousError(
        f"node {settings.node_rank}: the rendezvous at {settings.master_addr}:{settings.master_port} did not complete "
        f"within rdzv_timeout={timeout_s} s: not all of NNODES={settings.nnodes} nodes joined with run id "
        f"{settings.run_id}{seen}. Start the same command on every node with the same MASTER_ADDR, MASTER_PORT and "
        f"config (a run id derived on each node includes the port, so nodes given different ports never meet); "
        f"{CAUSES}")


# A client of torch's TCPStore, in a process of its own: one in the launcher would wait forever on a listener that
# accepts and never answers (no timeout covers the handshake), and could not be stopped. It sets a key (a note
# for node 0) or reads one, then says so. Forked from this process when torch is imported here and no thread but
# the output_dir lock's heartbeat runs (a launcher's, a doctor's): the child has torch already, where a fresh
# Python spent seconds of CPU importing it, on each of a joining node's checks. Else a fresh Python runs it.
STORE_CLIENT = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, seconds, key, value = sys.argv[1:6]
print("ready", flush=True)
store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=float(seconds)), wait_for_workers=False)
if key:
    store.set(key, value)
else:
    store.check(["meshtune/probe"])
print("answered", flush=True)
"""
HEARTBEAT_THREAD = "meshtune-output-lock"  # the output_dir lock's heartbeat (launch/output_lock.py): file writes only
FORK_SAFE_THREADS = (HEARTBEAT_THREAD,)  # threads that never enter torch: a fork cannot catch one inside it


class ForkedClient:
    """STORE_CLIENT's work in a child forked from this process, read and ended as the Popen of a fresh one."""

    def __init__(self, host: str, port: int, answer_s: float, key: str, value: str):
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            self._client(read_end, write_end, host, port, answer_s, key, value)
        os.close(write_end)
        self.stdout = os.fdopen(read_end)
        self.returncode: int | None = None

    @staticmethod
    def _client(read_end: int, write_end: int, host: str, port: int, answer_s: float, key: str, value: str):
        code = 1
        try:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                signal.signal(signum, signal.SIG_DFL)  # the parent's handlers are the parent's
            os.close(read_end)
            quiet = os.open(os.devnull, os.O_RDWR)  # torch's C++ client logs each failed connect with a trace
            for fd in (0, 1, 2):
                os.dup2(quiet, fd)
            from datetime import timedelta

            from torch.distributed import TCPStore

            os.write(write_end, b"ready\n")
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=answer_s), wait_for_workers=False)
            if key:
                store.set(key, value)
            else:
                store.check(["meshtune/probe"])
            os.write(write_end, b"answered\n")
            code = 0
        finally:
            os._exit(code)  # no interpreter teardown: the parent's state is not the child's to finalise

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def can_fork_client() -> bool:
    main = threading.main_thread()
    return "torch.distributed" in sys.modules and threading.current_thread() is main and all(
        thread is main or thread.name in FORK_SAFE_THREADS for thread in threading.enumerate())


def ask_store(host: str, port: int, answer_s: float, key: str = "", value: str = "",
              fork: bool | None = None) -> bool | None:
    """True when host:port answered as a TCPStore within `answer_s` (after setting `key`, when given); False when
    it stayed silent that long (a listener that is no store); None when the client failed at once (nothing
    listens, or the connection broke), which says nothing either way. `fork`: the client forked from this process
    or in a fresh Python (default: forked where `can_fork_client`)."""
    if can_fork_client() if fork is None else fork:
        process = ForkedClient(host, port, answer_s, key, value)
    else:
        process = subprocess.Popen([sys.executable, "-c", STORE_CLIENT, host, str(port), str(answer_s), key, value],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)
    try:
        if _line(process, PROBE_IMPORT_S) != "ready":
            return None
        said = _line(process, answer_s + 5)
        if said == "answered":
            return True
        if said is not None:  # the client ended (its output closed) without an answer: it could not connect
            return None
        # Silent that long: a listener that is no store, unless the listener went away meanwhile (node 0 killed
        # or between its stores, the client retrying to connect): what accepts now is judged, not what did.
        return False if still_accepts(host, port) else None
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


def _line(process: subprocess.Popen | ForkedClient, timeout_s: float) -> str | None:
    """The child's next line within `timeout_s`: None when none came in time, "" when its output ended (it is
    ending, whether or not it has exited yet)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        return None
    return process.stdout.readline().strip()


def still_accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def answers_as_store(host: str, port: int, answer_s: float = STORE_ANSWER_S) -> bool | None:
    return ask_store(host, port, answer_s)


def post_note(host: str, port: int, key: str, message: str, answer_s: float = 15.0) -> bool:
    """Leave `message` under `key` in the store on host:port (node 0's, which reads it: joining.py); False when no
    store took it within `answer_s`. The client retries connecting until then (node 0 may be between stores)."""
    return bool(ask_store(host, port, answer_s, key, message))
