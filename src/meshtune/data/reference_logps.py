"""Precomputed reference log-probs of preference pairs (`precompute_ref_log_probs`), kept beside the tokenized cache.

Each pair's chosen and rejected log-prob sums under the reference, as one float32 array of shape (pairs, 2), in a
folder named after the pairs' tokenized cache and the reference's identity (`<pairs key>.reference-<identity>`), so
other data, another tokenization or another reference never reads them. The folder is written whole into a private
temporary folder and published by one rename, under a file lock; `read` checks it against its meta.json (the count
of pairs, the bytes, the sha256) and names what is wrong with a damaged or partial one, which is then written again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
VALUES, META = "logps.npy", "meta.json"


def values_folder(cache_dir: Path, pairs_key: str, identity: str) -> Path:
    """Where the values of the pairs cached under `pairs_key` against the reference `identity` are kept."""
    digest = hashlib.sha256(f"v{FORMAT_VERSION}\0{pairs_key}\0{identity}".encode()).hexdigest()
    return Path(cache_dir) / f"{pairs_key}.reference-{digest[:16]}"


def digest_of(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float32).tobytes()).hexdigest()


def read(folder: Path, pairs: int) -> tuple[np.ndarray | None, str | None]:
    """(the values, None), or (None, what is wrong: absent, damaged, partial)."""
    if not folder.is_dir():
        return None, "absent"
    try:
        meta = json.loads((folder / META).read_text())
        data = (folder / VALUES).read_bytes()
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"
    if meta.get("format_version") != FORMAT_VERSION or meta.get("pairs") != pairs:
        return None, f"written for {meta.get('pairs')} pairs (format {meta.get('format_version')}), not {pairs}"
    if len(data) != meta.get("bytes"):
        return None, f"{VALUES} holds {len(data):,} bytes, not the {meta.get('bytes'):,} written (partial)"
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None, f"{VALUES}'s sha256 differs from the one written (damaged)"
    try:
        values = np.load(folder / VALUES)
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"
    if values.shape != (pairs, 2) or values.dtype != np.float32:
        return None, f"holds an array of {values.shape} {values.dtype}, not ({pairs}, 2) float32"
    return values, None


def write(folder: Path, values: np.ndarray, about: dict) -> None:
    """Publish `values` at `folder`: into a temporary folder, then one rename, under a lock on `folder`'s name; a
    valid folder another process published meanwhile is kept, a damaged one replaced."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        found, _ = read(folder, len(values))
        if found is not None and digest_of(found) == digest_of(values):
            return
        tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            np.save(tmp / VALUES, np.ascontiguousarray(values, dtype=np.float32))
            data = (tmp / VALUES).read_bytes()
            meta = {"format_version": FORMAT_VERSION, "pairs": len(values), "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(), **about}
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
            if folder.exists():  # damaged: set aside, then removed, so the rename below lands on no folder
                aside = folder.parent / f"{folder.name}.damaged-{os.getpid()}"
                os.rename(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


class WithReference:
    """A pair dataset (`Pairs`, or a held-out `Subset` of it) with each of its pairs' reference log-probs:
    `reference_logps[i]` is pair i's (chosen, rejected). Everything else is the dataset's."""

    def __init__(self, pairs, reference_logps: np.ndarray):
        self.pairs, self.reference_logps = pairs, reference_logps

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        return self.pairs[i]

    def __getattr__(self, name: str):
        if name in ("pairs", "reference_logps"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.pairs, name)
