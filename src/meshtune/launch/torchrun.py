"""Starting the workers: meshtune runs the real torchrun for the user, on one machine or as one node of many."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import BinaryIO

from meshtune.launch.nodes import NodeSettings


def needs_torchrun(settings: NodeSettings) -> bool:
    """One process on one node trains in the launching process; anything more goes through torchrun."""
    return settings.multi_node or settings.nproc_per_node > 1


def standalone_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun with a standalone (local, free-port) c10d rendezvous, re-entering `meshtune` in each worker."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts", str(max_restarts), "-m", "meshtune", *argv]


def torchrun_command(settings: NodeSettings, argv: list[str], cfg) -> list[str]:
    """This node's torchrun: standalone on one node; c10d rendezvous at node 0's address:port across several.

    No `--node-rank` across nodes: torchrun ignores it for c10d (it only feeds the static backend, and warns
    when it is not 0) and orders agents itself (by host name or local_addr, then pid), so global rank 0 need
    not be on NODE_RANK 0. NODE_RANK 0 does host the rendezvous store (`is_host`): torch's own guess compares
    MASTER_ADDR with the host name's addresses and misses a second network (local_addr). The user's node rank still reaches the
    workers as MESHTUNE_NODE_RANK (see `launch_env`), so the startup check can spot two nodes given one rank.
    `read_timeout` is the store connection's patience too: a node started before node 0 waits that long.
    """
    if not settings.multi_node:
        return standalone_command(settings.nproc_per_node, argv, cfg.max_restarts)
    host = f"[{settings.master_addr}]" if ":" in settings.master_addr else settings.master_addr  # IPv6
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", settings.nnodes,
            "--nproc-per-node", str(settings.nproc_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{settings.master_port}",
            "--rdzv-id", settings.run_id,
            "--max-restarts", str(cfg.max_restarts),
            "--rdzv-conf", f"join_timeout={cfg.rdzv_timeout},read_timeout={cfg.rdzv_timeout},"
                           f"is_host={int(settings.node_rank == 0)}",
            *(["--local-addr", cfg.local_addr] if cfg.local_addr else []),
            "-m", "meshtune", *argv]


def launch_env(settings: NodeSettings) -> dict[str, str]:
    """Variables torchrun and its workers get on top of ours.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers get a store of their own each attempt instead of sharing the
    agent's rendezvous store. With the shared one, restarted workers met the last attempt's keys (gloo connected
    to the dead workers' addresses and failed with "Connection refused" on every restart, torch 2.13 on one
    node), and a dead node's restarted agent never rejoined (c10d across nodes).
    """
    return {"MESHTUNE_NODE_RANK": str(settings.node_rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_torchrun(command: list[str], nproc: int, extra_env: Mapping[str, str] | None = None,
                 show_agent_tracebacks: bool = False) -> int:
    """Run torchrun in the foreground; Ctrl-C and SIGTERM reach it, and its exit code is ours. Its stderr passes
    through `AgentTracebackFilter`: when torchrun is told to stop (a worker's named error ends the attempts, or
    the user's Ctrl-C), its own Python traceback says nothing a user can act on."""
    env = {**os.environ, **(extra_env or {})}
    # torchrun would force 1 thread per worker with a warning; share the cores out instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))  # cores granted here
    process = subprocess.Popen(command, env=env, stderr=None if show_agent_tracebacks else subprocess.PIPE)
    copier = None
    if process.stderr is not None:
        copier = threading.Thread(target=AgentTracebackFilter(sys.stderr.buffer).copy, args=(process.stderr,),
                                  daemon=True)
        copier.start()
    forward = lambda signum, _frame: process.send_signal(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if copier is not None:
            copier.join(timeout=5)


class AgentTracebackFilter:
    """Copies a stream line by line, leaving out each Python traceback that ends in torch elastic's
    SignalException (the agent reporting that it was told to stop); every other line, tracebacks of workers
    included, passes unchanged."""

    def __init__(self, sink: BinaryIO):
        self.sink = sink
        self.held: list[bytes] | None = None  # the lines of a traceback being read

    def copy(self, stream: BinaryIO) -> None:
        for line in iter(stream.readline, b""):
            self.feed(line)
        self.release()

    def feed(self, line: bytes) -> None:
        if self.held is None:
            if line.startswith(b"Traceback (most recent call last):"):
                self.held = [line]
            else:
                self._write(line)
            return
        self.held.append(line)
        if not line[:1].isspace():  # the exception line ends the traceback
            if b"SignalException" not in line:
                self._write(b"".join(self.held))
            self.held = None

    def release(self) -> None:
        if self.held:
            self._write(b"".join(self.held))
        self.held = None

    def _write(self, data: bytes) -> None:
        self.sink.write(data)
        self.sink.flush()
