"""`meshtune demo`: the embedded default, a tiny model that learns a task with LoRA."""

from __future__ import annotations

import argparse


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune demo` and its options on meshtune's parser."""
    demo = commands.add_parser("demo", help="the embedded default: a tiny model learns a task with LoRA on 2 processes",
                               parents=[debug],
                               description="Build a tiny model, tokenizer and dataset locally (no download), "
                                           "fine-tune with LoRA on 2 CPU processes and show answers before and after.")
    demo.add_argument("--prepare", metavar="DIR", help="only write the model, tokenizer, data and config.yaml into DIR")
    demo.add_argument("--dir", metavar="DIR", default="demo_run", help="where the demo works (default: ./demo_run)")


def run(args: argparse.Namespace) -> int:
    from meshtune.demo.run import run_demo

    return run_demo(prepare_only=args.prepare, work_dir=args.dir)
