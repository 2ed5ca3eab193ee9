"""`meshtune export`: a run as a PEFT adapter, a merged model or a model directory; also where `chat` finds
a source in an object store."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune export` and its options on meshtune's parser."""
    export = commands.add_parser(
        "export", help="a run as a PEFT adapter, a merged model, or (full fine-tuning) a model directory",
        parents=[debug],
        description="Write a training output's LoRA (or Q-LoRA) adapters where serving stacks load them: as a PEFT "
                    "adapter directory, or with --merge folded into the base model's original weights (read from "
                    "its safetensors files, file by file: any size merges in the memory of one file) as a Hugging "
                    "Face model directory that transformers and vLLM load. SOURCE is a run's output_dir (its final/ "
                    "when complete, else its newest complete checkpoint, said in one line), final/ itself, or any "
                    "checkpoint-N (sharded by any number of ranks). A full fine-tuning checkpoint-N exports as a "
                    "Hugging Face model directory. The tokenizer and the chat template trained with are written too.")
    export.add_argument("source", help="output_dir, output_dir/final or output_dir/checkpoint-N")
    export.add_argument("--output", required=True, help="directory to write (must be empty or absent)")
    export.add_argument("--merge", action="store_true", help="merge the adapters into the base model's weights")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                        help="dtype of the merged or full model's weights (default: the base model's own, its "
                             "config.json's dtype; fp32 where it names none)")
    export.add_argument("--base-model", metavar="DIR",
                        help="the base model folder (default: the one the run trained from)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --output")


@contextlib.contextmanager
def from_store(source: str) -> Iterator[Path]:
    """`source` as a local path: itself, or for an object store's URL a verified copy in a temporary folder that
    lives as long as the command (checkpoint/fetch.py)."""
    from meshtune.checkpoint.object_store import is_url

    if not is_url(source):
        yield Path(source)
        return
    from meshtune.checkpoint.fetch import local_copy

    with tempfile.TemporaryDirectory(prefix="meshtune-store-") as scratch:
        yield local_copy(source, Path(scratch))


def run(args: argparse.Namespace) -> int:
    from meshtune.export.merge import export

    with from_store(args.source) as source:
        written = export(source, Path(args.output), args.merge, args.dtype, args.force, args.base_model)
    print(f"meshtune: wrote {written}")
    return 0
