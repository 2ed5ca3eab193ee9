"""`meshtune train`: fine-tune from a config; `train --help` lists every key by section."""

from __future__ import annotations

import argparse
import textwrap

from meshtune.cli.job import load_training_config
from meshtune.launch.supervise import launch_training


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


def key_scopes() -> str:
    from meshtune.config import MATH, NODE, TrainConfig

    return "\n" + textwrap.fill(f"The run's math, and its identity in every checkpoint, is set by: "
                                f"{', '.join(TrainConfig.keys_of(MATH))}. "
                                f"Every node must run with the same keys, except: "
                                f"{', '.join(TrainConfig.keys_of(NODE))}.",
                                width=116) + "\n\nconfig keys (default, meaning):\n"


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune train` and its options on meshtune's parser."""
    from meshtune.config import describe_keys

    train = commands.add_parser("train", help="fine-tune from a YAML config", parents=[job, debug],
                                description=TRAIN_HELP + key_scopes() + describe_keys(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.epilog = ("--key value: any config key, or a flag of Qwen's finetune.py / HF TrainingArguments, in any order "
                    "with key=value overrides")


def run(args: argparse.Namespace) -> int:
    cfg, argv = load_training_config(args)  # every config error surfaces here, before any process starts
    return launch_training(cfg, argv, debug=args.debug)
