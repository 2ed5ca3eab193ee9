"""What meshtune says while it runs, through Python's logging.

Every module logs to its own logger under `meshtune` (`meshtune.train.loop`, `meshtune.launch.supervise`, ...).
`configure`, called once by the command line (in the launcher and in each torchrun worker), shows those records on
the console as the plain lines meshtune prints: on stdout (stderr for Python warnings, errors and the records that
ask for it), written above a progress bar rather than into it. Only global rank 0 speaks (`RankFilter`); with
`log_level_all_ranks` (config) or MESHTUNE_LOG_LEVEL_ALL_RANKS every rank does, each line tagged `[rank N]`.

Python warnings go through logging too (logging.captureWarnings: the `py.warnings` logger). One that every rank
raises alike (a library's deprecation) is rank 0's to show. A `RankWarning` is seen by the rank that raises it alone
(a rank that finds no random state of its own in the checkpoint it resumes): the console shows it from any rank,
once per message, tagged with the rank.

A program that embeds meshtune routes its records as any library's: a handler on `logging.getLogger("meshtune")`
receives every record of every rank (a `RankFilter` on it keeps rank 0's). Nothing is set on the root logger, and
records propagate to it as usual.
"""

from __future__ import annotations

import logging
import os
import re
import sys

from meshtune.errors import ConfigError
from meshtune.worker_env import torchrun_worker

LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "MESHTUNE_LOG_LEVEL"
ALL_RANKS_ENV = "MESHTUNE_LOG_LEVEL_ALL_RANKS"
TO_STDERR = {"console_stream": "stderr"}  # `extra=` of a record the console writes to stderr

# how logging.captureWarnings formats a RankWarning: "FILE:LINE: RankWarning: message"
_RANK_WARNING = re.compile(r":\d+: RankWarning: ")


class RankWarning(UserWarning):
    """A warning only the rank that raises it can see (its own state, files or device): shown from every rank."""


def level_number(name: str, where: str) -> int:
    """logging's number for a level name; a ConfigError naming `where` the name came from otherwise."""
    if not isinstance(name, str) or name.lower() not in LEVELS:
        raise ConfigError(f"{where}: {name!r} is not a log level; use one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def process_rank() -> int:
    """This process's global rank: the process group's once it is formed, torchrun's RANK before; 0 outside torchrun
    (a node's launcher, a run of one process: a PyTorchJob's RANK numbers its pods, not ranks)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if torchrun_worker():
        return int(os.environ.get("RANK", "0"))
    return 0


class RankFilter(logging.Filter):
    """Global rank 0's records from `level` up. Another rank's from `all_ranks` up when set; else only its
    RankWarnings, each message once."""

    def __init__(self, level: int = logging.INFO, all_ranks: int | None = None):
        super().__init__()
        self.level, self.all_ranks = level, all_ranks
        self._shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if process_rank() == 0:
            return record.levelno >= self.level
        if self.all_ranks is not None:
            return record.levelno >= self.all_ranks
        message = record.getMessage()
        if record.name != "py.warnings" or not _RANK_WARNING.search(message) or message in self._shown:
            return False
        self._shown.add(message)
        return True


class ConsoleFormatter(logging.Formatter):
    """A record's text as meshtune prints it; the lines of a rank other than 0 tagged `[rank N] `."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.name == "py.warnings":
            text = text.rstrip("\n")  # warnings.formatwarning ends its text with a newline
        rank = process_rank()
        if rank:
            text = "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))
        return text


class ConsoleHandler(logging.Handler):
    """meshtune's console: each record a line on stdout or stderr, drawn above a progress bar (tqdm.write), flushed."""

    def __init__(self, rank_filter: RankFilter):
        super().__init__()
        self.rank_filter = rank_filter
        self.addFilter(rank_filter)
        self.setFormatter(ConsoleFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            text = self.format(record)
            to_stderr = (record.levelno >= logging.ERROR or record.name == "py.warnings"
                         or getattr(record, "console_stream", None) == "stderr")
            stream = sys.stderr if to_stderr else sys.stdout  # read now: the streams a test or a caller swapped in
            tqdm.write(text, file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failing handler reports, never raises
            self.handleError(record)


def console_handler() -> ConsoleHandler | None:
    """The console handler on the `meshtune` logger, once `configure` (or a test) added it."""
    return next((h for h in logging.getLogger("meshtune").handlers if isinstance(h, ConsoleHandler)), None)


def configure(level: str | None = None) -> None:
    """The console of a command: meshtune's records from `level` up (else MESHTUNE_LOG_LEVEL, else info), global
    rank 0's only unless MESHTUNE_LOG_LEVEL_ALL_RANKS names a level for every rank; Python warnings through logging.
    Called again, it sets the levels anew on the same handler."""
    handler = console_handler()
    if handler is None:
        handler = ConsoleHandler(RankFilter())
        logging.getLogger("meshtune").addHandler(handler)
    given = level or os.environ.get(LEVEL_ENV) or "info"
    handler.rank_filter.level = level_number(given, "--log-level" if level else LEVEL_ENV)
    every = os.environ.get(ALL_RANKS_ENV)
    handler.rank_filter.all_ranks = level_number(every, ALL_RANKS_ENV) if every else None
    _lowest_level(handler)
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    if handler not in warnings_logger.handlers:
        warnings_logger.addHandler(handler)


def show_all_ranks(level: str | None) -> None:
    """The config key `log_level_all_ranks`: every rank's records from `level` up on the console (None: as
    MESHTUNE_LOG_LEVEL_ALL_RANKS says). Where no console is configured (meshtune embedded), the caller's
    handlers decide."""
    handler = console_handler()
    if handler is None or level is None:
        return
    handler.rank_filter.all_ranks = level_number(level, "log_level_all_ranks")
    _lowest_level(handler)


def _lowest_level(handler: ConsoleHandler) -> None:
    """The `meshtune` logger lets through what any rank may show; the handler's filter picks by rank."""
    levels = [handler.rank_filter.level, handler.rank_filter.all_ranks or handler.rank_filter.level]
    logging.getLogger("meshtune").setLevel(min(levels))
