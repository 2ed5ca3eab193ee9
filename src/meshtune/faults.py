"""Fault injection for the recovery tests, in the spirit of torchft's: kill a chosen rank at a chosen point.

Set MESHTUNE_FAULT=POINT:STEP:RANK (POINT: `save` = after this rank wrote its checkpoint shards, before the
checkpoint is published). It fires in the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restarted
job can show that it recovers. Unset, it costs one dictionary lookup per checkpoint.
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
