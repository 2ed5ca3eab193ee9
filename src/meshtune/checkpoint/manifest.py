"""What makes a checkpoint directory trustworthy: `manifest.json` (the run's info plus every file's size and
sha256) and the `COMPLETE` marker, both written after every rank's DCP shards are on disk.

`verify` is what resume and `meshtune ckpt verify` rely on: a shard that was truncated, flipped or never copied
(node-local disks) is named before DCP fails on it mid-load. Reading every byte is what costs: a resume splits the
files across its ranks (`share`), each rank hashing its part at once, so the check takes the time of 1 / N of it.
`final/` carries the same manifest and marker (checkpoint/final.py), with `"kind": "final"` and no DCP files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from meshtune.checkpoint import object_store
from meshtune.checkpoint.object_store import StorePath
from meshtune.checksums import file_checksum
from meshtune.errors import MeshtuneError

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
DCP_METADATA = ".metadata"
NO_COMPLETE = "no COMPLETE marker (interrupted while saving)"
FINAL_KIND = "final"  # the manifest's "kind" in final/: a model directory, no DCP index to check


class CheckpointError(MeshtuneError):
    """A checkpoint that cannot be written, found, trusted or loaded."""


def hash_file(path: Path, fsync: bool = False) -> dict[str, Any]:
    """A file's entry in the manifest: size and sha256 (checksums.file_checksum, streamed, `fsync` on the way; an
    object in a store read back from it)."""
    size, sha256 = path.checksum() if isinstance(path, StorePath) else file_checksum(path, fsync=fsync)
    return {"size": size, "sha256": sha256}


def fsync_dir(path: Path) -> None:
    """Make created / renamed entries of a directory durable (a rename is only as safe as its parent's fsync). An
    object store's writes are durable once they return."""
    if isinstance(path, StorePath):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    if isinstance(path, StorePath):
        path.write_text(text)
        return
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, info: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """manifest.json, then COMPLETE: the marker exists only once the manifest is durable."""
    write_durably(directory / MANIFEST, json.dumps({**info, "files": files}, indent=1, sort_keys=True) + "\n")
    write_durably(directory / COMPLETE, f"step {info.get('step')}\n")
    fsync_dir(directory)


DELETING = ".deleting"  # a directory being deleted, or left so by a process killed while deleting it


def delete_sealed(path: Path) -> None:
    """Delete a published directory: renamed to `NAME.deleting` first (one step: from then on no reader takes it
    for what it was), then removed. A deletion cut short leaves only that name, which `finish_deletions` clears.
    In an object store, which has no rename, the prefix is marked and emptied COMPLETE first (object_store.py)."""
    if isinstance(path, StorePath):
        object_store.delete_sealed(path, (COMPLETE, MANIFEST))
        return
    doomed = path.with_name(path.name + DELETING)
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def finish_deletions(directory: Path) -> list[Path]:
    """Remove the `.deleting` directories in `directory` that a process killed while deleting left; the ones
    removed (in an object store: the prefixes left with their `.deleting` marker). Call from one process only."""
    if isinstance(directory, StorePath):
        return object_store.finish_deletions(directory, (COMPLETE, MANIFEST))
    done = []
    for doomed in sorted(Path(directory).glob(f"*{DELETING}")):
        if doomed.is_dir():
            shutil.rmtree(doomed)
            done.append(doomed)
    return done


def read_manifest(directory: Path, text: str | None = None) -> dict[str, Any]:
    """`directory`'s manifest (`text`: its content, already read from there)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text() if text is None else text)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"unreadable {MANIFEST} in {directory}: {error}") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"unreadable {MANIFEST} in {directory}: it has no 'files' table")
    return manifest


def share(listed: dict[str, dict[str, Any]], world_size: int) -> list[list[str]]:
    """The manifest's files dealt to `world_size` ranks, largest first, each to the rank with the fewest bytes so far:
    every file is hashed once and the ranks hash about the same number of bytes. Every rank computes the same deal
    from the same manifest. (Hashing the files each rank's load will read instead would hash files several ranks
    read, DDP's model for one, several times, and leave unread ones, such as the random streams of ranks the job
    no longer has, unchecked.)"""
    loads = [0] * world_size
    dealt: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(listed, key=lambda name: (-int(listed[name].get("size") or 0), name)):
        lightest = min(range(world_size), key=lambda rank: (loads[rank], rank))
        dealt[lightest].append(name)
        loads[lightest] += int(listed[name].get("size") or 0)
    return dealt


def file_problems(path: Path, listed: dict[str, dict[str, Any]], names: Iterable[str]) -> dict[str, str]:
    """The problem of each of `names` (files the manifest lists) that is missing, unreadable, of another size or of
    another sha256, by file name."""
    found = {}
    for name in names:
        file, expected = path / name, listed[name]
        try:
            if not file.is_file():
                found[name] = f"missing file {name}"
            elif (size := file.stat().st_size) != expected.get("size"):
                found[name] = f"size mismatch in {name}: {size} bytes, manifest says {expected.get('size')}"
            elif hash_file(file)["sha256"] != expected.get("sha256"):
                found[name] = f"checksum mismatch in {name}"
        except OSError as error:
            found[name] = f"unreadable file {name}: {error}"
    return found


def files_in(path: Path) -> set[str]:
    """Every file under `path`, by its path relative to it."""
    if isinstance(path, StorePath):
        return path.files()
    return {file.relative_to(path).as_posix() for file in path.rglob("*") if file.is_file()}


def verify(path: Path, check_files: Callable[[dict[str, dict[str, Any]]], dict[str, str]] | None = None,
           copy: Path | None = None, manifest_text: str | None = None) -> list[str]:
    """Problems that make `path` unsafe to resume from (or, for final/, to load); an empty list means it is valid.

    Checks the marker, the manifest, every listed file's size and sha256, files the manifest does not list
    (a shard from another save mixed in), and that every file DCP's `.metadata` points to is present.
    `check_files(listed)` checks the listed files (`file_problems`); by default this process reads them all.
    `copy`: a local copy of the listed files that `check_files` made and checked; DCP's index is read from it.
    `manifest_text`: the manifest as read from `path` already (an object store's, read once).
    """
    path = object_store.location(path)
    if not path.is_dir():
        return [f"not a directory: {path}"]
    problems = [] if (path / COMPLETE).is_file() else [NO_COMPLETE]
    try:
        manifest = read_manifest(path, manifest_text)
    except CheckpointError as error:
        return problems + [str(error)]
    listed = manifest["files"]
    found = check_files(listed) if check_files else file_problems(path, listed, listed)
    problems += [found[name] for name in sorted(found)]
    present = files_in(path) - {MANIFEST, COMPLETE}
    problems += [f"unlisted file {name}" for name in sorted(present - set(listed))]
    if manifest.get("kind") == FINAL_KIND:
        return problems
    if DCP_METADATA not in listed:
        problems.append(f"the manifest lists no DCP {DCP_METADATA} file")
    elif not problems:
        try:
            storage = dcp_reader(copy or path).read_metadata().storage_data
        except Exception as error:  # e.g. written by a newer torch: report it, `meshtune ckpt verify` must not crash
            return [f"unreadable DCP {DCP_METADATA}: {error}"]
        referenced = {info.relative_path for info in storage.values()}
        problems += [f"missing file {name} (DCP {DCP_METADATA} needs it)" for name in sorted(referenced - set(listed))]
    return problems


def dcp_reader(path: Path | StorePath) -> Any:
    """DCP's reader for a checkpoint: FileSystemReader on a file system, FsspecReader in an object store. Imported
    here: listing checkpoints needs no torch."""
    if isinstance(path, StorePath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path), **path.storage_options)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def dcp_writer(path: Path | StorePath) -> Any:
    """DCP's writer for a checkpoint's shards: FileSystemWriter (fsyncs every shard) or FsspecWriter. Into a store
    each tensor is an object of its own (`single_file_per_rank=False`), written one at a time: no object is a rank's
    whole state, which a server that assembles a multipart upload in memory (moto's does) would hold at once,
    and the host holds one tensor's upload buffer."""
    if isinstance(path, StorePath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(path), single_file_per_rank=False, **path.storage_options)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path))


def rank_errors(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """Each failing rank's exception in DCP's CheckpointException (which keeps them with their tracebacks), by rank;
    any other error as itself, of no rank."""
    from torch.distributed.checkpoint.api import CheckpointException  # here: listing checkpoints needs no torch

    if not isinstance(error, CheckpointException):
        return [(None, error)]
    return [(rank, exc) for rank, (exc, _trace) in sorted(error.failures.items())]


def one_line(error: BaseException) -> str:
    """A write error in one line: DCP's CheckpointException carries every failing rank's traceback, which would
    bury the cause under dozens of lines; each distinct error is named once, with its ranks (--debug shows all)."""
    failures = rank_errors(error)
    if failures and failures[0][0] is None:
        return str(error)
    ranks: dict[str, list[int]] = {}
    for rank, exc in failures:
        ranks.setdefault(f"{type(exc).__name__}: {exc}".splitlines()[0], []).append(rank)
    # storage errors first: the others (a torn zip file) are what they left behind
    named = sorted(ranks.items(), key=lambda item: not item[0].startswith("OSError"))
    return "; ".join(f"{text} (rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})" for text, on in named)
