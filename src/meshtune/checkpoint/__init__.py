"""Sharded, verified, atomically published checkpoints through torch.distributed.checkpoint (DCP).

Each name loads its module on first use (PEP 562): `meshtune ckpt list` reads manifests and markers without
importing torch, which the modules that save and load (manager, state, final) need."""

from __future__ import annotations

import importlib

_MODULE_OF = {
    "CheckpointError": "manifest", "read_manifest": "manifest", "verify": "manifest",
    "CheckpointInfo": "resume", "format_listing": "resume", "list_checkpoints": "resume", "select_resume": "resume",
    "CheckpointManager": "manager",
    "final_problems": "final", "publish_final": "final", "unsealed_problems": "final",
    "ModelOptimizerState": "state", "RNGState": "state", "TrainerState": "state", "TrainingProgress": "state",
    "training_state": "state",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
