"""LoRA adapters through peft, so the saved adapter is a standard PEFT directory."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from peft.utils import ModulesToSaveWrapper
from transformers import PreTrainedModel

from meshtune.config import TrainConfig
from meshtune.errors import ConfigError, ModelError
from meshtune.package_clash import installed_peft_torchao_clash

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def linear_module_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


# Qwen(1)'s layer names (its finetune.py's lora_target_modules) and the same layers in Qwen2 and Llama-style models,
# named in the error when a target names no layer of the model
QWEN1_LINEARS = {"c_attn": ("q_proj", "k_proj", "v_proj"), "c_proj": ("o_proj", "down_proj"), "w1": ("up_proj",),
                 "w2": ("gate_proj",)}


def add_lora(model: PreTrainedModel, cfg: TrainConfig) -> torch.nn.Module:
    """Wrap `model` with LoRA; the init of the A matrices draws from torch's RNG, seeded by the caller."""
    available = linear_module_names(model)
    if cfg.lora_target == ["all"]:
        targets: str | list[str] = "all-linear"  # peft: every linear layer except the output head
    else:  # module paths: an adapter's own list, as peft expands all-linear (model.layers.0.mlp.down_proj, ...)
        paths = [name for name in cfg.lora_target if "." in name]
        targets = lora_targets([name for name in cfg.lora_target if "." not in name], available)
        targets += linear_paths(paths, model)
    in_full = trained_in_full(cfg.additional_target, model)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM", bias="none", modules_to_save=in_full or None)
    clash = installed_peft_torchao_clash()
    if clash:  # else an ImportError from inside peft, on every node
        raise ConfigError(f"finetuning_type: {cfg.finetuning_type}: {clash}")
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
    """`names` as given: each must be a linear layer of the model (by the last part of its name), or the run stops
    naming the model's linear layers, as peft refuses targets it cannot find. Qwen(1)'s names (c_attn, c_proj, w1, w2)
    on a model that names its layers otherwise are refused too, with the layers they would mean."""
    unknown = [name for name in names if name not in available]
    if not unknown:
        return list(names)
    hints = [f"{name} is Qwen(1)'s name for {', '.join(QWEN1_LINEARS[name])}"
             for name in unknown if name in QWEN1_LINEARS and set(QWEN1_LINEARS[name]) <= available]
    hint = ""
    if len(hints) == len(unknown):
        meant = [layer for name in names for layer in (QWEN1_LINEARS[name] if name in unknown else (name,))]
        hint = f". {'; '.join(hints)} here: lora_target: {','.join(dict.fromkeys(meant))} trains those"
    raise ConfigError(f"lora_target: {', '.join(unknown)} names no linear layer of the model; its linear layers are "
                      f"{', '.join(sorted(available))} (or use lora_target: all){hint}")


def linear_paths(paths: list[str], model: torch.nn.Module) -> list[str]:
    """`paths` (module paths, as peft writes an adapter's target_modules), each checked to name a linear layer of
    the model as peft matches it: the module's name, or its end after a dot."""
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    missing = [path for path in paths if not any(name == path or name.endswith(f".{path}") for name in linears)]
    if missing:
        raise ConfigError(f"lora_target: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} names no "
                          f"linear layer of the model ({len(missing)} of {len(paths)} module paths); an adapter "
                          f"continues on the model it was trained on")
    return list(paths)


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


def saved_name(name: str) -> str:
    """A peft-wrapped model's trainable parameter by its name in a saved adapter: LoRA's `lora_A.default.weight` as
    `lora_A.weight`, a module trained in full (`modules_to_save.default.weight`) by the base's own name."""
    return re.sub(r"\.(lora_[AB])\.default\.", r".\1.", name).replace(".modules_to_save.default.", ".")


def starting_adapter(model: torch.nn.Module, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The weights of the adapter the run continues (`adapter_name_or_path`), by the names of `model`'s adapter
    parameters and trainable copies of modules trained in full (`model`: after `add_lora`, built empty or not),
    each checked against the parameter it replaces."""
    folder = Path(cfg.adapter_name_or_path).expanduser()
    config = json.loads((folder / "adapter_config.json").read_text())
    settings = {"lora_rank": (config.get("r"), cfg.lora_rank),
                "lora_alpha": (config.get("lora_alpha"), cfg.resolved_lora_alpha)}
    differing = [f"{key} {ours} (the adapter's is {theirs})" for key, (theirs, ours) in settings.items()
                 if theirs is not None and float(theirs) != float(ours)]
    if differing:
        raise ModelError(f"the run's {', '.join(differing)} differ from the adapter it continues, {folder}; set them "
                         f"as its adapter_config.json says (a config read by `meshtune train` takes them from there)")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ModelError(f"{folder / ADAPTER_WEIGHTS} not found: adapter_name_or_path needs the adapter's weights in "
                         f"safetensors (an adapter_model.bin: load it with peft and save it again)")
    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    wanted = {name: param for name, param in model.named_parameters()
              if ".lora_" in name or ".modules_to_save.default." in name}
    weights, missing = {}, []
    for name, param in wanted.items():
        key = saved_name(name)
        if key not in saved:
            missing.append(key)
        elif saved[key].shape != param.shape:
            raise ModelError(f"{folder / ADAPTER_WEIGHTS}: {key} is {list(saved[key].shape)}, the run's "
                             f"{list(param.shape)}: the adapter was trained on another model than "
                             f"{cfg.model_name_or_path}")
        else:
            weights[name] = saved.pop(key)
    misfits = [f"it lacks {missing[0]} ({len(missing)} of the run's adapter weights)"] if missing else []
    misfits += [f"it has {next(iter(saved))}, which the run has no place for"] if saved else []
    if misfits:
        raise ModelError(f"{folder / ADAPTER_WEIGHTS} does not fit the run's LoRA layers: {'; '.join(misfits)}. "
                         f"Continue it on the model it was trained on, with its target modules (lora_target)")
    return weights


def set_adapter(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` (from `starting_adapter`) into `model`'s adapter parameters, which hold values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name].to(param.dtype))
