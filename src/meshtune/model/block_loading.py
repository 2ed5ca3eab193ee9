"""Q-LoRA's low-memory start. Every process builds the model without weights (meta device), then fills it one
transformer block at a time from the memory-mapped safetensors files, stores the block's frozen linear weights in
NF4 on its device, and, under zero2 / zero3 / hsdp, lets FSDP2 shard the block before the next one is read. So no
process holds more than one block's unquantized weights, and each keeps 1 / shards of the 4-bit model.

Every process reads the files itself: quantizing is deterministic, so all hold the same 4-bit weights without a
broadcast, and the LoRA adapters start from values drawn from the seed and their names, the same in every layout
(or from the adapter the run continues, which every process reads).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from meshtune.errors import ModelError
from meshtune.model.loading import transformer_blocks
from meshtune.model.lora import initial_adapter_weight
from meshtune.model.qlora import nf4_bytes, quantize_block
from meshtune.model.weight_files import WeightFiles, file_key
from meshtune.units import byte_size


class BlockLoader:
    """Called with the modules about to be sharded (a unit's blocks, at last the whole model): fills what of them
    is still without values, and quantizes the blocks among them. `shards`: the processes FSDP2 splits each weight
    over (1 under ddp)."""

    def __init__(self, model: torch.nn.Module, model_dir: Path, device: torch.device, seed: int, shards: int,
                 adapter: dict[str, torch.Tensor] | None = None, blocks: list[torch.nn.Module] | None = None):
        """`adapter`: the weights of an adapter the run continues (model/lora.starting_adapter), else new ones.
        `blocks`: the blocks to fill, where they are not all the model's (a pipeline process's, maybe none)."""
        self.files = WeightFiles(model_dir)
        self.device = device
        self.seed = seed
        self.adapter = adapter or {}
        self.shards = shards
        self.names = {id(module): name for name, module in model.named_modules()}
        self.held = transformer_blocks(model) if blocks is None else blocks
        self.blocks = {id(block) for block in self.held}
        self.config = model.config
        self.quantized = [0, 0, 0]  # layers, bytes before, bytes after
        self.started = time.perf_counter()

    def __call__(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            prefix = self.names[id(module)]
            self.fill_parameters(module, prefix)
            self.fill_buffers(module, prefix)
            if id(module) in self.blocks:
                done = quantize_block(module, self.shards, prefix)
                self.quantized = [a + b for a, b in zip(self.quantized, done)]

    def load_all(self, model: torch.nn.Module) -> None:
        """ddp: every block in turn, then the rest (embeddings, final norm, head)."""
        for block in self.held:
            self([block])
        self([model])

    def close(self) -> None:
        self.files.close()

    def fill_parameters(self, module: torch.nn.Module, prefix: str) -> None:
        shared: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}  # tied parameters get one tensor
        for name, param in module.named_parameters(remove_duplicate=False):
            if param.is_meta:
                shared.setdefault(id(param), (param, []))[1].append(name)
        for param, names in shared.values():
            value = self.value_of([qualified(prefix, name) for name in names], param)
            filled = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            for name in names:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, filled)

    def value_of(self, names: list[str], like: torch.Tensor) -> torch.Tensor:
        for name in names:
            if file_key(name) in self.files:
                return self.files.read(file_key(name), like, self.device)
        if names[0] in self.adapter:
            return self.adapter[names[0]].to(device=self.device, dtype=like.dtype)
        initial = initial_adapter_weight(names[0], like.shape, self.seed)
        if initial is None:
            raise ModelError(f"{file_key(names[0])} is in the model its config.json describes but in none of the "
                             f"weight files of {self.files.directory}: the files are from another model, or damaged")
        return initial.to(device=self.device, dtype=like.dtype)

    def fill_buffers(self, module: torch.nn.Module, prefix: str) -> None:
        """Buffers saved in the files are read; the others (rotary frequencies) are what the module that owns them
        computes from the config when built: it is built again on the CPU, and its values copied."""
        for name, buffer in list(module.named_buffers()):
            if not buffer.is_meta:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            key = file_key(qualified(prefix, name))
            value = (self.files.read(key, buffer, self.device) if key in self.files else
                     getattr(self.rebuilt(owner, qualified(prefix, owner_name)), leaf).to(self.device, buffer.dtype))
            setattr(owner, leaf, value)

    def rebuilt(self, owner: torch.nn.Module, name: str) -> torch.nn.Module:
        config = getattr(owner, "config", self.config)
        with torch.device("cpu"):
            for args, kwargs in (((), {"config": config}), ((config,), {})):
                try:
                    return type(owner)(*args, **kwargs)
                except TypeError:
                    continue
        raise ModelError(f"cannot compute the buffers of {name} ({type(owner).__name__}): they are not in the weight "
                         f"files and the module is not built from the model config alone")

    def describe(self, model: torch.nn.Module) -> str:
        """What was quantized, and the NF4 bytes this process keeps (after FSDP2 sharded them)."""
        count, before, after = self.quantized
        if not count:
            return ("warning: qlora quantized no weight: no block linear layer holds whole NF4 scale groups (64 x "
                    "256 values); this trains as plain LoRA")
        kept = sum(nf4_bytes(getattr(p, "_local_tensor", p)) for p in model.parameters() if is_nf4(p))
        share = f"; this process keeps {byte_size(kept)} of them (1/{self.shards})" if self.shards > 1 else ""
        peak = (f", GPU peak {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"
                if self.device.type == "cuda" else "")
        return (f"qlora: {count} frozen linear weights of the transformer blocks in 4-bit NF4 (torchao), "
                f"{byte_size(before)} -> {byte_size(after)}{share}; read block by block and quantized in "
                f"{time.perf_counter() - self.started:.1f} s{peak}")


def qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def is_nf4(param: torch.Tensor) -> bool:
    return type(getattr(param, "_local_tensor", param)).__name__ == "NF4Tensor"
