"""How a command ends, in a worker or alone: a `MeshtuneError` is printed once without a traceback (the launcher
prints it last and tells the other nodes) and ends every restart; an error every restart would meet again (storage
read-only, full or forbidden, or a worker failing exactly as before) becomes one; a lost peer is said in one line and
left to torchrun's restart; any other crash is raised for torchrun to restart the workers. `--debug` raises all."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from meshtune.errors import MeshtuneError, lasting_storage_error
from meshtune.launch.supervise import (lost_peers, repeated_failure, report_to_launcher, stop_restarts,
                                       worker_label)
from meshtune.launch.torchrun import end_workers_line


def restart_cannot_fix(exc: Exception) -> MeshtuneError | None:
    """The error as a MeshtuneError when every restart would meet it again, so the job stops at once with it as
    the last line: storage that is read-only, full or forbidden, or a worker failing exactly as in an earlier
    attempt (its traceback is printed first). None for anything a restart may cure."""
    if isinstance(exc, OSError) and (lasting := lasting_storage_error(exc)) is not None:
        return lasting
    repeated = repeated_failure(exc)
    if repeated is not None:
        traceback.print_exc()
    return repeated


def run_under_exit_policy(command: Callable[[], int], debug: bool) -> int:
    """`command()`'s exit code, its errors ended as the module says."""
    try:
        try:
            return command()
        except MeshtuneError:
            raise
        except Exception as exc:
            lasting = None if debug else restart_cannot_fix(exc)
            if lasting is None and not debug and lost_peers(exc):
                return 1  # said in one line; torchrun restarts the workers
            if lasting is None:
                raise  # a crash another attempt may not meet: torchrun restarts the workers
            raise lasting from exc
    except MeshtuneError as exc:
        if debug:
            raise
        reported = report_to_launcher(str(exc))  # the launcher prints it once, last, and tells the other nodes
        label = worker_label()
        if label is not None and not reported:  # under the user's own torchrun one worker per node speaks
            end_workers_line()
            print(f"meshtune: error{label}: {exc}", file=sys.stderr)
        stop_restarts()  # the same error would end every attempt
        return getattr(exc, "exit_code", 1)
    except KeyboardInterrupt:
        print("meshtune: interrupted", file=sys.stderr)
        return 130
