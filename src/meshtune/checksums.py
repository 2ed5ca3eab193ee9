"""Every checksum meshtune takes of files: a file's size and sha256 (checkpoint manifests, the doctor's model
files), the checksum of the data a run trains on (the nodes' agreement check, the doctor, the tokenized cache),
file checksums remembered across launches (the doctor), and a folder's files by those (the identity of the model a
precomputed reference came from).

Standard library only, and no import from meshtune: every layer hashes through here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

BLOCK = 1 << 20  # read size: a 10 GB shard or weight file costs 1 MiB of memory


class FileChecksum(NamedTuple):
    size: int
    sha256: str  # hex digest


def file_checksum(path: str | Path, *, fsync: bool = False, block: int = BLOCK) -> FileChecksum:
    """Size and sha256 of a file read in `block`-sized pieces (Python 3.10 has no hashlib.file_digest).

    `fsync` flushes the file on the way: the rank that wrote a checkpoint shard hashes it, so the flush costs no
    extra open."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(block):
            digest.update(piece)
            size += len(piece)
        if fsync:
            os.fsync(f.fileno())
    return FileChecksum(size, digest.hexdigest())


def file_sha256(path: Path) -> str:
    return file_checksum(path).sha256


class ReadFiles(Protocol):
    """A dataset as the data layer resolves it (data/formats.DatasetSpec): its files, in reading order, and how
    their records are read."""

    files: list[Path]

    def identity(self) -> str: ...


def dataset_checksum(datasets: Iterable[ReadFiles], sha256: Callable[[Path], str] = file_sha256) -> str:
    """What a run trains on: each dataset's files' bytes, in order, and how its records are read (format, columns,
    tags: what turns the same bytes into other conversations, so other tokens).

    Not the files' names or places, nor the rest of a dataset_info.json: the same bytes read the same way are
    the same data wherever they lie. The other options that change the tokens (template, cutoff_len,
    max_samples, ...) are config keys, compared and keyed on their own. `sha256` hashes one file (the doctor
    passes its remembered checksums)."""
    digest = hashlib.sha256()
    for dataset in datasets:
        digest.update(dataset.identity().encode() + b"\0")
        for path in dataset.files:
            digest.update(sha256(Path(path)).encode() + b"\0")
        digest.update(b"\1")  # the end of one dataset: [a b][c] and [a][b c] differ
    return digest.hexdigest()


class RememberedChecksums:
    """Files' sha256 kept in a JSON file by path, size and modification time: a 100 GB model is hashed once, not
    at every launch. `save()` writes what was learnt; an unreadable or unwritable store only costs a rehash."""

    def __init__(self, store: Path):
        self.store = store
        try:
            self._known: dict[str, str] = json.loads(store.read_text())
        except (OSError, ValueError):
            self._known = {}

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in self._known:
            self._known[key] = file_sha256(path)
        return self._known[key]

    def save(self) -> None:
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._known))
            tmp.replace(self.store)  # another node's doctor on a shared home reads a whole file
        except OSError:
            pass


def remembered_store() -> Path:
    """Where file checksums are remembered: the user's cache folder, shared by the doctor and training."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshtune" / "file-checksums.json"


def folder_checksum(folder: Path) -> str:
    """sha256 over a folder's files (hidden ones aside): each one's name inside it and its remembered sha256, so a
    large model folder is read in full once, not at every launch."""
    remembered = RememberedChecksums(remembered_store())
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(folder)}:{remembered.sha256(file)}\n".encode())
    remembered.save()
    return digest.hexdigest()
