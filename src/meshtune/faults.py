"""Fault injection for the recovery tests, in the spirit of torchft's: kill a chosen rank at a chosen point.

Set MESHTUNE_FAULT=POINT:STEP:RANK. POINT `save`: SIGKILL after this rank wrote its checkpoint shards, before
the checkpoint is published; `raise`: a RuntimeError after optimizer step STEP. Both fire in the first attempt
only (TORCHELASTIC_RESTART_COUNT 0), so the restarted job can show that it recovers; `raise-always` fires in every
attempt (an error no restart fixes). Unset, it costs one dictionary lookup per call.
"""

from __future__ import annotations

import os
import signal


def maybe_die(point: str, step: int, rank: int) -> None:
    wanted = os.environ.get("MESHTUNE_FAULT")
    if not wanted or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if wanted == f"{point}:{step}:{rank}":
        print(f"meshtune fault injection: killing rank {rank} at {point} of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_raise(step: int, rank: int) -> None:
    wanted = os.environ.get("MESHTUNE_FAULT", "")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if wanted == f"raise-always:{step}:{rank}" or (first and wanted == f"raise:{step}:{rank}"):
        raise RuntimeError(f"meshtune fault injection: rank {rank} fails after step {step}")
