"""Whole process trees: torchrun starts each worker in its own session, so killing an agent's process group leaves
its workers running as orphans. To stop a node the way a dead machine stops, kill the agent and every descendant."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All processes below `pid`, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` and everything below it (the list is taken before the first signal)."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            pass
