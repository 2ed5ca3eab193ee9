"""The checkpoint a run resumes from, chosen and verified together by every rank, and loaded.

Collectives, in the order every rank meets them (`select`): rank 0 lists the checkpoints and judges them newest
first; for each candidate it broadcasts the manifest's file list, every rank checks its share of the files (in a
store, its node's share, fetched into the node's copy) and rank 0 gathers what they found; a broadcast of None ends
the candidates, and a last broadcast gives every rank the answer. `load` reads the chosen checkpoint on every rank
(DCP's collectives), and from a store a barrier lets each node's first process delete the copy once every process
of the node has read it.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshtune.checkpoint.fetch import fetch_checked
from meshtune.checkpoint.manifest import (COMPLETE, CheckpointError, dcp_reader, file_problems, one_line,
                                          read_manifest, share, verify)
from meshtune.checkpoint.object_store import StorePath, location
from meshtune.checkpoint.rank_group import RankGroup
from meshtune.checkpoint.resume import select_resume, set_aside
from meshtune.checkpoint.retention import Retention
from meshtune.checkpoint.state import ModelOptimizerState, RNGState
from meshtune.config import key_default, math_hash
from meshtune.logs import RankWarning


class ResumePoint:
    """Chooses, verifies and loads the checkpoint of `output_dir` a run resumes from. `staging`: this node's folder
    for the copy of a checkpoint in a store that a resume checks and loads."""

    def __init__(self, output_dir: Path | StorePath, group: RankGroup, staging: Path, retention: Retention):
        self.output_dir, self.group, self.staging, self.retention = output_dir, group, staging, retention
        self._copied: Path | None = None  # this node's copy of the checkpoint `select` chose in a store

    def select(self, named: Path | None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """`select_resume` decided by rank 0 (it lists the checkpoints, judges them and moves damaged ones aside),
        each candidate's files hashed by every rank, a share each (`_verify_together`); the answer given to every
        rank."""
        answer: Any = None
        if self.group.rank == 0:
            try:
                self.retention.finish_deletions()
                path, skipped = select_resume(self.output_dir, named, check=self._verify_together)
                answer = path, [self._aside(skip, reason) for skip, reason in skipped]
            except (CheckpointError, OSError) as error:  # every rank waits for this answer
                answer = str(error)
            finally:
                self.group.broadcast(None)  # no further candidate: the other ranks leave `_hash_shares`
        else:
            self._hash_shares()
        answer = self.group.broadcast(answer)  # every rank's fetches are done: rank 0 gathered their checks
        chosen = None if isinstance(answer, str) else answer[0]
        self._copied = self._copy_of(chosen) if isinstance(chosen, StorePath) else None
        if self.group.local_rank == 0:
            self._drop_copies(keep=self._copied)
        if isinstance(answer, str):
            raise CheckpointError(answer)
        return answer

    def _verify_together(self, path: Path) -> list[str]:
        """Rank 0: `verify(path)`, with the listed files dealt across the ranks (`share`), each hashing its own at
        the same time; rank 0 gathers what they found and checks the rest (marker, manifest, unlisted files, DCP's
        index)."""
        in_store = isinstance(path, StorePath)
        if not self.group.distributed and not in_store:
            return verify(path)

        def check_files(listed: dict[str, dict[str, Any]]) -> dict[str, str]:
            self.group.broadcast((str(path), listed))  # the manifest rank 0 read: every rank deals the same shares
            found = self._check_share(path, listed)
            for theirs in self.group.gather(found)[1:]:
                found.update(theirs)
            return found

        return verify(path, check_files, copy=self._copy_of(path) if in_store else None)

    def _hash_shares(self) -> None:
        """The other ranks: check their share of each candidate rank 0 names, until it names none."""
        while (candidate := self.group.broadcast(None)) is not None:
            path, listed = candidate
            try:
                found = self._check_share(location(path), listed)
            except Exception as exc:  # reported through rank 0, so no rank is left waiting at the gather
                found = {f"rank {self.group.rank}": f"rank {self.group.rank} could not check its files: {exc}"}
            self.group.gather(found)

    def _check_share(self, path: Path | StorePath, listed: dict[str, dict[str, Any]]) -> dict[str, str]:
        """This rank's share of the listed files checked. In a store, the share of its node's processes, fetched
        into the node's copy and checked there: each node reads every object once, and loads that copy."""
        if isinstance(path, StorePath):
            names = share(listed, self.group.local_world_size)[self.group.local_rank]
            return fetch_checked(path, listed, names, self._copy_of(path))
        return file_problems(path, listed, share(listed, self.group.world_size)[self.group.rank])

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

    def find(self, named: Path | None, config: dict[str, Any], allowed: list[str] = ()
                    ) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
        """The checkpoint to resume from (`named`, or the newest good one where None; None if there is none), its
        manifest, and warnings for the user (the checkpoints passed over and why). A checkpoint written under other
        values of `config` (the run's math) is an error naming the keys, unless each is in `allowed`."""
        path, skipped = self.select(named)
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
                warnings.warn(f"rank {self.group.rank}: {path.name} was saved by {manifest.get('world_size', '?')} "
                              f"ranks and holds no random state for this rank; its random streams keep their seed",
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
            self.group.barrier()  # every process of the node has read the copy
            if self.group.local_rank == 0:
                shutil.rmtree(copy, ignore_errors=True)
        return manifest
