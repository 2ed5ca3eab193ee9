"""`meshtune train | launch | preview | demo`: errors a user can act on are printed without a traceback (`--debug`
shows it)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import shlex
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path

from meshtune import __version__, logs
from meshtune.errors import MeshtuneError, lasting_storage_error
from meshtune.launch.torchrun import end_workers_line
from meshtune.launch.supervise import (launch_training, leave_launcher, lost_peers, mark_worker_started,
                                       ran_torchrun, repeated_failure, report_to_launcher, stop_restarts,
                                       worker_label)

logger = logging.getLogger(__name__)

TRAIN_HELP = """\
Fine-tune a model from one YAML config plus key=value overrides, e.g.
  meshtune train cfg.yaml learning_rate=1e-4 max_steps=50 nproc_per_node=2

Configs from other tools run as they are: a LLaMA-Factory training YAML (its dataset_info.json names, template
names, deepspeed: JSON), a DeepSpeed JSON through `deepspeed: ds.json` or `--deepspeed ds.json`, and the
`--key value` flags of HF-style scripts such as Qwen's finetune.py, with or without a YAML:
  meshtune train --model_name_or_path Qwen2.5-7B --data_path train.json --bf16 True --use_lora \\
                 --deepspeed ds_config_zero2.json --output_dir out
Keys of those tools that meshtune does not use are listed in one warning with the reason; keys whose absence
would change what is trained are errors. docs/migration.md has the full tables.

With nproc_per_node > 1 meshtune starts torchrun itself; under torchrun it trains directly.
Outputs in output_dir: config.yaml (the keys as given), run_plan.json (every auto and default as resolved for this
run, with the reason), metrics.jsonl, loss.png (unless plot_loss: false), checkpoint-N/ (with save_steps), final/
(PEFT adapter or HF model dir).
"""

DOCTOR_HELP = """\
Run on every node, with the environment training will have (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
NPROC_PER_NODE, or SLURM / PBS / PyTorchJob), the same command on each: `meshtune doctor cfg.yaml`.
The nodes meet on MASTER_ADDR:MASTER_PORT (node 0 hosts a small key-value store there and releases it on exit);
node 0 prints one table, a row per check and a column per node, each cell ✔ / ✘ / ! with the fix below it:
  - every node joined within --timeout, with its own NODE_RANK below NNODES
  - NNODES, MASTER_ADDR, MASTER_PORT and processes per node agree; so do the config keys all nodes share
  - GPUs (count, model), driver, CUDA and NCCL versions; torch, transformers, peft, torchao and meshtune
    versions and a hash of meshtune's installed code
  - model and dataset files: present, with node 0's checksums (cached by path, size and time: hashed once)
  - output_dir writable, one storage for all nodes, room for the checkpoints kept
  - clocks against node 0; the interface that routes to MASTER_ADDR, with the NCCL_SOCKET_IFNAME /
    GLOO_SOCKET_IFNAME to set when another would be used; InfiniBand devices
With --bandwidth the nodes then form a torch.distributed process group (gloo on CPU, NCCL when every node has
GPUs; one process a node, in the doctor's store) and measure all-reduce from 1 KiB (latency) up to 16 MiB (CPU) or
256 MiB (GPU), as nccl-tests reports it (algbw = bytes / time, busbw = algbw x 2(n-1)/n), then each pair of
nodes, so a slow link is named; node 0 judges the link against what the config moves across nodes each optimizer
step under its parallel mode (rows: all-reduce bus bandwidth, latency, slowest pair, verdict for <parallel>).
The other nodes print the rows that concern them. Exit code 1 when any check fails (✘).
`meshtune train` runs these checks itself before starting torchrun on several nodes (config key preflight).
"""

PREVIEW_HELP = """\
Show what `meshtune train` with the same config and overrides trains on, without training: no process group, no
GPU, no model weights (the tokenizer only). The data takes training's own path: read, rendered with the chat
template, tokenized and cut to cutoff_len into the tokenized cache (output_dir/tokenized or tokenized_path; built
here when no run has built it yet, and then reused by train), and the samples shown are that cache's rows.

It prints:
  - the template and which turns it trains; the settings that shape the samples
  - each dataset: its files, the format their records were read in, their record counts; records -> samples,
    tokens and trained tokens; min / median / p95 / max of the tokens per sample as trained, before cutoff_len, and
    of the trained tokens per sample (median and p95 interpolated as numpy.percentile does); the samples cutoff_len
    truncates (longer than cutoff_len: cut as LLaMA-Factory cuts, turn by turn, each turn's prompt and response
    shortened to share what is left; the last turn first with mask_history) and drops (no trained token left in
    what is kept), the records skip_invalid skipped, the samples val_size holds out
  - N samples (-n; --index or --seed choose which), decoded from the cache's token ids with the template's
    special tokens written out (<|im_start|>, <|im_end|>, ...):
      ⟦text⟧   trained: the loss has these tokens as targets (their label in the cache is the token itself)
      ⟦→x⟧     a target that is not the input token at that place: the loss trains x there, and the token
               written after the mark is input only (templates without end-of-turn text, glm4 and baichuan2,
               train eos so where the next turn begins)
      the rest is context only (label -100). A sample's first token is never a target: nothing comes before it.
    On a terminal the trained text is green too (--color).
Samples are numbered by their position in the tokenized training data, from 0, as a non-finite step's error names
them; each header names the file and record the sample came from.
--json prints the same as one JSON document: each sample also with its input_ids, the cache's labels and a 0/1
"trained" list.
"""

LAUNCH_HELP = """\
Run this node's part of a training job: the same command on every node, only the node rank differs.
Prints where each setting came from, then starts torchrun (c10d rendezvous at MASTER_ADDR:MASTER_PORT,
--max-restarts max_restarts) or, for one process on one node, trains directly. Same arguments as `train`.

With --scheduler slurm|pbs|k8s it starts nothing and writes a job file for the whole job instead (to stdout, or
--output FILE): an sbatch script, a PBS job script, or a Kubeflow PyTorchJob with the config in a ConfigMap. The
config is checked first; each node of the job runs `meshtune launch` on it with the same overrides, and the file
stops the training with a checkpoint before a time limit and runs it again (resuming) after a requeue.
docs/schedulers/ has one page per scheduler.
"""

CHAT_HELP = """\
Talk to a trained model: each line on stdin is your turn, the answer is streamed as it is generated, and the
conversation keeps its history. DIR is what meshtune wrote: a run's output_dir (its final/, else its newest
complete checkpoint, exported into a temporary folder first), final/ itself (a PEFT adapter or a full model), a
checkpoint-N, or an export (`meshtune export`, adapter or merged); or a base model with --adapter PATH.
Prompts are rendered with the chat template saved with the model, as training rendered them (--template NAME for a
model saved without one). On a terminal: /reset starts a new conversation, /exit or Ctrl-D ends it, Ctrl-C stops an
answer. From a pipe, every line is a turn and every answer one line of stdout:
  printf 'Hi!\\nAnd then?\\n' | meshtune chat output_dir
"""

LAUNCH_EPILOG = """\
where each setting comes from (the first that has it wins):
  1. config keys (YAML or key=value): nnodes, node_rank, master_addr, master_port, nproc_per_node
  2. env: NNODES (N, or MIN:MAX for elastic), NODE_RANK, MASTER_ADDR, MASTER_PORT,
     NPROC_PER_NODE (or GPUS_PER_NODE)
  3. the scheduler:
     SLURM (SLURM_JOB_ID): SLURM_JOB_NUM_NODES, SLURM_NODEID, first host of SLURM_JOB_NODELIST,
       SLURM_GPUS_ON_NODE; run one task per node (srun --ntasks-per-node=1)
     PBS (PBS_JOBID, PBS_NODEFILE): the node file's hosts; node 0 is the first, this node's rank its place
     Kubeflow PyTorchJob: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE;
       else WORLD_SIZE pods and RANK = this pod's index
  4. defaults: 1 node, rank 0, 127.0.0.1, one process per visible GPU (1 on CPU)
Several nodes need MASTER_PORT (or master_port:) set to the same free port on every node: no scheduler
gives one, and a random port per node never meets.

examples:
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 MASTER_PORT=29500 meshtune launch cfg.yaml   # on node01
  NNODES=2 NODE_RANK=1 MASTER_ADDR=node01 MASTER_PORT=29500 meshtune launch cfg.yaml   # on node02
  MASTER_PORT=29500 srun --ntasks-per-node=1 meshtune launch cfg.yaml                  # in an sbatch script
  meshtune launch --dry-run cfg.yaml       # print this node's settings and torchrun command, start nothing
  meshtune launch --scheduler slurm cfg.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 --output job.sbatch
  meshtune launch --scheduler pbs cfg.yaml --nodes 2 --gpus-per-node 4 --queue gpu --output job.pbs
  meshtune launch --scheduler k8s cfg.yaml output_dir=/shared/runs/a --nodes 2 --gpus-per-node 8 \\
      --image registry.example.com/meshtune:1.0 --pvc shared-rwx --output job.yaml
"""


def key_scopes() -> str:
    from meshtune.config import MATH, NODE, TrainConfig

    return "\n" + textwrap.fill(f"The run's math, and its identity in every checkpoint, is set by: "
                                f"{', '.join(TrainConfig.keys_of(MATH))}. "
                                f"Every node must run with the same keys, except: "
                                f"{', '.join(TrainConfig.keys_of(NODE))}.",
                                width=116) + "\n\nconfig keys (default, meaning):\n"


LOG_LEVEL_HELP = (f"the least severe of meshtune's log records shown (default: env {logs.LEVEL_ENV}, else info; "
                  f"--debug: debug); global rank 0's only, unless log_level_all_ranks or {logs.ALL_RANKS_ENV} "
                  f"names a level for every rank")


def debug_option() -> argparse.ArgumentParser:
    """`--debug` for each command: without a default of its own, so a command does not undo `meshtune --debug
    COMMAND` (meshtune's own `--debug` gives the default)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    options.add_argument("--log-level", choices=logs.LEVELS, default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    return options


def job_arguments() -> argparse.ArgumentParser:
    """The config and its overrides, as `train`, `launch` and `doctor` take them."""
    arguments = argparse.ArgumentParser(add_help=False)
    arguments.add_argument("config", nargs="?",
                           help="YAML config file (meshtune's or LLaMA-Factory's); optional with --key value flags")
    arguments.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    return arguments


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """meshtune's parser and each command's own."""
    from meshtune.config import describe_keys

    debug, job = debug_option(), job_arguments()
    parser = argparse.ArgumentParser(prog="meshtune", description="Fine-tune LLMs on one GPU, one node or many.")
    parser.add_argument("--version", action="version", version=f"meshtune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("--log-level", choices=logs.LEVELS, help=LOG_LEVEL_HELP)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="fine-tune from a YAML config", parents=[job, debug],
                                description=TRAIN_HELP + key_scopes() + describe_keys(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.epilog = ("--key value: any config key, or a flag of Qwen's finetune.py / HF TrainingArguments, in any order "
                    "with key=value overrides")

    launch = commands.add_parser("launch", help="run this node's part of a one- or many-node job", parents=[job, debug],
                                 description=LAUNCH_HELP, epilog=LAUNCH_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_argument("--dry-run", action="store_true",
                        help="print this node's settings and the exact command, start nothing")
    add_scheduler_options(launch)

    doctor = commands.add_parser("doctor", help="check every node before a multi-node run (run it on each node)",
                                 parents=[job, debug], description=DOCTOR_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the other nodes (default 30): a node that has not joined by then "
                             "is named in the table")
    doctor.add_argument("--json", metavar="FILE", help="node 0 also writes the table as JSON here")
    doctor.add_argument("--bandwidth", action="store_true",
                        help="also measure the link between the nodes (all-reduce and each pair; under 60 s on "
                             "healthy nodes) and judge it against what this config moves each step")

    preview = commands.add_parser("preview", help="show the samples, trained tokens and lengths training will see",
                                  parents=[job, debug], description=PREVIEW_HELP,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    preview.add_argument("-n", "--samples", type=int, default=3, metavar="N",
                         help="samples to show (default 3): the first N, or N drawn with --seed")
    preview.add_argument("--index", type=positions, metavar="I[,J...]",
                         help="the samples at these positions in the tokenized training data (from 0)")
    preview.add_argument("--seed", type=int, help="draw the samples at random with this seed (the same each time)")
    preview.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                         help="green trained text: auto (default) on a terminal only, always, never")
    preview.add_argument("--json", action="store_true", help="print one JSON document instead of text")

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

    chat = commands.add_parser("chat", help="talk to a trained model: prompts on stdin, answers streamed",
                               parents=[debug], description=CHAT_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("dir", help="output_dir, its final/, a checkpoint-N, an export, or a base model (with --adapter)")
    chat.add_argument("--adapter", metavar="PATH", type=Path,
                      help="a PEFT adapter (a LoRA run's final/ or output_dir, an export) on the base model DIR")
    chat.add_argument("--base", metavar="DIR", type=Path,
                      help="the base model under the adapter DIR (default: the one it names, where it was trained)")
    chat.add_argument("--template", metavar="NAME",
                      help="render prompts with this chat template instead of the one saved with the model "
                           "(chatml, qwen, llama3, ...: the names of the config key `template`)")
    chat.add_argument("--system", metavar="TEXT", help="a system prompt that starts the conversation")
    chat.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="longest answer (default 512)")
    chat.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="0 (default): greedy, the same answers every time; above 0: sampled")
    chat.add_argument("--top-p", type=float, default=1.0, metavar="P",
                      help="nucleus sampling when sampled (default 1.0: off)")
    chat.add_argument("--device", default="auto", help="auto (default: cuda when there is a GPU, else cpu), cpu, "
                                                       "cuda or cuda:N")
    chat.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                      help="weights' dtype (default auto: bf16 on a GPU that has it, else fp32)")
    chat.add_argument("--show-prompt", action="store_true",
                      help="print each prompt as the model receives it, rendered (to stderr)")

    demo = commands.add_parser("demo", help="the embedded default: a tiny model learns a task with LoRA on 2 processes",
                               parents=[debug],
                               description="Build a tiny model, tokenizer and dataset locally (no download), "
                                           "fine-tune with LoRA on 2 CPU processes and show answers before and after.")
    demo.add_argument("--prepare", metavar="DIR", help="only write the model, tokenizer, data and config.yaml into DIR")
    demo.add_argument("--dir", metavar="DIR", default="demo_run", help="where the demo works (default: ./demo_run)")
    return parser, commands.choices


def positions(text: str) -> list[int]:
    """`--index 3,17`: sample positions."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positions as numbers separated by commas, e.g. 3,17")


SCHEDULER_OPTIONS = ("--scheduler", "--nodes", "--gpus-per-node", "--cpus-per-node", "--time", "--job-name",
                     "--output", "--python", "--partition", "--account", "--queue", "--image", "--pvc", "--namespace",
                     "--elastic", "--mount")


def add_scheduler_options(launch: argparse.ArgumentParser) -> None:
    from meshtune.launch.scheduler_files import SCHEDULERS

    group = launch.add_argument_group("job file (--scheduler: write it, start nothing)")
    group.add_argument("--scheduler", choices=SCHEDULERS, help="write a job file for this scheduler")
    group.add_argument("--nodes", type=int, metavar="N", help="nodes of the job")
    group.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs each node gets (0: CPU only)")
    group.add_argument("--cpus-per-node", type=int, metavar="C",
                       help="CPU cores each node gets (default: the scheduler's)")
    group.add_argument("--time", metavar="LIMIT", help="slurm, pbs: time limit, minutes or [DAYS-]HH:MM:SS")
    group.add_argument("--job-name", metavar="NAME", help="default: output_dir's last part")
    group.add_argument("--output", metavar="FILE", help="write the file here (default: stdout)")
    group.add_argument("--python", metavar="PATH", help="the python every node runs meshtune with (default: this one; "
                                                        "k8s: the image's meshtune)")
    group.add_argument("--partition", help="slurm: the partition")
    group.add_argument("--account", help="slurm, pbs: the account charged")
    group.add_argument("--queue", help="pbs: the queue")
    group.add_argument("--image", help="k8s (required): the container image, with meshtune installed")
    group.add_argument("--pvc", metavar="NAME", help="k8s (required): a ReadWriteMany PersistentVolumeClaim mounted at "
                                                     "output_dir")
    group.add_argument("--namespace", help="k8s: the namespace")
    group.add_argument("--elastic", metavar="MIN:MAX", help="k8s: an elastic job of MIN to MAX pods")
    group.add_argument("--mount", action="append", metavar="CLAIM:PATH[:ro]",
                       help="k8s: a PersistentVolumeClaim mounted at PATH in every pod (read-only with :ro), for the "
                            "model and data the config names; repeat it for several")


def load_training_config(args: argparse.Namespace):
    """The config and the `train` arguments every torchrun worker gets; warnings printed once per node."""
    import os

    from meshtune.compat.job_config import load_job_config
    from meshtune.mailbox import Mailbox
    from meshtune.worker_env import torchrun_worker

    if args.config is not None and "=" in args.config and not Path(args.config).is_file():
        args.overrides.insert(0, args.config)  # `meshtune train --flag v key=value`: no YAML given
        args.config = None
    if args.config is None and not args.flags:
        raise MeshtuneError("no config: give a YAML file (meshtune train cfg.yaml) or --key value flags "
                            "(meshtune train --model_name_or_path DIR --data_path train.json ...)")
    loaded = load_job_config(args.config, args.overrides, args.flags)
    # meshtune's launcher speaks for its workers; under the user's own torchrun, global rank 0 does
    if not torchrun_worker() or (Mailbox.of_launcher() is None and os.environ.get("RANK") == "0"):
        for line in loaded.warnings:
            logger.warning(f"meshtune: warning: {line}", extra=logs.TO_STDERR)
    level = log_level(args)  # the workers' console as this process's
    argv = ["train", *(["--log-level", level] if level else []), *([args.config] if args.config else []),
            *args.overrides, *args.flag_tokens]
    return loaded.config, argv


def log_level(args: argparse.Namespace) -> str | None:
    """--log-level, or debug with --debug; None leaves it to MESHTUNE_LOG_LEVEL."""
    return args.log_level or ("debug" if args.debug else None)


def cmd_train(args: argparse.Namespace) -> int:
    cfg, argv = load_training_config(args)  # every config error surfaces here, before any process starts
    return launch_training(cfg, argv, debug=args.debug)


def cmd_launch(args: argparse.Namespace) -> int:
    from meshtune.launch import describe, detect_node_settings, launch_env, needs_torchrun, torchrun_command

    given = [option for option in SCHEDULER_OPTIONS if getattr(args, option[2:].replace("-", "_")) is not None]
    if args.scheduler:
        return write_job_file(args, given)
    if given:
        raise MeshtuneError(f"{', '.join(given)}: options of a job file; add --scheduler slurm, pbs or k8s")
    cfg, argv = load_training_config(args)
    if not args.dry_run:
        return launch_training(cfg, argv, debug=args.debug)
    settings = detect_node_settings(cfg)
    print(describe(settings))
    if needs_torchrun(settings):
        env = [f"{key}={value}" for key, value in launch_env(settings, cfg.stop_grace_period).items()]
        print(shlex.join([*env, *torchrun_command(settings, argv, cfg)]))
    else:
        print(f"one process: trains in this process, no torchrun ({shlex.join(['meshtune', *argv])})")
    return 0


def write_job_file(args: argparse.Namespace, given: list[str]) -> int:
    """`launch --scheduler`: the config checked as for training, then the job file written, nothing started."""
    import os

    from meshtune.launch.scheduler_files import JobRequest, job_file, unmounted_warning

    if args.dry_run:
        raise MeshtuneError("--dry-run and --scheduler: --scheduler starts nothing either; leave out --dry-run")
    if args.nodes is None or args.gpus_per_node is None:
        raise MeshtuneError("--scheduler needs --nodes N and --gpus-per-node G (0 for CPU only)")
    cfg, _ = load_training_config(args)
    job = JobRequest(
        scheduler=args.scheduler, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        config=Path(args.config).absolute() if args.config else None,
        launch_args=[*args.overrides, *args.flag_tokens], workdir=Path.cwd(),
        python=args.python or (None if args.scheduler == "k8s" else sys.executable),
        command_line=args.command_line, job_name=args.job_name, time=args.time, cpus_per_node=args.cpus_per_node,
        partition=args.partition, account=args.account, queue=args.queue, image=args.image, pvc=args.pvc,
        namespace=args.namespace, elastic=args.elastic, mount=tuple(args.mount) if args.mount else None,
        deepspeed=deepspeed_named(args),
        given=tuple(option[2:].replace("-", "_") for option in given))
    text = job_file(job, cfg)
    if warning := unmounted_warning(job, cfg):
        print(f"meshtune: warning: {warning}", file=sys.stderr)
    if not args.output:
        sys.stdout.write(text)
        return 0
    Path(args.output).write_text(text)
    if args.scheduler != "k8s":
        os.chmod(args.output, 0o755)
    submit = {"slurm": "sbatch", "pbs": "qsub", "k8s": "kubectl apply -f"}[args.scheduler]
    print(f"meshtune: wrote {args.output}; submit it with: {submit} {args.output}")
    return 0


def deepspeed_named(args: argparse.Namespace) -> str | None:
    """The DeepSpeed JSON the job's config, flags or overrides name (the last wins, as for every key)."""
    from meshtune.config import load_yaml, parse_overrides

    values = {**(load_yaml(args.config) if args.config else {}), **args.flags, **parse_overrides(args.overrides)}
    return str(values["deepspeed"]) if values.get("deepspeed") else None


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from meshtune.launch import detect_node_settings
    from meshtune.doctor.meeting import run_doctor
    from meshtune.model.custom_code import refuse_custom_code

    cfg, _ = load_training_config(args)
    refuse_custom_code(cfg.model_name_or_path)  # a job that could never start: said before the nodes meet
    code, report = run_doctor(cfg, detect_node_settings(cfg), args.timeout, bandwidth=args.bandwidth,
                              progress=lambda line: print(f"meshtune doctor: {line}", flush=True))
    if "skipped" in report:
        print(f"meshtune doctor: nothing checked: {report['skipped']}")
    if args.json and report.get("columns") is not None:
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return code


def cmd_preview(args: argparse.Namespace) -> int:
    import json

    from meshtune.data.preview import preview, render_text, use_color
    from meshtune.model.model_dir import check_model_dir, load_tokenizer

    if args.index is not None and args.seed is not None:
        raise MeshtuneError("--index and --seed both choose the samples shown; give one of them")
    cfg, _ = load_training_config(args)  # the errors train gives, before any data is read
    tokenizer = load_tokenizer(check_model_dir(cfg.model_name_or_path))
    report = preview(cfg, tokenizer, samples=args.samples, indices=args.index, seed=args.seed,
                     show_progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(render_text(report, color=use_color(args.color, sys.stdout)))
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
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


def cmd_export(args: argparse.Namespace) -> int:
    from meshtune.export.merge import export

    with from_store(args.source) as source:
        written = export(source, Path(args.output), args.merge, args.dtype, args.force, args.base_model)
    print(f"meshtune: wrote {written}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from meshtune.export.chat import ChatOptions, run_chat, terminal_lines

    options = ChatOptions(adapter=args.adapter, base=args.base, template=args.template, system=args.system,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          device=args.device, dtype=args.dtype, show_prompt=args.show_prompt)
    interactive = sys.stdin.isatty()
    with from_store(args.dir) as source:
        return run_chat(source, options, terminal_lines() if interactive else sys.stdin, interactive)


def cmd_demo(args: argparse.Namespace) -> int:
    from meshtune.demo.run import run_demo

    return run_demo(prepare_only=args.prepare, work_dir=args.dir)


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


def restart_cannot_fix(exc: Exception) -> MeshtuneError | None:
    """The error as a MeshtuneError when every restart would meet it again, so the job stops at once with it as
    the last line: storage that is read-only, full or forbidden, or a worker failing exactly as in an earlier
    attempt (its traceback is printed first). None for anything a restart may cure."""
    if isinstance(exc, OSError) and (lasting := lasting_storage_error(exc)) is not None:
        return lasting
    repeated = repeated_failure(exc)
    if repeated is not None:
        traceback.print_exc()
    return repeated


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
# and again while they are created, a sixth of a worker's start-up on 2 cores (measured in docs/benchmarks/where-the-time-goes.md).
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
    """The command, its errors printed once without a trace (--debug raises them)."""
    try:
        try:
            logs.configure(log_level(args))
            return {"train": cmd_train, "launch": cmd_launch, "ckpt": cmd_ckpt, "export": cmd_export, "demo": cmd_demo,
                    "doctor": cmd_doctor, "preview": cmd_preview, "chat": cmd_chat}[args.command](args)
        except MeshtuneError:
            raise
        except Exception as exc:
            lasting = None if args.debug else restart_cannot_fix(exc)
            if lasting is None and not args.debug and lost_peers(exc):
                return 1  # said in one line; torchrun restarts the workers
            if lasting is None:
                raise  # a crash another attempt may not meet: torchrun restarts the workers
            raise lasting from exc
    except MeshtuneError as exc:
        if args.debug:
            raise
        reported = report_to_launcher(str(exc))  # the launcher prints it once, last, and tells the other nodes
        label = worker_label()
        if label is not None and not reported:  # under the user's own torchrun one worker per node speaks
            end_workers_line()
            print(f"meshtune: error{label}: {exc}", file=sys.stderr)
        stop_restarts()  # the same error would end every attempt
        return getattr(exc, "exit_code", 1)
    except KeyboardInterrupt:
        print("meshtune: interrupted", file=sys.stderr)
        return 130
