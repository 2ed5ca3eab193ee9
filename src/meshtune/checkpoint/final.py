"""`output_dir/final/`, the trained model as transformers and peft load it, published as checkpoints are: written
into `final.tmp/`, sealed with manifest.json (every file's size and sha256) and COMPLETE, then renamed into place.
A job that waits for final/ to appear never reads half a model, and `meshtune ckpt verify` checks its bytes.

A rerun's final/ replaces the previous one with two renames (the old one aside to `final.old/`, the new one in):
until the new one is complete the old one stays whole, and a reader finds the old final/, for an instant none, or
the new one; never a partial one. Extra files (manifest.json, COMPLETE) are ignored by `from_pretrained`.

With checkpoints in an object store, the sealed final/ is also uploaded to the store's `final/` prefix, COMPLETE
last; a store has no rename, so the previous final/ there is deleted first (COMPLETE first), and until the new one's
COMPLETE is written a reader finds none.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from meshtune.checkpoint.manifest import (COMPLETE, FINAL_KIND, CheckpointError, delete_sealed, files_in, fsync_dir,
                                          hash_file, read_manifest, write_manifest)
from meshtune.checkpoint.object_store import StorePath
from meshtune.checkpoint.resume import size_problems
from meshtune.distributed import broadcast_from_rank0

FINAL = "final"
STAGING = "final.tmp"  # being written, or left by a writer that died: never read, cleared by the next write
REPLACED = "final.old"  # the previous final/ during a replacement


def publish_final(output_dir: Path, info: dict[str, Any], rank: int, write: Callable[[Path], None],
                  store: StorePath | None = None) -> Path:
    """Rank 0 calls `write(directory)` on an empty staging directory, seals it and renames it to final/ (and uploads
    it to `store`/final/, sealed); every rank calls this and returns once final/ is in place, or raises the same
    CheckpointError when it is not."""
    output_dir = Path(output_dir)
    final = output_dir / FINAL
    failure = None
    if rank == 0:
        try:
            staged = _staging(output_dir)
            write(staged)
            write_manifest(staged, {**info, "kind": FINAL_KIND}, hashes(staged))
            if store is not None:
                upload_sealed(staged, store / FINAL)
            _swap_in(staged, final)
        except Exception as error:  # every rank waits for this outcome
            shutil.rmtree(output_dir / STAGING, ignore_errors=True)
            kept = ("keeps the previous run's model" if (final / COMPLETE).is_file() else "was not written")
            failure = f"writing the trained model failed, so {final} {kept}: {error}"
    failure = broadcast_from_rank0(failure)
    if failure:
        raise CheckpointError(failure)
    return final


def upload_sealed(staged: Path, target: StorePath) -> None:
    """A sealed local directory uploaded to `target`, COMPLETE last, after the previous one there is deleted."""
    if target.is_dir():
        delete_sealed(target)
    target.upload(staged, last=COMPLETE)


def final_problems(path: Path) -> list[str]:
    """Why `path` is not a complete final/, without reading its files: the marker, the manifest and every file's
    size (`verify` reads the checksums too)."""
    if not (path / COMPLETE).is_file():
        return [f"no {COMPLETE} marker (being written, interrupted, or written before final/ was sealed)"]
    try:
        return size_problems(path, read_manifest(path))
    except CheckpointError as error:
        return [str(error)]


def unsealed_problems(path: Path) -> list[str]:
    """Why a model directory without manifest.json is not one to load: `final.tmp/` is final/ being written, or
    left by a writer that died, whatever files it holds. Other unsealed directories (a model from elsewhere, a
    final/ of a meshtune that did not seal it) have only their files to check."""
    if path.name != STAGING:
        return []
    return [f"{STAGING}/ is final/ being written, or left by a writer that died (not sealed: no manifest.json, no "
            f"{COMPLETE}); never a model to load. Use {path.with_name(FINAL)}, or the newest checkpoint (meshtune "
            f"export falls back to it); the next final save clears {STAGING}/"]


def hashes(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under `directory`, each flushed to disk; the files in parallel threads
    (hashlib releases the GIL), as a large model's final/ is several files of gigabytes."""
    names = sorted(files_in(directory))
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: hash_file(directory / name, fsync=True), names)))


def _staging(output_dir: Path) -> Path:
    """An empty `final.tmp/`; leftovers of a writer that died are cleared first (a complete final/ that one left
    aside while replacing it goes back into place)."""
    final, replaced, staged = output_dir / FINAL, output_dir / REPLACED, output_dir / STAGING
    if replaced.is_dir():
        if not final.exists() and (replaced / COMPLETE).is_file():
            os.rename(replaced, final)
        else:
            delete_sealed(replaced)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    return staged


def _swap_in(staged: Path, final: Path) -> None:
    if final.exists():
        replaced = final.with_name(REPLACED)
        os.rename(final, replaced)
        os.rename(staged, final)
        fsync_dir(final.parent)
        delete_sealed(replaced)
    else:
        os.rename(staged, final)
        fsync_dir(final.parent)
