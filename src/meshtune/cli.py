"""`meshtune train | demo`: errors a user can act on are printed without a traceback (`--debug` shows it)."""

from __future__ import annotations

import argparse
import os
import sys

from meshtune import __version__
from meshtune.errors import MeshtuneError

TRAIN_HELP = """\
Fine-tune a model from one YAML config plus key=value overrides, e.g.
  meshtune train cfg.yaml learning_rate=1e-4 max_steps=50 nproc_per_node=2

With nproc_per_node > 1 meshtune starts torchrun itself; under torchrun it trains directly.
Outputs in output_dir: config.yaml, metrics.jsonl, loss.png, final/ (PEFT adapter or HF model dir).

config keys (default, meaning):
"""


def build_parser() -> argparse.ArgumentParser:
    from meshtune.config import describe_keys

    parser = argparse.ArgumentParser(prog="meshtune", description="Fine-tune LLMs on one GPU, one node or many.")
    parser.add_argument("--version", action="version", version=f"meshtune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="fine-tune from a YAML config", description=TRAIN_HELP + describe_keys(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    train.add_argument("--debug", action="store_true", help="show full tracebacks")

    demo = commands.add_parser("demo", help="the embedded default: a tiny model learns a task with LoRA on 2 processes",
                               description="Build a tiny model, tokenizer and dataset locally (no download), "
                                           "fine-tune with LoRA on 2 CPU processes and show answers before and after.")
    demo.add_argument("--prepare", metavar="DIR", help="only write the model, tokenizer, data and config.yaml into DIR")
    demo.add_argument("--dir", metavar="DIR", default="demo_run", help="where the demo works (default: ./demo_run)")
    demo.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from meshtune.config import load_config

    cfg = load_config(args.config, args.overrides)  # every config error surfaces here, before any process starts
    return launch_training(cfg, ["train", args.config, *args.overrides])


def launch_training(cfg, argv: list[str]) -> int:
    """Train in this process, or start torchrun for several local processes that re-enter with `argv`."""
    from meshtune.distributed import under_torchrun
    from meshtune.launch import default_nproc_per_node, run_torchrun, standalone_command

    nproc = cfg.nproc_per_node or default_nproc_per_node()
    if not under_torchrun() and nproc > 1:
        prepare_data_once(cfg, nproc)
        code = run_torchrun(standalone_command(nproc, argv), nproc)
        if code != 0:
            raise MeshtuneError(f"training failed in a worker process (exit code {code}); its error is above")
        return 0
    from meshtune.train.loop import run

    run(cfg)
    return 0


def prepare_data_once(cfg, nproc: int) -> None:
    """Tokenize and plan in the launching process: data errors show before any worker starts, workers hit the cache."""
    from meshtune.data.pipeline import plan_steps, prepare_datasets
    from meshtune.model.loading import check_model_dir, load_tokenizer

    tokenizer = load_tokenizer(check_model_dir(cfg.model_name_or_path))
    train_data, _ = prepare_datasets(cfg, tokenizer, show_progress=True, log=lambda _line: None)
    plan_steps(cfg, train_data, nproc)


def cmd_demo(args: argparse.Namespace) -> int:
    from meshtune.demo.run import run_demo

    return run_demo(prepare_only=args.prepare, work_dir=args.dir)


def quiet_libraries() -> None:
    """One progress bar, meshtune's: none from transformers' loading and saving, and no warning nobody can act on."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # peft reads a transformers property deprecated in v5
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def worker_label() -> str:
    """Which worker speaks, when several do (torchrun sets RANK)."""
    return f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return {"train": cmd_train, "demo": cmd_demo}[args.command](args)
    except MeshtuneError as exc:
        if args.debug:
            raise
        print(f"meshtune: error{worker_label()}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshtune: interrupted", file=sys.stderr)
        return 130
