"""Starting the workers: meshtune runs the real torchrun for the user, on one machine or as one node of many."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import psutil

from meshtune.cpu_affinity import torchrun_numa_binding
from meshtune.launch.nodes import NodeSettings
from meshtune.mailbox import Mailbox


def needs_torchrun(settings: NodeSettings) -> bool:
    """One process on one node trains in the launching process; anything more goes through torchrun."""
    return settings.multi_node or settings.nproc_per_node > 1


def standalone_command(nproc: int, argv: list[str], max_restarts: int = 0,
                       numa_binding: str | None = None) -> list[str]:
    """torchrun with a standalone (local, free-port) c10d rendezvous, re-entering `meshtune` in each worker."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts", str(max_restarts), *numa_binding_option(numa_binding), "-m", "meshtune", *argv]


def numa_binding_option(value: str | None) -> list[str]:
    """torchrun pins its workers near their GPUs (cpu_affinity.py says when it does, and why)."""
    return [f"--numa-binding={value}"] if value else []


def torchrun_command(settings: NodeSettings, argv: list[str], cfg) -> list[str]:
    """This node's torchrun: standalone on one node; across several, a c10d rendezvous at node 0's address:port,
    or (rdzv_backend etcd-v2) one held by the etcd server at rdzv_endpoint.

    No `--node-rank` across nodes: torchrun ignores it for c10d (it only feeds the static backend, and warns when it is
    not 0) and orders agents itself (by host name or local_addr, then pid), so global rank 0 need not be on NODE_RANK 0.
    NODE_RANK 0 does host the rendezvous store (`is_host`): torch's own guess compares MASTER_ADDR with the host name's
    addresses and misses a second network (local_addr). The user's node rank still reaches the workers as
    MESHTUNE_NODE_RANK (see `launch_env`), so the startup check can spot two nodes given one rank.

    c10d's `read_timeout` bounds each wait on the store, and the launcher has made sure node 0 answers before torchrun
    starts. It is short because of what follows every completed round: each agent posts its share of the workers
    (torch's `role_info`, and agent 0 the workers' MASTER_ADDR) and waits for the others' in the store, watching
    nothing else. A node killed between the round's completion and its post (a second or two: the last agent to see
    the round complete polls once a second) left the others in that wait for the whole read_timeout, and the
    relaunched node in the next round's wait list behind them, all silent; then torchrun gave up with a
    DistStoreError. Bounded, the agent fails within RANK_EXCHANGE_TIMEOUT_S and the launcher starts torchrun again
    into a new round (`rank_exchange_lost`).
    """
    numa_binding = torchrun_numa_binding(cfg.cpu_pinning, settings.nproc_per_node)
    if not settings.multi_node:
        return standalone_command(settings.nproc_per_node, argv, cfg.max_restarts, numa_binding)
    host = f"[{settings.master_addr}]" if ":" in settings.master_addr else settings.master_addr  # IPv6
    if cfg.rdzv_backend == "etcd-v2":  # the rendezvous lives in etcd: no node hosts it
        timeouts = f"join_timeout={cfg.rdzv_timeout},read_timeout={cfg.rdzv_timeout}"
        rendezvous = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-conf", timeouts]
    else:
        timeouts = f"join_timeout={cfg.rdzv_timeout},read_timeout={min(cfg.rdzv_timeout, RANK_EXCHANGE_TIMEOUT_S)}"
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{settings.master_port}",
                      "--rdzv-conf", f"{timeouts},is_host={int(settings.node_rank == 0)}"]
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", settings.nnodes,
            "--nproc-per-node", str(settings.nproc_per_node),
            *rendezvous,
            "--rdzv-id", settings.run_id,
            "--max-restarts", str(cfg.max_restarts),
            *(["--local-addr", cfg.local_addr] if cfg.local_addr else []),
            *numa_binding_option(numa_binding),
            "-m", "meshtune", *argv]


RANK_EXCHANGE_TIMEOUT_S = 15  # c10d's read_timeout: a live agent posts its share within a second or two


def launch_env(settings: NodeSettings, stop_grace_period: int = 60) -> dict[str, str]:
    """Variables torchrun and its workers get on top of ours.

    TORCH_ELASTIC_SHUTDOWN_TIMEOUT: a signalled torchrun gives its workers this long before SIGKILL (30 s by
    default); they need the grace period to finish the step and write their checkpoint (train/preemption.py).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers get a store of their own each attempt instead of sharing the
    agent's rendezvous store. With the shared one, restarted workers met the last attempt's keys (gloo connected
    to the dead workers' addresses and failed with "Connection refused" on every restart, torch 2.13 on one
    node), and a dead node's restarted agent never rejoined (c10d across nodes).
    """
    return {"MESHTUNE_NODE_RANK": str(settings.node_rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(30, stop_grace_period + 30))}


def run_torchrun(command: list[str], nproc: int, extra_env: Mapping[str, str] | None = None,
                 show_agent_tracebacks: bool = False, mailbox: Mailbox | None = None,
                 stop_wait_s: float = 90, channel=None) -> TorchrunExit:
    """Run torchrun in the foreground and say how it ended.

    Ctrl-C reaches torchrun at once. A first SIGTERM, given the workers' `mailbox`, is left there as a stop request:
    they finish their step, save and exit 0, while torchrun told to stop would leave its rendezvous at once and
    signal the workers itself. It is passed on to torchrun only if torchrun still runs `stop_wait_s` later; a
    second one is passed on at once. `channel` (launch/job_channel.py) says when this node's workers are all done
    (finished, or stopped for a signal): torchrun then gets AGENT_GRACE_S to follow once every node's are, else
    AGENT_EXIT_S, and is killed after (a node whose agent was signalled never reaches torchrun's exit barrier, where
    the others' agents would wait 300 s); and when another node's worker ended the job, torchrun and this node's
    workers are ended at once. Its stderr passes through `AgentTracebackFilter`:
    when torchrun is told to stop (a worker's named error ends the attempts, or the user's Ctrl-C) or loses node
    0's store, its own Python traceback says nothing a user can act on."""
    env = {**os.environ, **(extra_env or {})}
    # torchrun would force 1 thread per worker with a warning; share the cores out instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))  # cores granted here
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    stderr = AgentTracebackFilter(sys.stderr.buffer, keep_all=show_agent_tracebacks)
    copier = threading.Thread(target=stderr.copy, args=(process.stderr,), daemon=True)
    copier.start()
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if signum == signal.SIGTERM and mailbox is not None and received.count(signum) == 1:
            mailbox.request_stop(signum)
            overdue = threading.Timer(stop_wait_s, lambda: process.poll() is None and process.send_signal(signum))
            overdue.daemon = True
            overdue.start()
            return
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    _workers_output["ran"] = True
    try:
        code = _wait(process, channel)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        copier.join(timeout=5)
    return TorchrunExit(code, received[0] if received else None, stderr.store_lost, stderr.rank_exchange_lost,
                        stderr.rendezvous_closed)


@dataclass(frozen=True)
class TorchrunExit:
    code: int
    signal: int | None  # the first signal the launcher received while torchrun ran
    store_lost: bool  # the agent lost its connection to the rendezvous store (node 0's agent died)
    rank_exchange_lost: bool = False  # the agent waited in vain for a node's share after a round (it died then)
    rendezvous_closed: bool = False  # another agent ended and closed the rendezvous (torchrun does as it exits)


AGENT_EXIT_S = 10  # after this node's workers are done, the most torchrun may take to follow
AGENT_GRACE_S = 1  # the same once every node's workers are done: no agent waits for another any more


def _wait(process: subprocess.Popen, channel) -> int:
    done_since = None
    while True:
        try:
            return process.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
        if channel is None:
            continue
        if channel.cut_off():  # this node's workers lost node 0 and its store does not answer: the agent would hang
            kill_tree(process.pid)
            return process.wait()
        if channel.cause is not None:  # another node's worker ended the job: nothing here is worth waiting for
            kill_tree(process.pid)
            return process.wait()
        if not channel.workers_done():
            continue
        done_since = done_since or time.monotonic()
        waited = time.monotonic() - done_since
        if waited > AGENT_EXIT_S or (waited > AGENT_GRACE_S and channel.all_done()):
            # the agent waits in the exit barrier, inside the store's C++ code, where Python never runs its SIGTERM
            # handler; its workers are gone, so nothing is lost by killing it (nor its interpreter's slow teardown)
            process.kill()
            return process.wait()


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` and every process below it (torchrun starts each worker in a session of its own; the bench and
    the tests stop runs with it too). The tree is listed first: a killed parent's children are re-parented and no
    longer found from it."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class AgentTracebackFilter:
    """Copies a stream line by line, leaving out each Python traceback of the agent that ends in torch elastic's
    SignalException (it was told to stop), RendezvousConnectionError (it lost the rendezvous store),
    RendezvousTimeoutError (the nodes did not meet within rdzv_timeout), RendezvousClosedError (another agent that
    ended closed the rendezvous) or a DistStoreError on the rendezvous's own keys (a node died as a round
    completed), which the launcher then reports in its own words; every other line, tracebacks of workers included,
    passes unchanged (all of them with `keep_all`). `store_lost`, `rendezvous_closed` and `rank_exchange_lost` tell
    which of the last three happened."""

    HIDDEN = (b"SignalException", b"RendezvousConnectionError", b"RendezvousTimeoutError", b"RendezvousClosedError")
    CHAINED = (b"The above exception was the direct cause", b"During handling of the above exception")
    # Python's logging.Handler.handleError: the block it prints when an exception interrupts a handler's emit, as
    # torch elastic's SignalException does when the stop signal comes while the agent is logging a line
    LOGGING_ERROR = b"--- Logging error ---"
    LOGGING_ERROR_ENDS = (b"Arguments: ", b"Use the traceback above")
    LOGGING_ERROR_MAX_LINES = 400  # a block that never ends is written out, not held for ever

    def __init__(self, sink: BinaryIO, keep_all: bool = False):
        self.sink, self.keep_all = sink, keep_all
        self.held: list[bytes] | None = None  # the lines of a traceback (with the ones chained to it) being read
        self.logging_error: list[bytes] | None = None  # the lines of a logging error block being read
        self.ended = False  # the held traceback reached its exception line; a chained one may follow
        self.store_lost = False
        self.rank_exchange_lost = False
        self.rendezvous_closed = False

    def copy(self, stream: BinaryIO) -> None:
        for line in iter(stream.readline, b""):
            self.feed(line)
        self.release()

    def feed(self, line: bytes) -> None:
        if b"RendezvousConnectionError" in line:
            self.store_lost = True
        if rank_exchange_timeout(line):
            self.rank_exchange_lost = True
        if b"RendezvousClosedError" in line:
            self.rendezvous_closed = True
        if self.keep_all:
            self._write(line)
            return
        if self.logging_error is not None or (self.held is None and line.startswith(self.LOGGING_ERROR)):
            self._hold_logging_error(line)
            return
        if self.held is None:
            if line.startswith(b"Traceback (most recent call last):"):
                self.held, self.ended = [line], False
            else:
                self._write(line)
            return
        if self.ended:  # between chained tracebacks: blank lines, "The above exception ...", the next traceback
            chained = any(held.startswith(self.CHAINED) for held in self.held[-3:])
            if not line.strip() or line.startswith(self.CHAINED) or (chained and line.startswith(b"Traceback")):
                self.held.append(line)
                self.ended = not line.startswith(b"Traceback")
                return
            self._decide()
            self.feed(line)
            return
        self.held.append(line)
        if not line[:1].isspace():  # the exception line ends this traceback of the chain
            self.ended = True

    def _hold_logging_error(self, line: bytes) -> None:
        """A logging error block is dropped whole when its exception is one of HIDDEN (the agent's line it
        interrupted is lost either way), and printed otherwise."""
        held = self.logging_error = [*(self.logging_error or []), line]
        if not (line.startswith(self.LOGGING_ERROR_ENDS) or len(held) >= self.LOGGING_ERROR_MAX_LINES):
            return
        self.logging_error = None
        if not (line.startswith(self.LOGGING_ERROR_ENDS) and any(word in held_line for held_line in held
                                                                  for word in self.HIDDEN)):
            self._write(b"".join(held))

    def _decide(self) -> None:
        """Print the held chain unless its last exception is one of HIDDEN."""
        last = next((line for line in reversed(self.held) if line.strip()), b"")
        if not (self.ended and (any(word in last for word in self.HIDDEN) or rank_exchange_timeout(last))):
            self._write(b"".join(self.held))
        self.held, self.ended = None, False

    def release(self) -> None:
        if self.held:
            self._decide()
        if self.logging_error:
            self._write(b"".join(self.logging_error))
            self.logging_error = None

    def _write(self, data: bytes) -> None:
        self.sink.write(data)
        self.sink.flush()


def rank_exchange_timeout(line: bytes) -> bool:
    """The agent's wait for the other agents' shares after a completed round timed out (its keys are the round's)."""
    return b"DistStoreError" in line and b"/torch.rendezvous." in line


# Whether workers ran under this launcher since its last line: a progress bar whose worker was stopped never ends
# its line, and its last piece may reach the terminal after torchrun has ended.
_workers_output = {"ran": False}


def end_workers_line() -> None:
    """Start the launcher's last line on a line of its own after workers ran: a stopped worker's unfinished
    progress bar would otherwise swallow it. At worst this leaves one blank line before it."""
    if _workers_output["ran"]:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _workers_output["ran"] = False
