"""LoRA adapters through peft, so the saved adapter is a standard PEFT directory."""

from __future__ import annotations

import hashlib
import math

import torch
from peft import LoraConfig, get_peft_model
from peft.utils import ModulesToSaveWrapper
from transformers import PreTrainedModel

from meshtune.config import TrainConfig
from meshtune.errors import ConfigError


def linear_module_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


# Qwen(1)'s layer names (its finetune.py's lora_target_modules) and the same layers in Qwen2 and Llama-style models
QWEN1_LINEARS = {"c_attn": ("q_proj", "k_proj", "v_proj"), "c_proj": ("o_proj", "down_proj"), "w1": ("up_proj",),
                 "w2": ("gate_proj",)}


def add_lora(model: PreTrainedModel, cfg: TrainConfig) -> torch.nn.Module:
    """Wrap `model` with LoRA; the init of the A matrices draws from torch's RNG, seeded by the caller."""
    available = linear_module_names(model)
    if cfg.lora_target == ["all"]:
        targets: str | list[str] = "all-linear"  # peft: every linear layer except the output head
    else:
        targets = lora_targets(cfg.lora_target, available)
    in_full = trained_in_full(cfg.additional_target, model)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM", bias="none", modules_to_save=in_full or None)
    model = get_peft_model(model, lora)
    for wrapper in model.modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            wrapper.modules_to_save.float()  # master weights: fp32 even where the frozen base is bf16
    return model


def trained_in_full(names: list[str], model: torch.nn.Module) -> list[str]:
    """The modules `names` (additional_target) means, by the last part of their names, as peft's modules_to_save
    finds them; Qwen(1)'s `wte` is the model's input embedding and `lm_head` its output head, whatever their
    names."""
    by_module = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name}
    roles = {"wte": model.get_input_embeddings(), "lm_head": model.get_output_embeddings()}
    found = []
    for name in names:
        if name in by_module.values():
            found.append(name)
        elif roles.get(name) in by_module:
            found.append(by_module[roles[name]])
        else:
            raise ConfigError(f"additional_target: {name} is not a module of the model; give the last part of a "
                              f"module's name, e.g. {by_module[model.get_input_embeddings()]} (the embedding) or "
                              f"{by_module.get(model.get_output_embeddings(), 'lm_head')} (the output head)")
    return list(dict.fromkeys(found))


def lora_targets(names: list[str], available: set[str]) -> list[str]:
    """The model's linear layers `names` means: as given, or Qwen(1)'s names (c_attn, c_proj, w1, w2) as the same
    layers of a model that names them otherwise."""
    unknown = [name for name in names if name not in available]
    translated = [new for name in names for new in (QWEN1_LINEARS.get(name, (name,)) if name in unknown else (name,))]
    if unknown and all(name in QWEN1_LINEARS for name in unknown) and set(translated) <= available:
        return list(dict.fromkeys(translated))
    if unknown:
        raise ConfigError(f"lora_target: {', '.join(unknown)} not found in the model; its linear layers are "
                          f"{', '.join(sorted(available))} (or use lora_target: all)")
    return list(names)


def initial_adapter_weight(name: str, shape: torch.Size, seed: int) -> torch.Tensor | None:
    """The starting value of an adapter weight built without values (on the meta device): B zeros and A
    Kaiming-uniform, as peft initialises them, A drawn from a generator seeded by `seed` and the adapter's name, so
    every process and every layout starts from the same adapters whatever order it builds them in. None for a
    name that is no LoRA A or B weight."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    if ".lora_A." not in name:
        return None
    stream = int.from_bytes(hashlib.sha256(f"{seed}:{name.removeprefix('base_model.model.')}".encode()).digest()[:8],
                            "little")
    weight = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=torch.Generator().manual_seed(stream))
    return weight
