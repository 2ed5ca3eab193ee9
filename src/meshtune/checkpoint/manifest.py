"""What makes a checkpoint directory trustworthy: `manifest.json` (the run's info plus every file's size and
sha256) and the `COMPLETE` marker, both written after every rank's DCP shards are on disk.

`verify` is what resume and `meshtune ckpt verify` rely on: a shard that was truncated, flipped or never copied
(node-local disks) is named before DCP fails on it mid-load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from meshtune.errors import MeshtuneError

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
DCP_METADATA = ".metadata"
NO_COMPLETE = "no COMPLETE marker (interrupted while saving)"
BLOCK = 1 << 20


class CheckpointError(MeshtuneError):
    """A checkpoint that cannot be written, found, trusted or loaded."""


def hash_file(path: Path, fsync: bool = False) -> dict[str, Any]:
    """Size and sha256, streamed in 1 MiB blocks so a 10 GB shard costs no memory.

    `fsync` flushes the file on the way: the rank that wrote a shard hashes it, so the flush costs no extra open.
    """
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def fsync_dir(path: Path) -> None:
    """Make created / renamed entries of a directory durable (a rename is only as safe as its parent's fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, info: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """manifest.json, then COMPLETE: the marker exists only once the manifest is durable."""
    write_durably(directory / MANIFEST, json.dumps({**info, "files": files}, indent=1, sort_keys=True) + "\n")
    write_durably(directory / COMPLETE, f"step {info.get('step')}\n")
    fsync_dir(directory)


def read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"unreadable {MANIFEST} in {directory}: {error}") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"unreadable {MANIFEST} in {directory}: it has no 'files' table")
    return manifest


def verify(path: Path) -> list[str]:
    """Problems that make `path` unsafe to resume from; an empty list means it is valid.

    Checks the marker, the manifest, every listed file's size and sha256, files the manifest does not list
    (a shard from another save mixed in), and that every file DCP's `.metadata` points to is present.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"not a directory: {path}"]
    problems = [] if (path / COMPLETE).is_file() else [NO_COMPLETE]
    try:
        listed = read_manifest(path)["files"]
    except CheckpointError as error:
        return problems + [str(error)]
    present = {p.name for p in path.iterdir()} - {MANIFEST, COMPLETE}
    for name in sorted(listed):
        if name not in present:
            problems.append(f"missing file {name}")
            continue
        expected = listed[name]
        size = (path / name).stat().st_size
        if size != expected.get("size"):
            problems.append(f"size mismatch in {name}: {size} bytes, manifest says {expected.get('size')}")
        elif hash_file(path / name)["sha256"] != expected.get("sha256"):
            problems.append(f"checksum mismatch in {name}")
    problems += [f"unlisted file {name}" for name in sorted(present - set(listed))]
    if DCP_METADATA not in listed:
        problems.append(f"the manifest lists no DCP {DCP_METADATA} file")
    elif not problems:
        try:
            storage = FileSystemReader(str(path)).read_metadata().storage_data
        except Exception as error:  # e.g. written by a newer torch: report it, `meshtune ckpt verify` must not crash
            return [f"unreadable DCP {DCP_METADATA}: {error}"]
        referenced = {info.relative_path for info in storage.values()}
        problems += [f"missing file {name} (DCP {DCP_METADATA} needs it)" for name in sorted(referenced - set(listed))]
    return problems
