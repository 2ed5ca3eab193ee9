"""Q-LoRA: the frozen linear weights of the transformer blocks stored in 4-bit NF4 (torchao's NF4Tensor, as
torchtune's Q-LoRA), the LoRA adapters in full precision on top. NF4Tensor dequantizes inside `F.linear` to the
input's dtype, so peft's LoRA layers, autograd and gradient checkpointing work unchanged; the base weights get no
gradient. The embeddings, the output head and the norms stay as loaded (the head is what the fused loss reads).

Quantizing is deterministic, so every rank that loads the same files holds the same 4-bit weights: no broadcast.
Under zero2 / zero3 / hsdp FSDP2 shards the NF4 weights like any parameter (torchao's NF4Tensor implements the
splits and the all-gather FSDP2 needs), so each process keeps 1 / shards of them (model/block_loading.py).
"""

from __future__ import annotations

import torch

from meshtune.errors import ConfigError, ModelError

BLOCK_SIZE = 64  # values per absmax scale, as bitsandbytes' and torchtune's NF4
SCALER_BLOCK_SIZE = 256  # scales per double-quantized (int8) scale group


def nf4_quantizer():
    """torchao's `to_nf4` (its compiled kernels stay unloaded, and its import notes quiet: meshtune/__init__.py)."""
    try:
        from torchao.quantization import to_nf4  # torchao >= 0.15
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4  # older torchao
        except ImportError:
            raise ConfigError("finetuning_type: qlora needs torchao (its NF4 tensor), which is not installed: "
                              "pip install 'meshtune[qlora]' (or pip install torchao)") from None
    return to_nf4


def quantize_block(block: torch.nn.Module, shards: int = 1, block_name: str = "") -> tuple[int, int, int]:
    """The frozen linear weights of one block (on its device) in NF4. `shards`: FSDP2 will split each weight into
    that many row blocks, which must hold whole scale groups. Returns (layers, bytes before, bytes after)."""
    to_nf4 = nf4_quantizer()
    count = before = after = 0
    for name, module in block.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.requires_grad or ".lora_" in f".{name}":
            continue  # trainable, or an adapter (frozen too when peft loads one for inference)
        weight = module.weight.detach()
        if weight.numel() % (BLOCK_SIZE * SCALER_BLOCK_SIZE):
            continue  # not whole scale groups (only in toy models): stays as loaded
        check_splits_into(weight, shards, f"{block_name}.{name}".strip("."))
        quantized = to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE)
        module.weight = torch.nn.Parameter(quantized, requires_grad=False)
        count += 1
        before += weight.numel() * weight.element_size()
        after += nf4_bytes(quantized)
    return count, before, after


def check_splits_into(weight: torch.Tensor, shards: int, name: str) -> None:
    """FSDP2 gives each of `shards` processes an equal block of rows; an NF4 weight splits only into blocks of whole
    scale groups (torchao splits its packed values and both levels of scales alike). Real models' layer sizes
    split over any power of two up to 8 or more; a weight that does not is an error naming the counts that work,
    not a silently different model."""
    group = BLOCK_SIZE * SCALER_BLOCK_SIZE
    if shards <= 1 or (weight.shape[0] % shards == 0 and weight.numel() % (group * shards) == 0):
        return
    working = [n for n in range(1, 65) if weight.shape[0] % n == 0 and weight.numel() % (group * n) == 0]
    raise ModelError(f"qlora: {name} ({list(weight.shape)}) cannot be split over {shards} processes in whole NF4 "
                     f"scale groups ({BLOCK_SIZE} x {SCALER_BLOCK_SIZE} values); it splits over "
                     f"{', '.join(map(str, working))}. Shard over one of those (parallel: hsdp with hsdp_shard_size, "
                     f"or fewer processes), or use parallel: ddp")


def nf4_bytes(tensor: torch.Tensor) -> int:
    """Storage of an NF4Tensor: its packed 4-bit values and its quantized scales."""
    inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
    return sum(t.numel() * t.element_size() for t in inner)
