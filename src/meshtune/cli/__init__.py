"""`meshtune train | launch | doctor | preview | ckpt | export | chat | demo`: one module a command (its options and
its run), parsed here and run with errors a user can act on printed without a traceback (`--debug` shows it)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import shlex
import sys

from meshtune import __version__, logs
from meshtune.cli import chat, ckpt, demo, doctor, export, launch, preview, train
from meshtune.cli.job import job_arguments, log_level
from meshtune.cli.options import LOG_LEVEL_HELP, debug_option
from meshtune.launch.exit_policy import run_under_exit_policy
from meshtune.launch.supervise import leave_launcher, mark_worker_started, ran_torchrun

COMMANDS = {"train": train, "launch": launch, "doctor": doctor, "preview": preview, "ckpt": ckpt, "export": export,
            "chat": chat, "demo": demo}  # each: add_to(commands, debug, job) and run(args)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """meshtune's parser and each command's own."""
    debug, job = debug_option(), job_arguments()
    parser = argparse.ArgumentParser(prog="meshtune", description="Fine-tune LLMs on one GPU, one node or many.")
    parser.add_argument("--version", action="version", version=f"meshtune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("--log-level", choices=logs.LEVELS, help=LOG_LEVEL_HELP)
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_to(commands, debug, job)
    return parser, commands.choices


def loads_models(args: argparse.Namespace) -> bool:
    """Whether the command may load a model or a tokenizer. `ckpt` and `launch --dry-run / --scheduler` never do:
    they start without transformers (and torch) in a fraction of a second."""
    if args.command == "ckpt":
        return False
    return not (args.command == "launch" and (args.dry_run or args.scheduler))


def quiet_libraries() -> None:
    """One progress bar, meshtune's: none from transformers' loading and saving, and no warning nobody can act on."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # peft reads a transformers property deprecated in v5
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


# commands whose own options may stand before, among or after the config and its overrides
INTERMIXED = ("train", "launch", "doctor", "preview")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`train`, `launch`, `doctor` and `preview` take `--key value` flags besides their own options; those are set
    apart first, and the command's own options are read wherever they stand (argparse's intermixed parsing)."""
    from meshtune.compat.flags import split_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    command = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    flags, flag_tokens = {}, []
    if command is not None and argv[command] in INTERMIXED:
        own = commands[argv[command]]
        rest, flags, flag_tokens = split_flags(argv[command + 1:], option_strings(own))
        args = parser.parse_args(argv[:command + 1])  # meshtune's own options and the command
        # by the command's parser: intermixed parsing refuses a parser with subcommands
        vars(args).update(vars(own.parse_intermixed_args(rest)))
    else:
        args = parser.parse_args(argv)
    args.flags, args.flag_tokens = flags, flag_tokens
    args.command_line = shlex.join(["meshtune", *argv])
    return args


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option `parser` declares (argparse has no public listing of them)."""
    return set(parser._option_string_actions)


# A command imports torch, transformers and peft on its way: hundreds of thousands of objects that live as long as
# the process. At Python's default first-generation threshold (700 new objects) the collector walks them again
# and again while they are created, a sixth of a worker's start-up on 2 cores (measured in
# docs/benchmarks/where-the-time-goes.md).
# The training loop collects at fixed steps on its own (train/garbage_collection.py).
COMMAND_GC_THRESHOLD = (100_000, 50, 100)


@contextlib.contextmanager
def rare_collections():
    """Python's automatic collection at COMMAND_GC_THRESHOLD while a command runs; the caller's thresholds after."""
    before = gc.get_threshold()
    gc.set_threshold(*COMMAND_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def main(argv: list[str] | None = None) -> int:
    with rare_collections():
        args = parse_args(argv)
        if loads_models(args):
            quiet_libraries()
        mark_worker_started()
        code = run_command(args)
    if ran_torchrun():  # a node's launcher: nothing is left to do but the interpreter's slow teardown
        leave_launcher(code)
    return code


def run_command(args: argparse.Namespace) -> int:
    """The command under the worker's exit policy (launch/exit_policy.py): its errors printed once without a trace
    (--debug raises them)."""
    def command() -> int:
        logs.configure(log_level(args))
        return COMMANDS[args.command].run(args)

    return run_under_exit_policy(command, debug=args.debug)
