"""The LoRA adapters of a training output, wherever they are: `final/` (a PEFT adapter directory) or any complete
`checkpoint-N` (DCP shards written by any number of ranks), read on one CPU process."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from meshtune.checkpoint.manifest import MANIFEST, read_manifest, verify
from meshtune.errors import MeshtuneError

MODEL_PREFIX = "model_optim.model."  # where checkpoint/state.py keeps the model's (or the adapters') weights
PEFT_PREFIX = "base_model.model."
IN_FULL = "modules_to_save"  # peft's trainable copy of a module trained in full (additional_target)


@dataclass
class Adapters:
    """LoRA pairs by the base module they change: `{"model.layers.0.self_attn.q_proj": (A, B)}`, with the scale
    alpha / r that multiplies B @ A, and the base model folder they were trained on; `modules`: the weights of the
    modules trained in full beside them (additional_target), by the base's weight names (`lm_head.weight`)."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    rank: int
    alpha: float
    dropout: float
    base_model: str
    modules: dict[str, torch.Tensor] = field(default_factory=dict)


def read_adapters(source: Path) -> Adapters:
    if (source / "adapter_config.json").is_file():
        return adapters_from_peft_dir(source)
    if (source / "COMPLETE").is_file():
        return adapters_from_checkpoint(source)
    raise MeshtuneError(f"{source} holds no LoRA adapters: neither a PEFT adapter directory (adapter_config.json) "
                        f"nor a complete checkpoint (COMPLETE); give output_dir, output_dir/final or a checkpoint-N")


def adapters_from_peft_dir(folder: Path) -> Adapters:
    """A PEFT adapter directory; one meshtune sealed (final/: manifest.json) is verified first, its checksums read."""
    if (folder / MANIFEST).is_file():
        problems = verify(folder)
        if problems:
            raise MeshtuneError(f"{folder} does not verify ({'; '.join(problems[:3])}); export one of the run's "
                                f"checkpoints instead (`meshtune ckpt list OUTPUT_DIR` shows which are valid)")
    config = json.loads((folder / "adapter_config.json").read_text())
    for key, supported in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, supported) != supported:
            raise MeshtuneError(f"{folder}/adapter_config.json: {key}: {config[key]} is not supported by the merge")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise MeshtuneError(f"{weights} not found: the adapter directory is incomplete; export it again from a "
                            f"checkpoint-N of the run")
    tensors = load_file(str(weights))
    in_full = set(config.get("modules_to_save") or ())  # peft writes their weights under the base's names
    named = {(_full_module_key(key) if key.rsplit(".", 2)[-2] in in_full else key): value
             for key, value in ((key.removeprefix(PEFT_PREFIX), value) for key, value in tensors.items())}
    return _paired(named, config["r"], float(config["lora_alpha"]), float(config.get("lora_dropout", 0.0)),
                   config.get("base_model_name_or_path") or "", str(weights))


def _full_module_key(key: str) -> str:
    """`lm_head.weight` as `_paired` reads a weight trained in full: `lm_head.modules_to_save.weight`."""
    module, name = key.rsplit(".", 1)
    return f"{module}.{IN_FULL}.{name}"


def adapters_from_checkpoint(checkpoint: Path) -> Adapters:
    """The adapter weights of a verified checkpoint; DCP reassembles each from the ranks' shards."""
    sizes = model_tensors(checkpoint)
    config = read_manifest(checkpoint).get("config") or {}
    if config.get("finetuning_type") not in ("lora", "qlora"):
        raise MeshtuneError(f"{checkpoint} is a {config.get('finetuning_type', 'full')} fine-tuning checkpoint; "
                            f"it holds no LoRA adapters")
    named = {key.removeprefix(PEFT_PREFIX).replace(".default.", "."): value
             for key, value in load_tensors(checkpoint, sizes).items()}
    rank = config.get("lora_rank", 8)
    alpha = config.get("lora_alpha") or 2.0 * rank
    return _paired(named, rank, float(alpha), float(config.get("lora_dropout", 0.0)),
                   config.get("model_name_or_path", ""), str(checkpoint))


def model_tensors(checkpoint: Path) -> dict:
    """The checkpoint's model (or adapter) tensors by DCP key, with their size and dtype, once it verifies."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    problems = verify(checkpoint)
    if problems:
        raise MeshtuneError(f"{checkpoint} does not verify ({'; '.join(problems[:3])}); export another "
                            f"checkpoint (`meshtune ckpt list OUTPUT_DIR` shows which are valid)")
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: meta for key, meta in metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}


def load_tensors(checkpoint: Path, sizes: dict) -> dict[str, torch.Tensor]:
    """The tensors `sizes` names (from `model_tensors`), whole, by their model names; DCP reads only those."""
    import torch.distributed.checkpoint as dcp

    template = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in sizes.items()}
    with warnings.catch_warnings():  # one process reading every rank's shards is the intent, not a mistake
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(template, checkpoint_id=str(checkpoint), no_dist=True)
    return {key.removeprefix(MODEL_PREFIX): value for key, value in template.items()}


def _paired(named: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float, base_model: str,
            where: str) -> Adapters:
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    modules: dict[str, torch.Tensor] = {}
    for key, value in named.items():
        if f".{IN_FULL}." in key:
            modules[key.replace(f".{IN_FULL}.", ".")] = value
        elif key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            if f"{module}.lora_B.weight" not in named:
                raise MeshtuneError(f"{where}: {module} has lora_A but no lora_B")
            pairs[module] = (value, named[f"{module}.lora_B.weight"])
        elif not key.endswith(".lora_B.weight"):
            raise MeshtuneError(f"{where}: '{key}' is neither a LoRA weight of a linear layer (lora_A / lora_B) nor "
                                f"the weight of a module trained in full (additional_target)")
    if not pairs:
        raise MeshtuneError(f"{where} holds no LoRA weights")
    return Adapters(pairs, alpha / rank, rank, alpha, dropout, base_model, modules)
