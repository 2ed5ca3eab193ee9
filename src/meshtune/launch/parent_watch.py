"""A node's workers stop with its launcher, as they would with its machine.

torchrun starts each worker in a session of its own, so nothing ends a worker whose torchrun agent or meshtune
launcher was killed (the OOM killer, a wrong PID): orphaned, it trained on, and the other nodes' agents then waited
300 s in torchrun's exit barrier for the dead one. Each worker watches both from a thread: its parent (the agent)
gone, it is re-parented; the launcher gone, the agent is re-parented. Either way the worker exits at once, after
killing the agent if it is still there (it would restart the workers, or wait in the rendezvous, for nobody). The
other nodes then see a dead node: they restart their workers and wait for it to be launched again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil

from meshtune.worker_env import LAUNCHER_PID

POLL_S = 1.0


def watch_parents(poll_s: float = POLL_S) -> threading.Thread:
    """In a torchrun worker: start the watch (a daemon thread) over its agent and, when a meshtune launcher
    started torchrun, that launcher."""
    agent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_PID, "0")) or None
    thread = threading.Thread(target=_watch, args=(agent, launcher, poll_s), name="meshtune-parent-watch",
                              daemon=True)
    thread.start()
    return thread


def _watch(agent: int, launcher: int | None, poll_s: float) -> None:
    while not (gone := orphaned(agent, launcher)):
        time.sleep(poll_s)
    try:  # stderr is a pipe to the launcher, which may be the one gone
        print(f"meshtune: rank {os.environ.get('RANK', '?')} stops: {gone}; this node's workers stop with it, as on "
              f"a dead machine", file=sys.stderr, flush=True)
    except OSError:
        pass
    if os.getppid() == agent:  # the agent outlived the launcher: end it too, so it restarts nothing
        try:
            os.kill(agent, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(1)


def orphaned(agent: int, launcher: int | None) -> str | None:
    """Why this worker lost its agent or the launcher above it; None while both are there. By re-parenting, not
    by pid: a killed launcher whose own parent has not reaped it yet still has a pid (a zombie)."""
    if os.getppid() != agent:
        return f"this node's torchrun agent (pid {agent}) is gone"
    if launcher is not None and parent_of(agent) not in (launcher, None):
        return f"this node's meshtune launcher (pid {launcher}) is gone"
    return None


def parent_of(pid: int) -> int | None:
    """The parent of `pid`; None where it is gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None
