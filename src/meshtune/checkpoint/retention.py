"""Which checkpoints stay: `save_total_limit` applied by rank 0 after each publish, on a thread of its own so that
training goes on while old checkpoints are deleted, and deletions a killed process left half done finished.

What the thread may touch is fixed when the publish starts it: only steps up to the checkpoint just published, so
never a save being written (always a higher step) nor the newest complete checkpoint; a checkpoint beyond the
limit is deleted only while newer complete ones stand, which resume picks first. Deletion is sealed
(manifest.delete_sealed): a checkpoint is renamed to `.deleting` (in a store, marked and loses COMPLETE) first, so
one cut short is never resumed from, and is finished here at the next publish or resume. One thread at a time: the
next publish's retention, a resume's clean-up and `join` (the manager calls it before each save writes, so old
checkpoints leave before a new one takes their space, and at close, so `save_total_limit` holds when the job ends)
wait for the previous deletions. A deletion that fails is logged with its path and reason and kept in `failures`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from meshtune.checkpoint.manifest import delete_sealed, finish_deletions
from meshtune.checkpoint.object_store import StorePath
from meshtune.checkpoint.resume import CheckpointInfo, list_checkpoints

logger = logging.getLogger(__name__)


class Retention:
    def __init__(self, output_dir: Path | StorePath, save_total_limit: int | None):
        self.output_dir = output_dir
        self.save_total_limit = save_total_limit
        self.failures: list[tuple[Path | StorePath, str]] = []  # every deletion that failed: its path, the reason
        self._thread: threading.Thread | None = None

    def apply(self, newest: int) -> None:
        """Rank 0, after publishing checkpoint `newest`: once the previous deletions are done, start deleting (in
        the background) what `doomed` names."""
        self.join()
        self._thread = threading.Thread(target=self._prune, args=(newest,), name="meshtune-retention")
        self._thread.start()

    def join(self) -> None:
        """Wait for the deletions in flight, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def doomed(self, newest: int) -> list[CheckpointInfo]:
        """What retention deletes after publishing `newest`, in step order: complete checkpoints beyond the newest
        `save_total_limit` up to `newest`, and older leftovers: .tmp ones (interrupted saves) and published names
        without COMPLETE (a deletion cut short by a meshtune that removed COMPLETE first, or by hand), neither ever
        resumed from. Higher steps are another timeline (a run that went further before this one resumed from an
        older checkpoint, or a corrupt one resume skipped): they are left alone here, and replaced when this run
        saves those steps."""
        checkpoints = [c for c in list_checkpoints(self.output_dir) if c.step <= newest]
        complete = [c for c in checkpoints if c.complete]
        if not complete:
            return []
        doomed = [c for c in checkpoints if not c.complete and c.step < newest]
        if self.save_total_limit is not None:
            doomed += complete[:-self.save_total_limit]
        return sorted(doomed, key=lambda c: (c.step, not c.is_tmp))

    def finish_deletions(self) -> None:
        """Rank 0: the deletions a process killed while deleting left (`.deleting` directories, or prefixes with
        their `.deleting` marker), finished, once this process's own are done."""
        self.join()
        self._finish_deletions()

    def _prune(self, newest: int) -> None:
        """The thread's work: every failure is reported here, as no caller waits for its result."""
        self._finish_deletions()
        try:
            doomed = self.doomed(newest)
        except Exception as error:
            self._failed(self.output_dir, error, "list the checkpoints in")
            return
        for checkpoint in doomed:
            try:
                delete_sealed(checkpoint.path)
            except Exception as error:
                self._failed(checkpoint.path, error, "delete old checkpoint")

    def _finish_deletions(self) -> None:
        try:
            if not self.output_dir.is_dir():
                return
            for path in finish_deletions(self.output_dir):
                logger.info(f"finished deleting {path.name} (a deletion cut short by a process that stopped)")
        except Exception as error:
            self._failed(self.output_dir, error, "finish deleting old checkpoints in")

    def _failed(self, path: Path | StorePath, error: Exception, doing: str) -> None:
        reason = str(error) or type(error).__name__
        self.failures.append((path, reason))
        logger.warning(f"warning: could not {doing} {path}: {reason}")
