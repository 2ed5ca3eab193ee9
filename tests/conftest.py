"""Shared fixtures: a tiny local model + tokenizer + dataset (nothing downloaded), and a CLI runner that
always cleans up every process it started."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the bench scripts' process-tree helpers serve the tests too

from meshtune.demo.model import build_tiny_model  # noqa: E402
from meshtune.demo.tokenizer import train_tokenizer  # noqa: E402
from processes import kill_tree  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rain, "
         "sun and wind in the green valley near our old house").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 5, 30) for _ in range(300)], vocab_size=320)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("model"), seed=0,
                            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """64 conversations in the messages format, of varied lengths, some multi-turn with a system prompt."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for i in range(64):
            messages = [{"role": "system", "content": sentence(rng, 2, 5)}] if i % 4 == 0 else []
            for _ in range(1 + (i % 3 == 0)):
                messages += [{"role": "user", "content": sentence(rng, 2, 12)},
                             {"role": "assistant", "content": sentence(rng, 1, 10)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_config(directory: Path, **values) -> Path:
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def base_config(model_dir: Path, dataset: Path, output_dir: Path, **extra) -> dict:
    values = dict(model_name_or_path=str(model_dir), dataset=str(dataset), output_dir=str(output_dir),
                  finetuning_type="lora", lora_rank=4, lora_dropout=0.0, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, learning_rate=5e-3, max_steps=5, logging_steps=1,
                  cutoff_len=64, seed=7, parallel="ddp", nproc_per_node=1)
    values.update(extra)
    return values


def run_cli(args: list[str], timeout: float = 240, cwd: Path | None = None, env: dict | None = None):
    """`python -m meshtune ARGS` with a hard timeout; every process it started is killed on the way out."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "meshtune", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=cwd, env=full_env)
    started = time.monotonic()
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"meshtune {' '.join(args)} did not finish in {timeout} s:\n{output[-4000:]}")
    finally:
        kill_tree(process.pid)
    return subprocess.CompletedProcess(args, process.returncode, output, None), time.monotonic() - started


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
