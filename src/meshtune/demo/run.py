"""`meshtune demo`: build everything locally, fine-tune with LoRA on 2 processes (1 on a one-GPU machine), show
the gain.

The training goes through exactly what a user runs (`meshtune train config.yaml`, which starts torchrun), so
the demo doubles as a check that the install works end to end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshtune.compat.job_config import load_config
from meshtune.demo.assets import prepare
from meshtune.demo.dataset import heldout_examples
from meshtune.demo.model import generate_answers

SHOWN = 6  # held-out prompts printed before / after


def answers_of(model_dir: Path, adapter_dir: Path | None, prompts: list[str]) -> list[str]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return generate_answers(model.eval(), tokenizer, prompts)


def accuracy(answers: list[str], expected: list[str]) -> float:
    return sum(a.strip() == e.strip() for a, e in zip(answers, expected)) / max(1, len(expected))


def loss_trail(metrics_path: Path, points: int = 8) -> str:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    stride = max(1, len(train) // points)
    picked = train[::stride] + ([train[-1]] if (len(train) - 1) % stride else [])
    return "  ".join(f"{r['step']}:{r['loss']:.3f}" for r in picked)


def table(examples: list[tuple[str, str]], before: list[str], after: list[str]) -> str:
    lines = [f"{'held-out prompt':<58} {'expected':<10} {'before':<18} {'after':<10}"]
    for (prompt, expected), b, a in zip(examples, before, after):
        short = prompt if len(prompt) <= 56 else prompt[:53] + "..."
        lines.append(f"{short:<58} {expected:<10} {b[:16]!r:<18} {a[:16]!r:<10}")
    return "\n".join(lines)


def run_demo(prepare_only: str | None, work_dir: str) -> int:
    from meshtune.cpu_affinity import cuda_device_count

    gpus = cuda_device_count()  # the demo's processes fit this machine: 2 on CPU or on 2+ GPUs, 1 on one GPU
    if prepare_only:
        config_path = prepare(Path(prepare_only).resolve(), gpus=gpus)
        print(f"wrote the tiny model, tokenizer, dataset and {config_path}\n"
              f"train it with:  meshtune train {config_path}")
        return 0

    from meshtune.launch.supervise import launch_training

    started = time.perf_counter()
    work = Path(work_dir).resolve()
    config_path = prepare(work, gpus=gpus)
    cfg = load_config(config_path)
    model_dir = Path(cfg.model_name_or_path)
    examples = heldout_examples(work / "data" / "heldout.jsonl")
    prompts, expected = [p for p, _ in examples], [e for _, e in examples]
    where = (f"{cfg.nproc_per_node} GPU{'s' if cfg.nproc_per_node > 1 else ''}" if gpus else "CPU")
    processes = f"{cfg.nproc_per_node} process{'es' if cfg.nproc_per_node > 1 else ''}"
    print(f"meshtune demo: a tiny Qwen2-architecture model (random init) learns a task with LoRA on {processes} "
          f"({where}); everything is in {work}")
    before = answers_of(model_dir, None, prompts)

    print(f"\n$ meshtune train {config_path}")
    launch_training(cfg, ["train", str(config_path)])  # raises when a worker fails

    output_dir = Path(cfg.output_dir)
    after = answers_of(model_dir, output_dir / "final", prompts)
    print(f"\nloss by step: {loss_trail(output_dir / 'metrics.jsonl')}")
    print(f"\n{table(examples[:SHOWN], before[:SHOWN], after[:SHOWN])}")
    print(f"\nheld-out accuracy ({len(examples)} prompts never seen in training): "
          f"before {accuracy(before, expected):.0%}, after {accuracy(after, expected):.0%}")
    print(f"adapter: {output_dir / 'final'}   curves: {output_dir / 'loss.png'}   "
          f"total {time.perf_counter() - started:.0f} s")
    print(f"\ntalk to it:  meshtune chat {output_dir}\n(a held-out prompt to try: {prompts[0]})")
    return 0
