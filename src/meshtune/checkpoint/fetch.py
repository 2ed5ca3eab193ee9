"""A local copy of what an object store holds, each object read from the store once and checked in the copy (sizes
and sha256 against the manifest, as `verify` checks a folder): for the commands that read a model from files
(`meshtune export`, `chat`), a copy that fails is deleted and never used; for a resume, the copy is what DCP loads
(`fetch_checked`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from meshtune.checkpoint.final import FINAL
from meshtune.checkpoint.manifest import COMPLETE, MANIFEST, CheckpointError, file_problems, verify
from meshtune.checkpoint.object_store import StorePath, open_store
from meshtune.checkpoint.resume import NAME, select_resume


def local_copy(url: str, into: Path) -> Path:
    """`url` copied under `into`, keeping its name: a `final/` or `checkpoint-N/` prefix as it is; a run's checkpoint
    location as a folder holding its final/ (where sealed and intact) or else its newest complete checkpoint that
    is, as an output_dir does. A CheckpointError when there is nothing complete and intact to copy."""
    root = open_store(url)
    if root.name == FINAL or NAME.match(root.name):
        target = into / root.name
        if problems := checked_copy(root, target):
            raise CheckpointError(f"{root} cannot be used: {'; '.join(problems)}")
        return target
    target = into / (root.name or "store")
    final, skipped = root / FINAL, []
    if (final / COMPLETE).is_file():
        if not (problems := checked_copy(final, target / FINAL)):
            return target
        skipped.append((final, "; ".join(problems)))
    newest, passed_over = select_resume(root, None, lambda prefix: checked_copy(prefix, target / prefix.name))
    if newest is None:
        passed = "; ".join(f"{path.name}: {reason}" for path, reason in skipped + passed_over)
        found = f" ({passed})" if passed else ""
        raise CheckpointError(f"{url} holds no intact sealed final/ and no complete checkpoint{found}")
    return target


def checked_copy(prefix: StorePath, into: Path) -> list[str]:
    """The objects `prefix`'s manifest lists fetched into local `into` and verified there (`verify`, the store only
    listed), then the manifest verified (read from the store once) and the COMPLETE marker beside them: the
    problems, none where the copy is good. A copy with problems is deleted."""
    try:
        text = (prefix / MANIFEST).read_text()
    except OSError:
        text = None  # verify reads it again and names what is wrong
    problems = verify(prefix, lambda listed: fetch_checked(prefix, listed, listed, into), copy=into,
                      manifest_text=text)
    if problems:
        shutil.rmtree(into, ignore_errors=True)
        return problems
    (into / MANIFEST).write_text(text)
    (prefix / COMPLETE).get(into / COMPLETE)
    return []


def fetch_checked(prefix: StorePath, listed: dict[str, dict[str, Any]], names: Iterable[str], into: Path
                  ) -> dict[str, str]:
    """`names` (objects the manifest lists) copied from `prefix` into local `into`, then checked there as
    `file_problems` checks files: the problem of each, by name. The store is read once; the copy is what a resume
    loads."""
    found, fetched = {}, []
    for name in names:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            (prefix / name).get(target)
            fetched.append(name)
        except FileNotFoundError:
            found[name] = f"missing file {name}"
        except Exception as error:  # the store's client raises its own kinds (botocore, aiohttp, ...)
            found[name] = f"unreadable file {name}: {type(error).__name__}: {error}"
    return {**found, **file_problems(into, listed, fetched)}
