"""Which checkpoints an output directory holds, and which one a run resumes from.

Steps are compared as numbers (`checkpoint-10` is newer than `checkpoint-9`). A `.tmp` directory is never
resumed from, even if it looks finished: only the rename publishes a checkpoint. A published checkpoint that fails
verification is never resumed from, overwritten or deleted: a resume from an older one moves it aside
(`checkpoint-N.damaged`), and with no good one left the run stops and says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshtune.checkpoint.manifest import (COMPLETE, MANIFEST, NO_COMPLETE, CheckpointError, delete_sealed,
                                          read_manifest, verify)
from meshtune.checkpoint.object_store import StorePath, location

NAME = re.compile(r"^checkpoint-(\d+)(\.tmp)?$")
TMP_REASON = ".tmp: being written or interrupted"
DAMAGED = ".damaged"  # a published checkpoint that failed verification, kept aside for a human to judge


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool  # published and marked COMPLETE (checksums are not read here; see `verify`)
    status: str

    @property
    def is_tmp(self) -> bool:
        return self.path.name.endswith(".tmp")


def checkpoint_dir(output_dir: Path | StorePath, step: int, tmp: bool = False) -> Path | StorePath:
    """Where checkpoint `step` is published (`tmp`: written first, on a file system); a URL gives its prefix."""
    return location(output_dir) / f"checkpoint-{step}{'.tmp' if tmp else ''}"


def list_checkpoints(output_dir: Path) -> list[CheckpointInfo]:
    """Every `checkpoint-N[.tmp]` directory (or prefix of an object store), oldest first. Cheap: reads names and
    markers only."""
    output_dir = location(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = NAME.match(path.name)
        if not match or not path.is_dir():
            continue
        if match.group(2):
            found.append(CheckpointInfo(int(match.group(1)), path, False, TMP_REASON))
        elif (path / COMPLETE).is_file():
            found.append(CheckpointInfo(int(match.group(1)), path, True, "complete"))
        else:
            found.append(CheckpointInfo(int(match.group(1)), path, False, NO_COMPLETE))
    # a published directory sorts after a .tmp of the same step: it is the newer state of that step
    return sorted(found, key=lambda c: (c.step, not c.is_tmp))


def select_resume(output_dir: Path, named: Path | None, check: Callable[[Path], list[str]] = verify
                  ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint to resume from and the newer ones passed over, each with its reason.

    `named`: a checkpoint path (it must verify, else CheckpointError naming its problems), or None: the newest in
    `output_dir` that is complete and verifies (None if there is none). `check` verifies a candidate (a resume on
    several ranks passes one that splits the reading across them).
    """
    if named is not None:
        path = location(named)
        problems = check(path)
        if problems:
            raise CheckpointError(f"cannot resume from {path}: {'; '.join(problems)}. "
                                  f"Pick another checkpoint (meshtune ckpt list {path.parent}) or resume: auto")
        return path, []
    skipped, damaged = [], []
    for candidate in reversed(list_checkpoints(output_dir)):
        if not candidate.complete:
            skipped.append((candidate.path, candidate.status))
            continue
        problems = check(candidate.path)
        if not problems:
            return candidate.path, skipped
        skipped.append((candidate.path, "; ".join(problems)))
        damaged.append(f"{candidate.path.name}: {'; '.join(problems)}")
    if damaged:
        raise CheckpointError(
            f"no checkpoint in {output_dir} can be resumed from: {' | '.join(damaged)}. Nothing was changed. Check "
            f"the storage, then repair or remove them, name a good copy with resume_from_checkpoint: PATH, or set "
            f"resume_from_checkpoint: none to start over")
    return None, skipped


def set_aside(path: Path) -> Path:
    """Move a published checkpoint that failed verification out of the way (never listed, resumed from, replaced by
    a new save of its step, or pruned): `checkpoint-N.damaged`, numbered if that exists (in an object store, copied
    there and then deleted)."""
    target, n = path.with_name(path.name + DAMAGED), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED}-{n}")
    if isinstance(path, StorePath):
        path.copy_to(target)
        delete_sealed(path)
    else:
        path.rename(target)
    return target


def format_listing(output_dir: Path) -> str:
    """The table `meshtune ckpt list OUTPUT_DIR` prints, newest last."""
    rows, output_dir = [], location(output_dir)
    for c in list_checkpoints(output_dir):
        details, status = "", c.status
        if c.complete or (c.path / MANIFEST).is_file():
            try:
                manifest = read_manifest(c.path)
                size = sum(f.get("size", 0) for f in manifest["files"].values())
                details = (f"{size / 2**20:9.1f} MiB  world {manifest.get('world_size', '?')}  "
                           f"{manifest.get('parallel', '?')}  epoch {manifest.get('epoch', '?')}")
                wrong = size_problems(c.path, manifest)
            except CheckpointError as error:
                wrong = [str(error)]
            if wrong and c.complete:
                status = "damaged: " + "; ".join(wrong)
        rows.append(f"{c.step:>8}  {c.path.name:<24}  {status:<44}  {details}".rstrip())
    if not rows:
        return f"no checkpoints in {output_dir}"
    header = f"{'step':>8}  {'directory':<24}  {'status':<44}  details"
    return "\n".join([header, *rows,
                      "sizes are checked here, checksums are not: meshtune ckpt verify CHECKPOINT checks them"])


def size_problems(path: Path, manifest: dict) -> list[str]:
    """Files the manifest lists that are missing or of another size: cheap (no file is read)."""
    problems = []
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} missing")
        elif file.stat().st_size != expected.get("size"):
            problems.append(f"{name} is {file.stat().st_size} bytes, the manifest says {expected.get('size')}")
    return problems
