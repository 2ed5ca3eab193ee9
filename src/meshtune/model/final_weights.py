"""The final save: a PEFT adapter directory (LoRA) or a safetensors model directory (full), plus the tokenizer.

Sharded parameters (FSDP2) are gathered to full tensors first; only rank 0 writes, into the directory
checkpoint/final.py then seals and publishes as `final/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtune.model.model_dir import TOKENIZER_FILES, safetensors_problem
from meshtune.model.parallel import unwrap


def gather_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Full CPU tensors on rank 0 (empty elsewhere); a collective, so every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def save_final(model: torch.nn.Module, state: dict[str, torch.Tensor], tokenizer, directory: Path,
               chat_template: str | None = None) -> None:
    """Rank 0: the model's `state` (from `gather_state_dict`) and the tokenizer into `directory`. `chat_template`:
    the template training rendered with, saved with the tokenizer when it is not the tokenizer's own, so
    `apply_chat_template` on the trained model renders prompts as they were trained."""
    # peft filters the adapter weights out of `state` and writes adapter_config.json + safetensors;
    # transformers writes config.json + (sharded) safetensors with an index for large models
    unwrap(model).save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))


def export_kind(path: Path) -> str | None:
    """'PEFT adapter' or 'Hugging Face model' for a directory save_final writes; None for anything else."""
    if (path / "adapter_config.json").is_file():
        return "PEFT adapter"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "Hugging Face model"
    return None


def verify_export(path: Path) -> list[str]:
    """Problems of a final export: its weights files (each safetensors header against the file's size, every
    shard an index lists) and its tokenizer."""
    weights = sorted(path.glob("*.safetensors"))
    problems = [] if weights else ["no *.safetensors weights"]
    problems += [problem for file in weights if (problem := safetensors_problem(file))]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        problems += [f"{name} listed in {index.name} is missing" for name in sorted(shards)
                     if not (path / name).is_file()]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append("no tokenizer files")
    return problems
