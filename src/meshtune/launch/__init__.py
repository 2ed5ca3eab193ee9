"""Launching: this node's settings (config / env / SLURM / PBS / PyTorchJob) and the torchrun that starts its
workers."""

from meshtune.launch.nodes import (NodeSettings, default_nproc_per_node, describe, detect_node_settings,
                                   expand_hostlist, node_range, torchrun_worker)
from meshtune.launch.torchrun import launch_env, needs_torchrun, run_torchrun, standalone_command, torchrun_command

__all__ = ["NodeSettings", "default_nproc_per_node", "describe", "detect_node_settings", "expand_hostlist",
           "launch_env", "needs_torchrun", "node_range", "run_torchrun", "standalone_command", "torchrun_command",
           "torchrun_worker"]
