"""Save, publish, prune and load checkpoints; every public method is called by every rank.

A save is published in three steps so that no reader ever sees half of one:
  1. all ranks write DCP shards into `checkpoint-N.tmp/`;
  2. each rank hashes (and fsyncs) the shards it wrote; rank 0 gathers them, which proves every write finished;
  3. rank 0 writes manifest.json and COMPLETE, renames to `checkpoint-N/` and prunes old checkpoints.
Only rank 0 deletes anything: ranks deleting the same files race on shared storage (transformers #20988).
Every rank then waits for rank 0's outcome (the final barrier: nobody goes on before the rename), so a
failure raises on every rank instead of leaving some waiting at a collective.

In an object store (`checkpoint_dir` a URL; checkpoint/object_store.py) there is no rename: the shards go straight
to the checkpoint's own prefix through DCP's FsspecWriter, always in the background (`dcp.async_save`: training
waits only for the copy to CPU memory), each rank reads back and hashes what it uploaded, and COMPLETE, written
after the manifest, is what publishes it. A resume from the store reads each object once: every node's processes
fetch a share each into a node-local folder (`staging`), the checks run on that copy, and DCP loads it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshtune.checkpoint.fetch import fetch_checked
from meshtune.checkpoint.manifest import (COMPLETE, CheckpointError, dcp_reader, dcp_writer, delete_sealed,
                                          file_problems, finish_deletions, fsync_dir, hash_file, read_manifest, share,
                                          verify, write_manifest)
from meshtune.checkpoint.object_store import StorePath, location
from meshtune.checkpoint.resume import checkpoint_dir, list_checkpoints, select_resume, set_aside
from meshtune.checkpoint.state import ModelOptimizerState, RNGState
from meshtune.config import key_default, math_hash
from meshtune.faults import maybe_die
from meshtune.logs import RankWarning
from meshtune.units import byte_size

logger = logging.getLogger(__name__)
RESUME_COPY = ".resume-copy"  # in output_dir: each node's copy of the checkpoint a resume from a store loads


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
    """Owns `output_dir/checkpoint-*`: save (sync or async), publish, retention, resume selection and load.

    With `async_save`, `dcp.async_save` copies the state to CPU and writes it in a background thread on a
    dedicated gloo group (on the default group it aborted at exit in 3 of 8 runs); at most one save is in flight,
    and the next `save` or `wait` publishes it. Call `close()` (it waits) before the process group is destroyed.
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
        self.world_size = world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        # one folder per node, so that nodes sharing an output_dir never write the same files
        self._copied: Path | None = None  # this node's copy of the checkpoint select_resume chose in a store
        self.staging = ((staging or Path(tempfile.gettempdir()) / f"meshtune-resume-{os.getuid()}")
                        / f"node-{rank // local_world_size}")
        self._distributed = dist.is_initialized() and world_size > 1
        # new_group is collective: every rank builds the manager at the same point of the loop
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._pending: _Pending | None = None
        self.last_step: int | None = None  # the newest checkpoint this run published (or is publishing)
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
        self.save(step, state, info)
        return True

    def save(self, step: int, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Write `state` as checkpoint `step`; `info` (epoch, world size, parallel mode, mesh, config hash,
        versions, ...) becomes manifest.json. Sync: returns once published. Async: returns once staged."""
        self.wait()
        started, self.last_step = time.monotonic(), step
        tmp = checkpoint_dir(self.output_dir, step, tmp=not self.in_store)
        if self.rank == 0:
            self._clear(tmp)
        self._barrier()
        writer = dcp_writer(tmp)  # creates tmp; on a file system fsyncs every shard it writes
        if self.async_save:
            try:
                response = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            except Exception as error:
                if not self.in_store:
                    raise
                # the plan is made here, in this thread: a store that does not answer fails it on every rank
                raise CheckpointError(f"writing {tmp} failed; it is not published and {self._resume_point()}: "
                                      f"{one_line(error)}") from error
            future = getattr(response, "upload_completion", response)  # newer torch may return AsyncSaveResponse
            self._pending = _Pending(step, tmp, {**info, "step": step}, future.result,
                                     time.monotonic() - started, started)
            return
        try:
            dcp.save(state, storage_writer=writer)
        except (CheckpointException, OSError) as error:
            raise CheckpointError(self._write_failure(tmp, error)) from error
        maybe_die("save", step, self.rank)
        self._pending = _Pending(step, tmp, {**info, "step": step}, lambda: None,
                                 time.monotonic() - started, started)
        self.wait()

    def wait(self) -> None:
        """Finish and publish the save in flight, if any (async mode: call before exit)."""
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
        reports = self._gather((error, hashes))
        outcome = self._publish(pending, reports) if self.rank == 0 else None
        outcome = self._broadcast(outcome)
        if outcome:
            raise CheckpointError(outcome)
        self.last_save_s = pending.staged_s + time.monotonic() - began
        if self.rank == 0:
            self.on_published(pending.step, checkpoint_dir(self.output_dir, pending.step))

    def close(self) -> None:
        """Publish the save in flight, then free the dedicated group."""
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def select_resume(self, named: Path | None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """`select_resume` decided by rank 0 (it lists the checkpoints, judges them and moves damaged ones aside),
        each candidate's files hashed by every rank, a share each (`_verify_together`); the answer given to every
        rank."""
        answer: Any = None
        if self.rank == 0:
            try:
                self._finish_deletions()
                path, skipped = select_resume(self.output_dir, named, check=self._verify_together)
                answer = path, [self._aside(skip, reason) for skip, reason in skipped]
            except (CheckpointError, OSError) as error:  # every rank waits for this answer
                answer = str(error)
            finally:
                self._broadcast(None)  # no further candidate: the other ranks leave `_hash_shares`
        else:
            self._hash_shares()
        answer = self._broadcast(answer)  # every rank's fetches are done: rank 0 gathered their checks
        chosen = None if isinstance(answer, str) else answer[0]
        self._copied = self._copy_of(chosen) if isinstance(chosen, StorePath) else None
        if self.local_rank == 0:
            self._drop_copies(keep=self._copied)
        if isinstance(answer, str):
            raise CheckpointError(answer)
        return answer

    def _verify_together(self, path: Path) -> list[str]:
        """Rank 0: `verify(path)`, with the listed files dealt across the ranks (`share`), each hashing its own at
        the same time; rank 0 gathers what they found and checks the rest (marker, manifest, unlisted files, DCP's
        index)."""
        in_store = isinstance(path, StorePath)
        if not self._distributed and not in_store:
            return verify(path)

        def check_files(listed: dict[str, dict[str, Any]]) -> dict[str, str]:
            self._broadcast((str(path), listed))  # the manifest rank 0 read: every rank deals the same shares
            found = self._check_share(path, listed)
            for theirs in self._gather(found)[1:]:
                found.update(theirs)
            return found

        return verify(path, check_files, copy=self._copy_of(path) if in_store else None)

    def _hash_shares(self) -> None:
        """The other ranks: check their share of each candidate rank 0 names, until it names none."""
        while (candidate := self._broadcast(None)) is not None:
            path, listed = candidate
            try:
                found = self._check_share(location(path), listed)
            except Exception as exc:  # reported through rank 0, so no rank is left waiting at the gather
                found = {f"rank {self.rank}": f"rank {self.rank} could not check its files: {exc}"}
            self._gather(found)

    def _check_share(self, path: Path | StorePath, listed: dict[str, dict[str, Any]]) -> dict[str, str]:
        """This rank's share of the listed files checked. In a store, the share of its node's processes, fetched
        into the node's copy and checked there: each node reads every object once, and loads that copy."""
        if isinstance(path, StorePath):
            names = share(listed, self.local_world_size)[self.local_rank]
            return fetch_checked(path, listed, names, self._copy_of(path))
        return file_problems(path, listed, share(listed, self.world_size)[self.rank])

    def _copy_of(self, path: StorePath) -> Path:
        """Where this node copies checkpoint `path` of a store while a resume checks and loads it."""
        return self.staging / path.name

    def _drop_copies(self, keep: Path | None) -> None:
        """This node's local process 0, once every rank's fetches are done: the copies other than `keep` (the one
        to load) deleted."""
        if not self.staging.is_dir():
            return
        for copy in self.staging.iterdir():
            if copy != keep:
                shutil.rmtree(copy, ignore_errors=True)

    @staticmethod
    def _aside(path: Path, reason: str) -> tuple[Path, str]:
        """A published checkpoint passed over because it failed verification is moved aside (a save of its step
        would otherwise replace it, and retention could delete it); others are left as they are."""
        if path.name.endswith(".tmp") or not (path / COMPLETE).is_file():
            return path, reason
        return path, f"{reason}; moved aside to {set_aside(path).name}"

    def find_resume(self, named: Path | None, config: dict[str, Any], allowed: list[str] = ()
                    ) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
        """The checkpoint to resume from (`named`, or the newest good one where None; None if there is none), its
        manifest, and warnings for the user (the checkpoints passed over and why). A checkpoint written under other
        values of `config` (the run's math) is an error naming the keys, unless each is in `allowed`."""
        path, skipped = self.select_resume(named)
        notes = [f"warning: not resuming from {skip.name}: {reason}" for skip, reason in skipped]
        if path is None:
            return None, None, notes
        manifest = read_manifest(path)
        saved = manifest.get("config")
        if saved is None:  # written before checkpoints kept their config: only the hash can be compared
            if manifest.get("config_hash") != math_hash(config):
                notes.append(f"warning: {path.name} was written with another config (its manifest keeps only the "
                             f"hash); resuming anyway")
            return path, manifest, notes
        # a key the checkpoint predates counts at its default: the run computed what that default computes
        changed = {key: (saved.get(key), value) for key, value in config.items()
                   if saved.get(key) != value and not (key not in saved and value == key_default(key))}
        refused = [key for key in changed if key not in allowed]
        if refused:
            listing = "; ".join(f"{key}: {changed[key][0]!r} -> {changed[key][1]!r}" for key in refused)
            raise CheckpointError(
                f"{path} was written with other values of the run's math: {listing}. To continue it with these "
                f"values, add the keys to resume_allow_changed (e.g. resume_allow_changed: [{', '.join(refused)}]); "
                f"for a new run use another output_dir or resume_from_checkpoint: none")
        if changed:
            notes.append(f"resuming {path.name} with changed {', '.join(changed)} (resume_allow_changed)")
        return path, manifest, notes

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load checkpoint `path` into `state` in place, resharding onto this world size; returns its manifest.

        A rank the checkpoint has no random state for (it was saved by fewer ranks) keeps its own streams:
        its RNGState stays `restored = False`, and a warning says so.
        """
        path = location(path)
        manifest = read_manifest(path)
        # from a store: the copy `select_resume` fetched and checked (the same answer on every rank)
        copy = self._copied if isinstance(path, StorePath) and self._copied == self._copy_of(path) else None
        source = copy or path
        saved = set(dcp_reader(source).read_metadata().state_dict_metadata)
        request = {}
        for name, value in state.items():
            if isinstance(value, RNGState) and f"{name}.{value.key}" not in saved:
                warnings.warn(f"rank {self.rank}: {path.name} was saved by {manifest.get('world_size', '?')} ranks "
                              f"and holds no random state for this rank; its random streams keep their seed",
                              RankWarning, stacklevel=2)
                continue
            if isinstance(value, ModelOptimizerState):  # a list of groups has its first group's keys
                value.reading_by_name = not any(key.startswith(f"{name}.optim.param_groups.0.") for key in saved)
            request[name] = value
        try:
            dcp.load(request, storage_reader=dcp_reader(source))
        except CheckpointException as error:
            raise CheckpointError(f"cannot load {path} (was it saved by another model or finetuning type? "
                                  f"its manifest: world_size {manifest.get('world_size', '?')}, parallel "
                                  f"{manifest.get('parallel', '?')}): {one_line(error)}") from error
        finally:
            for value in request.values():
                if isinstance(value, ModelOptimizerState):
                    value.reading_by_name = None
        state.update(request)  # dcp.load replaces plain (non-Stateful) values in the dict it was given
        if copy is not None:
            self._copied = None
            self._barrier()  # every process of the node has read the copy
            if self.local_rank == 0:
                shutil.rmtree(copy, ignore_errors=True)
        return manifest

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
        return (f"writing {tmp} failed{cause} ({space} on that storage{advice}); it is not published and {keeps}: "
                f"{one_line(error)}")

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
                self._apply_retention(pending.step)
                return None
            final = checkpoint_dir(self.output_dir, pending.step)
            if final.exists():  # an earlier save of this step, from before resuming at an older checkpoint
                delete_sealed(final)
            os.rename(pending.tmp, final)
            fsync_dir(self.output_dir)
        except Exception as exc:  # every rank is waiting for this outcome
            stands = f"; {self._resume_point()}" if self.in_store else ""
            return f"publishing checkpoint-{pending.step} in {self.output_dir} failed{stands}: {exc}"
        self._apply_retention(pending.step)
        return None

    def _apply_retention(self, newest: int) -> None:
        """Keep the newest `save_total_limit` complete checkpoints up to `newest` (the one just published) and
        drop .tmp leftovers older than it. Higher steps are another timeline (a run that went further before this
        one resumed from an older checkpoint, or a corrupt one resume skipped): they are left alone here, and
        replaced when this run saves those steps."""
        self._finish_deletions()
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
            except (OSError if not self.in_store else Exception) as error:
                warnings.warn(f"could not delete old checkpoint {checkpoint.path}: {error}", stacklevel=2)

    def _finish_deletions(self) -> None:
        """Rank 0: the deletions a process killed while deleting left (`.deleting` directories, or prefixes with
        their `.deleting` marker), finished."""
        try:
            if not self.output_dir.is_dir():
                return
            for path in finish_deletions(self.output_dir):
                logger.info(f"finished deleting {path.name} (a deletion cut short by a process that stopped)")
        except (OSError if not self.in_store else Exception) as error:
            warnings.warn(f"could not finish deleting old checkpoints in {self.output_dir}: {error}", stacklevel=2)

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered or []

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def one_line(error: BaseException) -> str:
    """A write error in one line: DCP's CheckpointException carries every failing rank's traceback, which would
    bury the cause under dozens of lines; each distinct error is named once, with its ranks (--debug shows all)."""
    if not isinstance(error, CheckpointException):
        return str(error)
    ranks: dict[str, list[int]] = {}
    for rank, (exc, _trace) in sorted(error.failures.items()):
        ranks.setdefault(f"{type(exc).__name__}: {exc}".splitlines()[0], []).append(rank)
    # storage errors first: the others (a torn zip file) are what they left behind
    named = sorted(ranks.items(), key=lambda item: not item[0].startswith("OSError"))
    return "; ".join(f"{text} (rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})" for text, on in named)
