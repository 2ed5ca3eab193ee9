"""A LoRA adapter to continue (`adapter_name_or_path`): its adapter_config.json gives the run its LoRA settings.

LLaMA-Factory continues an adapter as it was trained, whatever lora_rank or lora_target its YAML says; so does
meshtune, and a value given that the adapter contradicts is named in a warning. The settings enter the config,
so checkpoints, the cross-node check and `meshtune export` see the adapter the run trains. Its target_modules
are taken as PEFT wrote them: leaf names (LLaMA-Factory's `q_proj`) or module paths (PEFT's expansion of
`all-linear`, which meshtune's `lora_target: all` writes); its modules_to_save (LLaMA-Factory's additional_target,
Qwen's finetune.py's wte and lm_head) become `additional_target`, trained on from the adapter's copies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
# adapter_config.json entries that change what a LoRA layer computes, with the value meshtune's LoRA has
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
               "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
               "exclude_modules": None, "target_parameters": None, "layer_replication": None,
               "trainable_token_indices": None}


@dataclass
class AdapterSettings:
    values: dict[str, Any] = field(default_factory=dict)   # our LoRA keys as the adapter has them
    warnings: list[str] = field(default_factory=list)      # values given that the adapter's replace
    problems: list[str] = field(default_factory=list)      # why the adapter cannot be continued


def adapter_settings(path: str, given: dict[str, Any], where: str) -> AdapterSettings:
    """The LoRA keys of the adapter in `path` (`where` names the source of adapter_name_or_path), against the
    values `given` in the config."""
    out = AdapterSettings()
    config_file = Path(path).expanduser() / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text())
    except OSError:
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} not found; give a PEFT LoRA adapter "
                            f"directory (adapter_config.json + adapter_model.safetensors, e.g. an earlier run's "
                            f"final/; `meshtune export OUTPUT_DIR/checkpoint-N --output DIR` makes one of a "
                            f"checkpoint)")
        return out
    except ValueError as error:
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} is not valid JSON ({error})")
        return out
    if not isinstance(config, dict):
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} holds no JSON object of settings")
        return out
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} is a {config['peft_type']} adapter; "
                            f"meshtune continues LoRA adapters only")
        return out
    odd = [f"{key}: {json.dumps(config[key])}" for key, plain in UNSUPPORTED.items()
           if config.get(key) not in (plain, None, [], {})]
    if str(config.get("init_lora_weights", True)).lower() not in ("true", "false", "gaussian"):
        odd.append(f"init_lora_weights: {json.dumps(config['init_lora_weights'])} (its base is a changed copy of "
                   f"the model)")
    if odd:
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} has {', '.join(odd)}, which meshtune's "
                            f"LoRA does not compute, so it cannot continue this adapter")
        return out
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} selects its target_modules by the "
                            f"pattern {targets!r}; meshtune's lora_target takes module names")
        return out
    if not targets:
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} names no target_modules; meshtune "
                            f"continues an adapter whose config lists the modules it adapts")
        return out
    in_full = config.get("modules_to_save") or []
    if isinstance(in_full, str) or not all(isinstance(name, str) for name in in_full):
        out.problems.append(f"{where}: adapter_name_or_path: {config_file} has modules_to_save: "
                            f"{json.dumps(in_full)}; meshtune continues a list of module names")
        return out
    out.values = {"lora_rank": config.get("r", 8), "lora_alpha": config.get("lora_alpha", 8),  # peft's defaults
                  "lora_dropout": config.get("lora_dropout", 0.0),
                  "lora_target": ["all"] if targets == "all-linear" else sorted(targets),
                  "additional_target": list(in_full)}
    for key, value in out.values.items():
        if given.get(key) is not None and not same_setting(key, given[key], value):
            out.warnings.append(f"{key}: {given[key]!r} is replaced by the adapter's own {value!r}: the run "
                                f"continues {path} as it was trained, as LLaMA-Factory does")
    return out


def same_setting(key: str, given: Any, adapter: Any) -> bool:
    """`lora_target: all` names no modules: the adapter's list is taken without a word."""
    if key in ("lora_target", "additional_target"):
        names = given.split(",") if isinstance(given, str) else list(given or [])
        names = sorted(name.strip() for name in names if str(name).strip())
        return (key == "lora_target" and names == ["all"]) or names == sorted(adapter)
    return given == adapter
