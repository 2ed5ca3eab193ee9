"""The final save: a PEFT adapter directory (LoRA) or a safetensors model directory (full), plus the tokenizer.

Sharded parameters (FSDP2) are gathered to full tensors first; only rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtune.distributed import DistEnv, barrier
from meshtune.model.parallel import unwrap


def gather_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Full CPU tensors on rank 0 (empty elsewhere); a collective, so every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def save_final(model: torch.nn.Module, tokenizer, out_dir: Path, is_lora: bool, env: DistEnv) -> Path:
    state = gather_state_dict(model, trainable_only=is_lora)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        inner = unwrap(model)
        # peft filters the adapter weights out of `state` and writes adapter_config.json + safetensors;
        # transformers writes config.json + (sharded) safetensors with an index for large models
        inner.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
    barrier()
    return out_dir
