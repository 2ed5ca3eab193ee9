"""Fault injection for the recovery tests, in the spirit of torchft's: kill a chosen rank at a chosen point.

Set MESHTUNE_FAULT to one or more comma-separated faults:
- `save:STEP:RANK`: SIGKILL after this rank wrote its checkpoint shards, before the checkpoint is published;
- `raise:STEP:RANK`: a RuntimeError after optimizer step STEP;
- `raise-always:STEP:RANK`: the same in every attempt (an error no restart fixes);
- `slow:SECONDS`: every rank sleeps that long after each step, so a test can act on a run in progress;
  `slow:SECONDS:RANK`: that rank alone (a straggler);
- `storage:STEP:RANK`: after that step the rank meets the error a write gives on storage remounted read-only (in
  every attempt, as the storage stays so);
- `stop:STEP:RANK`: the rank stops itself with SIGSTOP after that step (a hung process, for the hang watchdog), once
  per job: a marker in the temporary directory, named by the job's run id, keeps it from firing again after the
  restart (a node whose agent restarts for another node's failure keeps its attempt count at 0).
- `nan:STEP:RANK`: that rank's loss, and so its gradients, is NaN in optimizer step STEP, in every attempt (what a
  bad sample or an overflow does).
`save`, `raise` and `stop` fire in the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restarted job can show
that it recovers. Unset, it costs one dictionary lookup per call.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import time
from pathlib import Path


def _faults() -> list[str]:
    return [fault.strip() for fault in os.environ.get("MESHTUNE_FAULT", "").split(",") if fault.strip()]


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _once(name: str) -> bool:
    """True the first time this job asks, on this machine."""
    marker = Path(tempfile.gettempdir(), f"meshtune-fault-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{name}")
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def maybe_die(point: str, step: int, rank: int) -> None:
    if f"{point}:{step}:{rank}" in _faults() and _first_attempt():
        print(f"meshtune fault injection: killing rank {rank} at {point} of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int, rank: int) -> None:
    """The faults that act after an optimizer step: `raise`, `raise-always`, `storage`, `slow`, `stop`."""
    faults = _faults()
    if not faults:
        return
    for fault in faults:
        if fault.startswith("slow:"):
            _, seconds, *only = fault.split(":")
            if not only or int(only[0]) == rank:
                time.sleep(float(seconds))
    if f"stop:{step}:{rank}" in faults and _once(f"stop-{step}-{rank}"):
        print(f"meshtune fault injection: stopping rank {rank} (SIGSTOP) after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if f"storage:{step}:{rank}" in faults:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    if f"raise-always:{step}:{rank}" in faults or (_first_attempt() and f"raise:{step}:{rank}" in faults):
        raise RuntimeError(f"meshtune fault injection: rank {rank} fails after step {step}")


def nan_loss(loss, step: int, rank: int):
    """`nan:STEP:RANK`: the micro-batch loss `loss` (a tensor) of that step on that rank times NaN."""
    if f"nan:{step}:{rank}" in _faults():
        return loss * float("nan")
    return loss
