"""Whether this process is a torchrun worker: read by the launcher and the process group alike. Standard library
only, so `meshtune launch --dry-run` starts without importing torch."""

from __future__ import annotations

import os
from collections.abc import Mapping


def torchrun_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """A process torchrun started (it sets both). Not RANK/WORLD_SIZE alone: PyTorchJob sets those per pod."""
    return "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ


# The pid of the meshtune process that started torchrun: its workers stop when it is gone (launch/parent_watch.py).
LAUNCHER_PID = "MESHTUNE_LAUNCHER_PID"
