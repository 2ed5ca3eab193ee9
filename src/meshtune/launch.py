"""Starting the workers: on one machine with several processes, meshtune runs the real torchrun for the user."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch


def default_nproc_per_node() -> int:
    """One process per visible GPU; one on CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def standalone_command(nproc: int, argv: list[str]) -> list[str]:
    """torchrun with a standalone (local, free-port) c10d rendezvous, re-entering `meshtune` in each worker."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "meshtune", *argv]


def run_torchrun(command: list[str], nproc: int) -> int:
    """Run torchrun in the foreground; Ctrl-C and SIGTERM reach it, and its exit code is ours."""
    env = os.environ.copy()
    # torchrun would force 1 thread per worker with a warning; share the cores out instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    process = subprocess.Popen(command, env=env)
    forward = lambda signum, _frame: process.send_signal(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
