"""A full fine-tuning checkpoint (DCP shards written by any number of ranks) as a Hugging Face model directory,
on one CPU process: its weights are read a file's worth at a time (DCP loads only the keys asked for), so the
export needs the memory of one output file, not of the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from meshtune.checkpoint.manifest import FINAL_KIND, read_manifest
from meshtune.errors import MeshtuneError
from meshtune.export.adapters import load_tensors, model_tensors

FILE_BYTES = 5 << 30  # per safetensors file, as transformers' default max_shard_size
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def is_full_checkpoint(path: Path) -> bool:
    """A complete checkpoint-N of full fine-tuning (final/ carries a manifest too, of kind "final": not one)."""
    if not (path / "COMPLETE").is_file():
        return False
    manifest = read_manifest(path)
    return manifest.get("kind") != FINAL_KIND and (manifest.get("config") or {}).get("finetuning_type") == "full"


def base_dtype(base: Path) -> str:
    """The dtype the base model is released in, the export's default, so an export is what its base was: its
    config.json's `dtype` (`torch_dtype` as older transformers write it); fp32 where it names none, as
    transformers then loads it."""
    config = json.loads((base / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype") or "float32"
    if named not in CONFIG_DTYPES:
        raise MeshtuneError(f"{base / 'config.json'} gives the model's dtype as {named!r}; pass --dtype bf16, fp16 "
                            f"or fp32 for the export")
    return CONFIG_DTYPES[named]


def full_checkpoint_base(checkpoint: Path, base_model: str | None) -> Path:
    """The base model folder a full fine-tuning checkpoint was trained from (or `base_model`), with its config."""
    base = Path(base_model or (read_manifest(checkpoint).get("config") or {}).get("model_name_or_path", ""))
    if not (base / "config.json").is_file():
        raise MeshtuneError(f"the base model folder {base} (whose config.json describes the architecture) has no "
                            f"config.json; pass --base-model DIR")
    return base


def export_full_checkpoint(checkpoint: Path, output: Path, dtype: torch.dtype, base: Path,
                           prepare: Callable[[], None]) -> int:
    """Writes model-0000i-of-0000n.safetensors (+ index), config and generation config; returns the tensor count.
    `prepare` empties the output, called once the checkpoint is found good (nothing removed before)."""
    sizes = model_tensors(checkpoint)
    prepare()
    groups: list[list[str]] = [[]]
    used = 0
    for key, meta in sizes.items():
        nbytes = meta.size.numel() * dtype.itemsize
        if groups[-1] and used + nbytes > FILE_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    weight_map = {}
    for name, keys in tqdm(list(zip(names, groups)), desc="exporting", unit="file"):
        tensors = {key: value.to(dtype) if value.is_floating_point() else value
                   for key, value in load_tensors(checkpoint, {key: sizes[key] for key in keys}).items()}
        save_file(tensors, str(output / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    index = {"metadata": {"total_size": sum(sizes[key].size.numel() * dtype.itemsize for key in sizes)},
             "weight_map": dict(sorted(weight_map.items()))}
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_model_config(base, output, dtype)
    return len(weight_map)


def write_model_config(base: Path, output: Path, dtype: torch.dtype, untie: bool = False) -> None:
    """The base's config.json with the exported dtype (and, with `untie`, an output head of its own: it trained
    apart from the embedding), and its generation config."""
    config = json.loads((base / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    if untie:
        config["tie_word_embeddings"] = False
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (base / "generation_config.json").is_file():
        shutil.copy(base / "generation_config.json", output / "generation_config.json")
