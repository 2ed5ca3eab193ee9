"""The job's config as the user brings it: a meshtune or LLaMA-Factory YAML, Qwen's `--flag value` form,
`key=value` overrides, the DeepSpeed JSON any of them names and the LoRA settings of an adapter it continues,
into one validated `TrainConfig`.

Later sources win: YAML, then flags, then overrides. A job in the keys of Qwen's finetune.py gets finetune.py's
defaults where it leaves a key unset (compat/qwen.py). Every problem of all of them comes in one error, each line
naming where its key was given; keys of other tools that meshtune ignores come back as warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtune.compat.adapter import adapter_settings
from meshtune.compat.deepspeed import read_deepspeed, translate_deepspeed
from meshtune.compat.foreign import translate_foreign
from meshtune.compat.qwen import finetune_py_defaults, qwen_keys_given
from meshtune.config import TrainConfig, build_config, load_yaml, parse_overrides
from meshtune.errors import ConfigError

COMMAND_LINE = "command line"
# LLaMA-Factory's templates for models that read images, video or audio
VISION_TEMPLATES = ("qwen2_vl", "qwen2_5_vl", "qwen2_omni", "qwen3_vl", "qwen3_vl_nothink", "qwen3_omni", "llava",
                    "llava_next", "llava_next_video", "paligemma", "mllama", "minicpm_v", "minicpm_o", "glm4v",
                    "intern_vl", "kimi_vl", "pixtral", "video_llava", "llama4", "gemma3n")


@dataclass
class LoadedConfig:
    config: TrainConfig
    warnings: list[str] = field(default_factory=list)  # keys given but not honoured, and how foreign ones were read


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                flags: dict[str, Any] | None = None) -> TrainConfig:
    return load_job_config(path, overrides, flags).config


def load_job_config(path: str | Path | None, overrides: list[str] | None = None,
                    flags: dict[str, Any] | None = None) -> LoadedConfig:
    """`path` (a YAML file, or None for the flag form), `flags` (`--key value` pairs) and `key=value` overrides."""
    values: dict[str, Any] = load_yaml(path) if path is not None else {}
    source = str(path) if path is not None else COMMAND_LINE
    if path is not None:
        refuse_accelerate_config(values, str(path))
    sources: dict[str, str] = {}
    for given in (flags or {}, parse_overrides(overrides or [])):
        values.update(given)
        sources.update({key: COMMAND_LINE for key in given})
    deepspeed = values.pop("deepspeed", None)
    neat_packing = values.get("neat_packing")
    qwen_job = bool(qwen_keys_given(values))
    qwen_defaults, qwen_notes, problems = finetune_py_defaults(values, sources, source)
    values, warnings, foreign_problems = translate_foreign(values, sources, source)
    problems += foreign_problems
    defaulted = {key for key in qwen_defaults if key not in values}  # finetune.py's, not the user's
    for key, value in qwen_defaults.items():
        values.setdefault(key, value)
    warnings += qwen_notes
    vision = refuse_vision_template(values.get("template"), sources.get("template", source))
    if vision:
        problems += vision
        values.pop("template")  # said once, not again as a value outside the allowed list
    if deepspeed:
        where = sources.get("deepspeed", source)
        ds_path = find_deepspeed_file(str(deepspeed), path, where)
        translation = translate_deepspeed(read_deepspeed(ds_path), str(ds_path), values, sources)
        values.update(translation.values)
        sources.update({key: str(ds_path) for key in translation.values})
        problems += translation.problems
        warnings += translation.notes
        if translation.unhonoured:
            warnings.append(f"{ds_path}: not applied (FSDP2 and meshtune decide these themselves): "
                            f"{', '.join(translation.unhonoured)}")
    adapter = values.get("adapter_name_or_path")
    if isinstance(adapter, str) and adapter.strip() and "," not in adapter:  # several: the config names the error
        given = {key: value for key, value in values.items() if key not in defaulted}
        settings = adapter_settings(adapter.strip(), given, sources.get("adapter_name_or_path", source))
        values.update(settings.values)
        warnings += settings.warnings
        problems += settings.problems
    config = build_config(values, source, sources, problems)
    if config.packing and not _true(neat_packing):
        warnings.append(PACKING_DIFFERS)
    if qwen_job:
        warnings.append(QWEN_CUTOFF_DIFFERS.format(cutoff_len=config.cutoff_len))
    return LoadedConfig(config, warnings)


# meshtune's packing is LLaMA-Factory's neat_packing; the line a run with packing: true (and no neat_packing) prints
PACKING_DIFFERS = ("packing: true packs samples into rows of up to cutoff_len with no attention across them, each "
                   "sample's positions from 0 (LLaMA-Factory's neat_packing: true); LLaMA-Factory's packing: true "
                   "without neat_packing lets the samples of a row attend to each other. meshtune always packs this "
                   "way: a packed row trains each sample's loss as it would alone")


# finetune.py's preprocess keeps `input_id[:max_len]`; meshtune cuts as LLaMA-Factory (data/truncation.py)
QWEN_CUTOFF_DIFFERS = ("model_max_length {cutoff_len} (cutoff_len): finetune.py keeps a longer sample's first "
                       "{cutoff_len} tokens, so a reply past them is not trained; meshtune cuts it as LLaMA-Factory "
                       "does, turn by turn, each turn's prompt and reply shortened to share the {cutoff_len} tokens, "
                       "so replies stay trained (`meshtune preview` counts the samples cut)")


def _true(value: Any) -> bool:
    """A boolean key as YAML, flags or key=value give it."""
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def find_deepspeed_file(name: str, config_path: str | Path | None, where: str) -> Path:
    """As given (relative to the working directory, as LLaMA-Factory and HF read it), else next to the YAML."""
    tried = [Path(name)]
    if config_path is not None and not Path(name).is_absolute():
        tried.append(Path(config_path).parent / name)
    for candidate in tried:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{where}: deepspeed: {name} not found (looked at {' and '.join(str(p) for p in tried)}); "
                      f"give the DeepSpeed JSON's path relative to the working directory or to the config file")


def refuse_vision_template(template: Any, where: str) -> list[str]:
    if isinstance(template, str) and (template in VISION_TEMPLATES or template.endswith("_vl")):
        return [f"{where}: template: {template} is a vision-language template; meshtune trains text models only "
                f"(for a text-only Qwen model use template: qwen or qwen3)"]
    return []


def refuse_accelerate_config(values: dict[str, Any], path: str) -> None:
    """An accelerate launch config (`accelerate config`'s YAML) given where a training config belongs."""
    if not {"distributed_type", "compute_environment"} & set(values):
        return
    fsdp = values.get("fsdp_config") or {}
    offload = fsdp.get("fsdp_offload_params") is True
    mode = "zero2" if str(fsdp.get("fsdp_sharding_strategy", "")).upper() == "SHARD_GRAD_OP" else (
        "hsdp" if "HYBRID" in str(fsdp.get("fsdp_sharding_strategy", "")).upper() else "zero3")
    nodes = values.get("num_machines", 1)
    per_node = (values.get("num_processes", 1) // max(int(nodes or 1), 1)) or 1
    equivalents = [f"parallel: {mode}", f"nnodes: {nodes}", f"nproc_per_node: {per_node}"]
    if values.get("main_process_ip"):
        equivalents.append(f"master_addr: {values['main_process_ip']}")
    if values.get("main_process_port"):
        equivalents.append(f"master_port: {values['main_process_port']}")
    if offload:
        equivalents.append("cpu_offload: true")
    if str(values.get("mixed_precision", "")).lower() == "bf16":
        equivalents.append("bf16: true")
    raise ConfigError(
        f"{path} is an accelerate launch config (distributed_type: {values.get('distributed_type')}), not a training "
        f"config: meshtune starts its processes itself through torchrun. Put these keys in your training YAML (or "
        f"set NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT on each node) and run `meshtune train train.yaml` on "
        f"every node:\n  " + "\n  ".join(equivalents)
        + "\nmachine_rank is each node's NODE_RANK (node_rank:); state dict, prefetch and wrap policy settings are "
          "FSDP2's own")
