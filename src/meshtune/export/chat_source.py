"""What `meshtune chat DIR` talks to: DIR as a full model, a PEFT adapter on its base, or a run's output_dir.

An output_dir means its `final/`, else its newest complete checkpoint, which `meshtune export` writes into a
temporary folder first (a LoRA checkpoint as a PEFT adapter, a full one as a model directory), so every source
ends as a model directory plus, maybe, an adapter directory that transformers and peft load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshtune.checkpoint.manifest import COMPLETE, MANIFEST, read_manifest
from meshtune.checkpoint.resume import list_checkpoints
from meshtune.errors import ModelError
from meshtune.export.merge import export, source_of
from meshtune.model.final_weights import export_kind
from meshtune.model.model_dir import TOKENIZER_FILES

WHAT_DIR_IS = ("a Hugging Face model directory (config.json and *.safetensors: a full fine-tuning run's final/ or a "
               "merged export), a PEFT adapter directory (adapter_config.json: a LoRA run's final/ or an export), "
               "or a run's output_dir (final/ or checkpoint-N inside)")


@dataclass(frozen=True)
class ChatModel:
    """`model`: the Hugging Face model directory to load (the base, under an adapter); `adapter`: the PEFT adapter
    directory on it, if any; `tokenizer`: the folder whose tokenizer and chat template the conversation uses (the
    adapter's when it carries one: meshtune saves the template trained with beside the adapter)."""

    model: Path
    adapter: Path | None
    tokenizer: Path
    description: str


def locate(path: Path, workdir: Path, adapter: Path | None = None, base: Path | None = None,
           note: Callable[[str], None] = print) -> ChatModel:
    """What to load for `meshtune chat PATH [--adapter ADAPTER] [--base BASE]`. `workdir`: an empty folder that
    lives while the model loads, where a checkpoint is exported; `note` gets the lines that say which one."""
    if adapter is not None:
        if base is not None:
            raise ModelError("--adapter and --base both name the base model: give it once, as "
                             "`meshtune chat BASE --adapter ADAPTER` or `meshtune chat ADAPTER --base BASE`")
        if export_kind(path) != "Hugging Face model":
            raise ModelError(f"with --adapter, DIR is the base model the adapter was trained on, and {path} is not a "
                             f"Hugging Face model directory (config.json and *.safetensors)")
        found = locate(adapter, workdir, base=path, note=note)
        if found.adapter is None:
            raise ModelError(f"--adapter {adapter} is a full model, not an adapter: chat with it alone "
                             f"(meshtune chat {adapter})")
        return found
    if not path.is_dir():
        raise ModelError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}; give {WHAT_DIR_IS}")
    if (path / "adapter_config.json").is_file():
        return adapter_on_base(path, base)
    if export_kind(path) == "Hugging Face model":
        if base is not None:
            raise ModelError(f"{path} is a full model, not an adapter: chat with it alone (meshtune chat {path}), "
                             f"without --adapter or --base")
        return ChatModel(path, None, path, f"the model in {path}")
    if (path / COMPLETE).is_file() and (path / MANIFEST).is_file():
        return exported_checkpoint(path, workdir, base, note)
    if (path / "final").is_dir() or list_checkpoints(path):
        source = source_of(path, note)
        if source != path:
            return locate(source, workdir, base=base, note=note)
    raise ModelError(f"{path} is none of what meshtune chat loads: {WHAT_DIR_IS}")


def adapter_on_base(adapter: Path, base: Path | None) -> ChatModel:
    """A PEFT adapter on `base`, or on the base its adapter_config.json names."""
    named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    model = base or (Path(named) if named else None)
    if model is None or not (model / "config.json").is_file():
        problem = "its adapter_config.json names none" if model is None else f"{model} has no config.json"
        raise ModelError(f"the base model of the adapter in {adapter} is not found ({problem}); pass --base DIR with "
                         f"the model it was trained on")
    has_tokenizer = any((adapter / name).is_file() for name in TOKENIZER_FILES)
    return ChatModel(model, adapter, adapter if has_tokenizer else model, f"the adapter in {adapter} on {model}")


def exported_checkpoint(checkpoint: Path, workdir: Path, base: Path | None,
                        note: Callable[[str], None]) -> ChatModel:
    """A complete checkpoint-N, exported into `workdir` as `meshtune export` writes it (the tokenizer with the
    chat template its run trained with), then located there."""
    named = (read_manifest(checkpoint).get("config") or {}).get("model_name_or_path") or ""
    model = base or (Path(named) if named else None)
    if model is None or not (model / "config.json").is_file():
        problem = "its manifest names none" if model is None else f"{model} has no config.json"
        raise ModelError(f"the base model of {checkpoint} is not found ({problem}); pass --base DIR with the model "
                         f"it was trained from")
    exported = workdir / checkpoint.name
    note(f"meshtune: {checkpoint.name} is exported into a temporary folder to be loaded")
    export(checkpoint, exported, merge=False, dtype=None, force=True, base_model=str(model), note=note)
    if (exported / "adapter_config.json").is_file():
        return ChatModel(model, exported, exported, f"the adapter of {checkpoint} on {model}")
    return ChatModel(exported, None, exported, f"the model of {checkpoint}")
