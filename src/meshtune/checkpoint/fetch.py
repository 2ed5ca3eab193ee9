"""A local copy of what an object store holds, for the commands that read a model from files (`meshtune export`,
`chat`, `ckpt verify` of a final/): the objects are verified in the store first (sizes and sha256 against the
manifest), so only a sealed, intact final/ or checkpoint is ever copied."""

from __future__ import annotations

from pathlib import Path

from meshtune.checkpoint.final import FINAL
from meshtune.checkpoint.manifest import COMPLETE, CheckpointError, verify
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
