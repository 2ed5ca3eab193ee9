"""A local copy of what an object store holds: for the commands that read a model from files (`meshtune export`,
`chat`), verified in the store first (sizes and sha256 against the manifest), so only a sealed, intact final/ or
checkpoint is ever copied; for a resume, each object fetched once and checked in the copy, which is then what
DCP loads (`fetch_checked`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from meshtune.checkpoint.final import FINAL
from meshtune.checkpoint.manifest import COMPLETE, CheckpointError, file_problems, verify
from meshtune.checkpoint.object_store import StorePath, open_store
from meshtune.checkpoint.resume import NAME, select_resume


def local_copy(url: str, into: Path) -> Path:
    """`url` copied under `into`, keeping its name: a `final/` or `checkpoint-N/` prefix as it is; a run's checkpoint
    location as a folder holding its final/ (where sealed) or else its newest complete checkpoint, as an output_dir
    does. A CheckpointError when there is nothing complete to copy."""
    root = open_store(url)
    if root.name == FINAL or NAME.match(root.name):
        return _verified(root).download(into / root.name)
    target = into / (root.name or "store")
    final = root / FINAL
    if (final / COMPLETE).is_file() and not verify(final):
        final.download(target / FINAL)
        return target
    newest, skipped = select_resume(root, None)
    if newest is None:
        passed = "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
        found = f" ({passed})" if passed else ""
        raise CheckpointError(f"{url} holds no sealed final/ and no complete checkpoint{found}")
    newest.download(target / newest.name)
    return target


def _verified(prefix: StorePath) -> StorePath:
    problems = verify(prefix)
    if problems:
        raise CheckpointError(f"{prefix} cannot be used: {'; '.join(problems)}")
    return prefix


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
