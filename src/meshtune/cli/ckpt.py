"""`meshtune ckpt list | verify`: a run's checkpoints and their state; imports no torch for `list`."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshtune.errors import MeshtuneError


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune ckpt` and its options on meshtune's parser."""
    ckpt = commands.add_parser("ckpt", help="list or verify checkpoints", parents=[debug],
                               description="Inspect the sharded checkpoints in an output_dir.")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    listing = ckpt_commands.add_parser("list", help="checkpoints in OUTPUT_DIR with their state, newest last",
                                       parents=[debug])
    listing.add_argument("output_dir")
    checking = ckpt_commands.add_parser("verify", help="check COMPLETE, manifest, sizes and sha256 of every file of "
                                                       "a checkpoint-N or of final/; exit code 0 = valid, 1 = not",
                                        parents=[debug])
    checking.add_argument("checkpoint")


def run(args: argparse.Namespace) -> int:
    from meshtune.checkpoint import format_listing, verify
    from meshtune.checkpoint.object_store import is_url, location

    if args.ckpt_command == "list":
        if not location(args.output_dir).is_dir():
            raise MeshtuneError(f"{args.output_dir} is not a directory (nor a prefix holding objects)")
        print(format_listing(location(args.output_dir)))
        return 0
    if not is_url(args.checkpoint):
        return verify_local(args.checkpoint, Path(args.checkpoint))
    from meshtune.checkpoint.final import FINAL

    stored = location(args.checkpoint)
    if stored.name != FINAL or not stored.is_dir():  # a checkpoint is verified in the store itself
        return print_verified(args.checkpoint, verify(stored))
    # a final/ is judged as a local one is, on a copy: its weights files are read as a model loader reads them
    with tempfile.TemporaryDirectory(prefix="meshtune-store-") as scratch:
        return verify_local(args.checkpoint, stored.download(Path(scratch) / FINAL))


def verify_local(name: str, path: Path) -> int:
    """`ckpt verify` of a checkpoint or final/ on this machine (a final/ from a store: its verified copy)."""
    from meshtune.checkpoint import verify
    from meshtune.checkpoint.manifest import MANIFEST
    from meshtune.model.final_weights import export_kind, verify_export  # imports torch: `verify` needs it, `list` not
    from meshtune.checkpoint.final import unsealed_problems

    kind = export_kind(path)
    if kind:  # output_dir/final: a model to load, not a checkpoint to resume
        sealed = (path / MANIFEST).is_file()  # meshtune's final save seals final/; other model dirs are not
        problems = (verify(path) if sealed else unsealed_problems(path)) + verify_export(path)
        checked = ("COMPLETE, every file's size and sha256 match manifest.json, " if sealed else
                   "no manifest.json, so no checksums to compare; ")
        state = "INVALID" if problems else f"valid ({checked}every weights file matches its header; tokenizer present)"
        print(f"{name}: a final export ({kind}), not a checkpoint: {state}")
        for problem in problems:
            print(f"  - {problem}")
        return 1 if problems else 0
    return print_verified(name, verify(path))


def print_verified(name: str, problems: list[str]) -> int:
    if problems:
        print(f"{name}: INVALID")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"{name}: valid (COMPLETE, every file's size and sha256 match manifest.json)")
    return 0
