"""Which checkpoints stay: `save_total_limit` applied by rank 0 after each publish, and deletions a killed process
left half done finished. Deletion is sealed (manifest.delete_sealed): a checkpoint loses COMPLETE first, so one cut
short is never resumed from, and is finished here at the next publish or resume."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from meshtune.checkpoint.manifest import delete_sealed, finish_deletions
from meshtune.checkpoint.object_store import StorePath
from meshtune.checkpoint.resume import list_checkpoints

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    output_dir: Path | StorePath
    save_total_limit: int | None

    @property
    def _failures(self) -> type[BaseException]:
        """What a deletion that fails raises and retention warns about: OSError on a file system, a store client's
        own errors in a store."""
        return Exception if isinstance(self.output_dir, StorePath) else OSError

    def apply(self, newest: int) -> None:
        """Rank 0: keep the newest `save_total_limit` complete checkpoints up to `newest` (the one just published)
        and drop .tmp leftovers older than it. Higher steps are another timeline (a run that went further before
        this one resumed from an older checkpoint, or a corrupt one resume skipped): they are left alone here, and
        replaced when this run saves those steps."""
        self.finish_deletions()
        checkpoints = [c for c in list_checkpoints(self.output_dir) if c.step <= newest]
        complete = [c for c in checkpoints if c.complete]
        if not complete:
            return
        # older leftovers: .tmp ones (interrupted saves) and published names without COMPLETE (a deletion cut short
        # by a meshtune that removed COMPLETE first, or by hand); neither is ever resumed from
        doomed = [c for c in checkpoints if not c.complete and c.step < newest]
        if self.save_total_limit is not None:
            doomed += complete[:-self.save_total_limit]
        for checkpoint in doomed:
            try:
                delete_sealed(checkpoint.path)
            except self._failures as error:
                warnings.warn(f"could not delete old checkpoint {checkpoint.path}: {error}", stacklevel=2)

    def finish_deletions(self) -> None:
        """Rank 0: the deletions a process killed while deleting left (`.deleting` directories, or prefixes with
        their `.deleting` marker), finished."""
        try:
            if not self.output_dir.is_dir():
                return
            for path in finish_deletions(self.output_dir):
                logger.info(f"finished deleting {path.name} (a deletion cut short by a process that stopped)")
        except self._failures as error:
            warnings.warn(f"could not finish deleting old checkpoints in {self.output_dir}: {error}", stacklevel=2)
