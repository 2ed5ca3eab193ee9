"""Whole process trees, for the bench scripts and the tests. torchrun starts each worker in its own session, so
signalling a launcher or its process group leaves the workers running (and holding their GPUs): stopping a run means
signalling the launcher and every process below it."""

from __future__ import annotations

import socket

import psutil

from meshtune.launch.torchrun import kill_tree  # noqa: F401  (the one kill of a process tree)


def descendants(pid: int) -> list[int]:
    """All processes below `pid`; none once it is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (ended, not yet reaped by its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
