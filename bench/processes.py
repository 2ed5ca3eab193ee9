"""Whole process trees, for the bench scripts. torchrun starts each worker in its own session, so signalling a
launcher or its process group leaves the workers running (and holding their GPUs): stopping a run means
signalling the launcher and every process below it. Linux only (/proc)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All processes below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the command name in stat may hold spaces and ')': the fields after the last ')' are fixed
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while the table was read
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` and everything below it. The tree is listed before the first signal: a killed parent's
    children are re-parented and could no longer be found from it."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            pass
