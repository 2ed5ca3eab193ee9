"""Sharded, verified, atomically published checkpoints through torch.distributed.checkpoint (DCP)."""

from meshtune.checkpoint.final import final_problems, publish_final
from meshtune.checkpoint.manager import CheckpointManager
from meshtune.checkpoint.manifest import CheckpointError, read_manifest, verify
from meshtune.checkpoint.resume import CheckpointInfo, format_listing, list_checkpoints, select_resume
from meshtune.checkpoint.state import ModelOptimizerState, RNGState, TrainerState, TrainingProgress, training_state

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager", "ModelOptimizerState", "RNGState",
           "TrainerState", "TrainingProgress", "final_problems", "format_listing", "list_checkpoints", "publish_final",
           "read_manifest", "select_resume", "training_state", "verify"]
