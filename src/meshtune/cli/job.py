"""What `train`, `launch`, `doctor` and `preview` share: the config and its overrides as arguments, and the config
loaded as every torchrun worker will load it."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from meshtune import logs
from meshtune.errors import MeshtuneError

logger = logging.getLogger(__name__)


def job_arguments() -> argparse.ArgumentParser:
    """The config and its overrides, as `train`, `launch` and `doctor` take them."""
    arguments = argparse.ArgumentParser(add_help=False)
    arguments.add_argument("config", nargs="?",
                           help="YAML config file (meshtune's or LLaMA-Factory's); optional with --key value flags")
    arguments.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    return arguments


def load_training_config(args: argparse.Namespace):
    """The config and the `train` arguments every torchrun worker gets; warnings printed once per node."""
    import os

    from meshtune.compat.job_config import load_job_config
    from meshtune.mailbox import Mailbox
    from meshtune.worker_env import torchrun_worker

    if args.config is not None and "=" in args.config and not Path(args.config).is_file():
        args.overrides.insert(0, args.config)  # `meshtune train --flag v key=value`: no YAML given
        args.config = None
    if args.config is None and not args.flags:
        raise MeshtuneError("no config: give a YAML file (meshtune train cfg.yaml) or --key value flags "
                            "(meshtune train --model_name_or_path DIR --data_path train.json ...)")
    loaded = load_job_config(args.config, args.overrides, args.flags)
    # meshtune's launcher speaks for its workers; under the user's own torchrun, global rank 0 does
    if not torchrun_worker() or (Mailbox.of_launcher() is None and os.environ.get("RANK") == "0"):
        for line in loaded.warnings:
            logger.warning(f"meshtune: warning: {line}", extra=logs.TO_STDERR)
    level = log_level(args)  # the workers' console as this process's
    argv = ["train", *(["--log-level", level] if level else []), *([args.config] if args.config else []),
            *args.overrides, *args.flag_tokens]
    return loaded.config, argv


def log_level(args: argparse.Namespace) -> str | None:
    """--log-level, or debug with --debug; None leaves it to MESHTUNE_LOG_LEVEL."""
    return args.log_level or ("debug" if args.debug else None)
