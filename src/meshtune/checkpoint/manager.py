"""Save, publish, prune and load checkpoints; every public method is called by every rank.

A save is published in three steps so that no reader ever sees half of one:
  1. all ranks write DCP shards into `checkpoint-N.tmp/`;
  2. each rank hashes (and fsyncs) the shards it wrote; rank 0 gathers them, which proves every write finished;
  3. rank 0 writes manifest.json and COMPLETE, renames to `checkpoint-N/` and starts pruning old checkpoints (in
     the background: checkpoint/retention.py).
Only rank 0 deletes anything: ranks deleting the same files race on shared storage (transformers #20988).
Every rank then waits for rank 0's outcome (the final barrier: nobody goes on before the rename), so a
failure raises on every rank instead of leaving some waiting at a collective.

In an object store (`checkpoint_dir` a URL; checkpoint/object_store.py) there is no rename: the shards go straight
to the checkpoint's own prefix through DCP's FsspecWriter, always in the background (`dcp.async_save`: training
waits only for the copy to CPU memory), each rank reads back and hashes what it uploaded, and COMPLETE, written
after the manifest, is what publishes it. A resume from the store reads each object once: every node's processes
fetch a share each into a node-local folder (`staging`), the checks run on that copy, and DCP loads it. A save
the store fails (an outage, throttling) is skipped, up to STORE_SAVES_SKIPPED in a row: training goes on, the newest
complete checkpoint stays the resume point and the next save tries again; one more stops the job, and so does a
failed save that must publish (the last one, or a stop's).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshtune.checkpoint.manifest import (CheckpointError, dcp_writer, delete_sealed, fsync_dir, hash_file, one_line,
                                          rank_errors, write_manifest)
from meshtune.checkpoint.object_store import StorePath, location
from meshtune.checkpoint.rank_group import RankGroup
from meshtune.checkpoint.resume import checkpoint_dir, list_checkpoints
from meshtune.checkpoint.resume_point import ResumePoint
from meshtune.checkpoint.retention import Retention
from meshtune.errors import lasting_storage_error
from meshtune.faults import maybe_die
from meshtune.units import byte_size

__all__ = ["RESUME_COPY", "CheckpointManager", "one_line"]  # one_line: a write error in one line (manifest.py)

logger = logging.getLogger(__name__)
RESUME_COPY = ".resume-copy"  # in output_dir: each node's copy of the checkpoint a resume from a store loads
STORE_SAVES_SKIPPED = 2  # failed saves in a row into an object store that training goes on after


@dataclass
class _Pending:
    """A save whose shards are (being) written but which is not yet published."""
    step: int
    tmp: Path
    info: dict[str, Any]
    wait: Callable[[], Any]  # returns once this rank's DCP write has finished
    staged_s: float  # seconds save() blocked the caller (the whole write when sync; the copy to CPU when async)
    started: float  # time.monotonic() when save() began


class CheckpointManager:
    """Owns `output_dir/checkpoint-*`: when to save, writing and publishing; retention (checkpoint/retention.py) after
    each publish, and the resume point's choice, verification and load (checkpoint/resume_point.py), with the ranks'
    collectives in checkpoint/rank_group.py.

    With `async_save`, `dcp.async_save` copies the state to CPU and writes it in a background thread on a
    dedicated gloo group (on the default group it aborted at exit in 3 of 8 runs); at most one save is in flight,
    and the next `save` or `wait` publishes it. Call `close()` (it waits) before the process group is destroyed.

    Collectives of a save, in the order every rank meets them: the barrier after rank 0 clears an interrupted
    attempt (`save`), DCP's own (its plan, and async its background write on the dedicated group), then in `wait`
    the gather of every rank's outcome and file hashes and the broadcast of rank 0's verdict (published, or why
    not). Retention starts on rank 0 inside the publish, before that broadcast, and deletes on its own thread while
    training goes on; the next `save` (before it writes), a resume's clean-up and `close` wait for it.
    """

    def __init__(self, output_dir: Path | StorePath | str, save_total_limit: int | None, async_save: bool, rank: int,
                 world_size: int, save_steps: int = 0, local_rank: int = 0, local_world_size: int = 1,
                 staging: Path | None = None):
        """`save_steps`: `maybe_save` writes a checkpoint every that many steps and at the last one (0: never);
        `save_at` adds steps to save at (save_strategy: epoch, once the run's epochs are known). `output_dir` may be
        an object store's URL (or StorePath): its saves are always asynchronous. `staging`: a node-local folder
        where a resume from a store copies the checkpoint it checks and loads (default: under the system's
        temporary folder); `local_rank` / `local_world_size` place this process on its node."""
        if save_total_limit is not None and save_total_limit < 1:
            raise CheckpointError(f"save_total_limit must be at least 1 (or unset to keep all), got {save_total_limit}")
        if world_size > 1 and not dist.is_initialized():
            raise CheckpointError("CheckpointManager with world_size > 1 needs an initialised process group")
        self.output_dir = location(output_dir)
        self.in_store = isinstance(self.output_dir, StorePath)
        async_save = async_save or self.in_store
        self.save_steps = save_steps
        self.save_steps_also: frozenset[int] = frozenset()
        self.save_total_limit = save_total_limit
        self.async_save = async_save
        self.rank = rank
        self.group = RankGroup.of(rank, world_size, local_rank, local_world_size)
        self.retention = Retention(self.output_dir, save_total_limit)
        # one folder per node, so that nodes sharing an output_dir never write the same files
        self.staging = ((staging or Path(tempfile.gettempdir()) / f"meshtune-resume-{os.getuid()}")
                        / f"node-{self.group.node}")
        self.resume = ResumePoint(self.output_dir, self.group, self.staging, self.retention)
        # new_group is collective: every rank builds the manager at the same point of the loop
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._pending: _Pending | None = None
        self.last_step: int | None = None  # the newest checkpoint this run published (or is publishing)
        self.published_step: int | None = None  # the newest checkpoint this run published
        self.failed_in_row = 0  # saves into the store that failed since the last published one
        self.last_save_s: float | None = None  # what this rank's newest published save cost: blocked + publishing
        self.on_published: Callable[[int, Path], None] = lambda step, path: None  # rank 0, after each publish

    def save_at(self, steps: frozenset[int]) -> None:
        """Also save after each of these optimizer steps (the ends of epochs), and at the last one."""
        self.save_steps_also = steps

    def maybe_save(self, step: int, state: dict[str, Any], info: dict[str, Any], last: bool,
                   before: Callable[[], None] = lambda: None) -> bool:
        """Save checkpoint `step` if it is due: every `save_steps` optimizer steps, at the steps of `save_at`, and
        at the last one when either is set. `before` runs first when one is due (the loop's check that the steps so
        far were finite: it may raise instead)."""
        periodic = bool(self.save_steps) and step % self.save_steps == 0
        if not (periodic or step in self.save_steps_also or (last and (self.save_steps or self.save_steps_also))):
            return False
        before()
        self.save(step, state, info, must_publish=last)
        return True

    def save(self, step: int, state: dict[str, Any], info: dict[str, Any], must_publish: bool = False) -> None:
        """Write `state` as checkpoint `step`; `info` (epoch, world size, parallel mode, mesh, config hash,
        versions, ...) becomes manifest.json. Sync: returns once published. Async: returns once staged.
        `must_publish` (the last save): a store's failure raises rather than being skipped (`_failed`)."""
        self.retention.join()  # the deletions of earlier publishes end before a new checkpoint takes their space
        self.wait()
        started, self.last_step = time.monotonic(), step
        tmp = checkpoint_dir(self.output_dir, step, tmp=not self.in_store)
        if self.rank == 0:
            self._clear(tmp)
        self.group.barrier()
        writer = dcp_writer(tmp)  # creates tmp; on a file system fsyncs every shard it writes
        if self.async_save:
            try:
                response = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            except Exception as error:
                if not self.in_store:
                    raise
                # the plan is made here, in this thread: a store that does not answer fails it on every rank
                self._failed(f"writing {tmp} failed; it is not published and {self._resume_point()}: "
                             f"{one_line(error)}", error, must_publish)
                return
            future = getattr(response, "upload_completion", response)  # newer torch may return AsyncSaveResponse
            self._pending = _Pending(step, tmp, {**info, "step": step}, future.result,
                                     time.monotonic() - started, started)
            return
        try:
            dcp.save(state, storage_writer=writer)
        except (CheckpointException, OSError) as error:  # a file system's (a store's saves are always async)
            raise CheckpointError(self._write_failure(tmp, error)) from error
        maybe_die("save", step, self.rank)
        self._pending = _Pending(step, tmp, {**info, "step": step}, lambda: None,
                                 time.monotonic() - started, started)
        self.wait()

    def wait(self, must_publish: bool = False) -> None:
        """Finish and publish the save in flight, if any (async mode: call before exit). A failure raises, except a
        store's within STORE_SAVES_SKIPPED in a row when the save need not publish (`_failed`)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        began = time.monotonic()
        error, hashes = None, {}
        try:
            pending.wait()
            if self.async_save:
                maybe_die("save", pending.step, self.rank)  # the shards written (uploaded), nothing published
            own = sorted((p for p in pending.tmp.iterdir() if p.name.startswith(f"__{self.rank}_")), key=str)
            hashes = {p.name: hash_file(p, fsync=True) for p in own}  # in a store: read back from it
        except (Exception, CheckpointException) as exc:  # reported through rank 0 below, so no rank is left waiting
            # at a collective (DCP's CheckpointException, what a failed background write raises, is no Exception)
            error = f"rank {self.rank}: {one_line(exc)}" if self.in_store else f"rank {self.rank}: {exc}"
        reports = self.group.gather((error, hashes))
        outcome = self._publish(pending, reports) if self.rank == 0 else None
        outcome = self.group.broadcast(outcome)
        if outcome:
            self._failed(outcome, None, must_publish)
            return
        self.published_step, self.failed_in_row = pending.step, 0
        self.last_save_s = pending.staged_s + time.monotonic() - began
        if self.rank == 0:
            self.on_published(pending.step, checkpoint_dir(self.output_dir, pending.step))

    def close(self) -> None:
        """Publish the save in flight and wait for retention's deletions (so `save_total_limit` holds when the job
        ends), then free the dedicated group."""
        try:
            self.wait(must_publish=True)
        finally:
            self.retention.join()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def select_resume(self, named: Path | None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The checkpoint to resume from and those passed over, chosen by every rank together (ResumePoint)."""
        return self.resume.select(named)

    def find_resume(self, named: Path | None, config: dict[str, Any], allowed: list[str] = ()
                    ) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
        """The checkpoint to resume from, its manifest and the notes for the user (ResumePoint.find)."""
        return self.resume.find(named, config, allowed)

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load checkpoint `path` into `state` in place on this world size; returns its manifest (ResumePoint)."""
        return self.resume.load(path, state)

    def _clear(self, target: Path | StorePath) -> None:
        """Rank 0, before a save: an interrupted earlier attempt at `target` removed (its shards must not mix with
        these); in a store, where the save writes the published prefix itself, also an earlier save of this step
        (another timeline's, from before resuming at an older checkpoint), deleted sealed."""
        if not self.in_store:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            return
        try:
            if target.is_dir():
                delete_sealed(target)
        except Exception as exc:  # the save's own write names the store's error on every rank
            logger.warning(f"warning: could not clear {target} before saving: {type(exc).__name__}: {exc}")

    def _failed(self, outcome: str, cause: Exception | None, must_publish: bool = False) -> None:
        """A save that was not published, the same on every rank: raised, except a store's (a brief outage or
        throttling passes) within STORE_SAVES_SKIPPED in a row when it need not publish, which rank 0 logs while
        training goes on and the next save tries again."""
        self.last_step = self.published_step  # not written: a stop's save at this step must not be skipped
        self.failed_in_row += 1
        if not self.in_store or must_publish or self.failed_in_row > STORE_SAVES_SKIPPED:
            more = (f" ({self.failed_in_row} saves in a row failed)" if self.in_store and self.failed_in_row > 1
                    else "")
            raise CheckpointError(outcome + more) from cause
        if self.rank == 0:
            logger.warning(f"warning: {outcome}. Training goes on and the next save tries again; "
                           f"{STORE_SAVES_SKIPPED + 1 - self.failed_in_row} more failures in a row stop the job")

    def _resume_point(self) -> str:
        """What stands after a failed save: the newest complete checkpoint, or that there is none."""
        try:
            newest = max((c.step for c in list_checkpoints(self.output_dir) if c.complete), default=None)
        except Exception:  # the store that failed the save may not answer a listing either
            return f"the newest complete checkpoint in {self.output_dir} stays the resume point"
        return (f"checkpoint-{newest} stays the resume point" if newest is not None
                else "no earlier checkpoint exists to resume from")

    def _write_failure(self, tmp: Path, error: Exception) -> str:
        """What a failed write tells the user: the path, the space left there, and what still stands."""
        full = "No space left" in str(error) or "Disk quota exceeded" in str(error)
        try:
            usage = shutil.disk_usage(self.output_dir)
            space = f"{byte_size(usage.free)} free of {byte_size(usage.total)}"
            # torch's zip writer loses the errno ("unexpected pos 704 vs 598"): the storage's own count says it
            full = full or usage.free < min(usage.total // 100, 64 << 20)
        except OSError:
            space = "free space unknown"
        newest = max((c.step for c in list_checkpoints(self.output_dir) if c.complete), default=None)
        keeps = (f"checkpoint-{newest} stays the resume point" if newest is not None
                 else "no earlier checkpoint exists to resume from")
        cause, advice = (": No space left on device", "; free space or lower save_total_limit") if full else ("", "")
        lasting = next((found for _, exc in rank_errors(error) if isinstance(exc, OSError)
                        and (found := lasting_storage_error(exc))), None)
        return (f"writing {tmp} failed{cause} ({space} on that storage{advice}); it is not published and {keeps}: "
                + (str(lasting) if lasting else one_line(error)))

    def _publish(self, pending: _Pending, reports: list[tuple[str | None, dict[str, Any]]]) -> str | None:
        """Rank 0: manifest, COMPLETE, rename, retention. Returns what went wrong, or None."""
        errors = [error for error, _ in reports if error]
        if errors:
            stands = f"; {self._resume_point()}" if self.in_store else ""
            return (f"checkpoint-{pending.step} was not saved ({pending.tmp} is left unpublished{stands}): "
                    f"{'; '.join(errors)}")
        try:
            files = {name: digest for _, hashes in reports for name, digest in hashes.items()}
            present = {p.name for p in pending.tmp.iterdir()}
            unseen = sorted(set(files) - present)
            if unseen:
                return (f"rank 0 cannot see {', '.join(unseen)} that other ranks wrote to {pending.tmp}: "
                        f"output_dir must be one storage that every node mounts at the same path")
            for name in sorted(present - set(files)):  # DCP's .metadata, written by rank 0
                files[name] = hash_file(pending.tmp / name, fsync=True)
            # how long training waited for the save, and how long it took to be published (written, fsynced and
            # hashed by every rank): what `stop_grace_period` and a save's cost are judged by
            timing = {"blocked_s": round(pending.staged_s, 3),
                      "published_s": round(time.monotonic() - pending.started, 3)}
            write_manifest(pending.tmp, {**pending.info, "save_seconds": timing}, files)
            if self.in_store:  # COMPLETE, written last, published it
                self.retention.apply(pending.step)
                return None
            final = checkpoint_dir(self.output_dir, pending.step)
            if final.exists():  # an earlier save of this step, from before resuming at an older checkpoint
                delete_sealed(final)
            os.rename(pending.tmp, final)
            fsync_dir(self.output_dir)
        except Exception as exc:  # every rank is waiting for this outcome
            stands = f"; {self._resume_point()}" if self.in_store else ""
            return f"publishing checkpoint-{pending.step} in {self.output_dir} failed{stands}: {exc}"
        self.retention.apply(pending.step)
        return None

