"""The options every command takes (`--debug`, `--log-level`)."""

from __future__ import annotations

import argparse

from meshtune import logs


LOG_LEVEL_HELP = (f"the least severe of meshtune's log records shown (default: env {logs.LEVEL_ENV}, else info; "
                  f"--debug: debug); global rank 0's only, unless log_level_all_ranks or {logs.ALL_RANKS_ENV} "
                  f"names a level for every rank")


def debug_option() -> argparse.ArgumentParser:
    """`--debug` for each command: without a default of its own, so a command does not undo `meshtune --debug
    COMMAND` (meshtune's own `--debug` gives the default)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    options.add_argument("--log-level", choices=logs.LEVELS, default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    return options
