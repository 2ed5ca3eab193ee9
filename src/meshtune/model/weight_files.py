"""A model directory's safetensors weights, read one tensor at a time from memory-mapped files.

Q-LoRA builds its model block by block from them: a process holds one tensor of the files in host memory at a time
(the page cache that the processes of a node share apart), never the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from meshtune.errors import ModelError

PEFT_PREFIX = "base_model.model."  # peft's wrapper before the model's own names


def file_key(name: str) -> str:
    """The name a parameter of the (peft-wrapped) model has in the model files: without peft's prefix and its
    `base_layer` (the adapted layer's original weight)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


class WeightFiles:
    """Which safetensors file holds each tensor (from the index, or each file's header), and reads of one
    tensor at a time through memory-mapped files opened once."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._handles: dict[str, object] = {}
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.where: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise ModelError(f"finetuning_type: qlora reads the model one block at a time from safetensors files, "
                                 f"and {directory} has none (pytorch_model*.bin only?). Convert it once: load it with "
                                 f"transformers and save_pretrained(DIR, safe_serialization=True)")
            self.where = {key: file.name for file in files for key in self._open(file.name).keys()}

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def _open(self, name: str):
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt", device="cpu")
        return self._handles[name]

    def read(self, key: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Tensor `key` of the files with the shape of `like`, in its dtype, on `device`."""
        value = self._open(self.where[key]).get_tensor(key)
        if tuple(value.shape) != tuple(like.shape):
            raise ModelError(f"{key} in {self.directory / self.where[key]} is {list(value.shape)}, the model's config "
                             f"makes it {list(like.shape)}: config.json and the weights do not belong together")
        return value.to(device=device, dtype=like.dtype)

    def close(self) -> None:
        self._handles.clear()
