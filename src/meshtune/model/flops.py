"""The FLOPs a batch needs: the numerator of model FLOPs utilisation (the card's rate is measured in hardware.py).

FLOPs per token as torchtitan counts them: 6 x the parameters outside the input embedding (forward plus
backward of every matrix, the output head included) + 12 x layers x heads x head_dim x the token's attention
context. A token's context is its own sample (no attention crosses samples and padding is not counted), so a
batch needs 6·N·tokens + 12·l·h·q·Σ length². LoRA is counted like full fine-tuning, the usual convention, though
frozen weights need no weight gradient (about 4·N of real work). Recomputation by activation checkpointing is
not counted: MFU measures useful work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlopCounter:
    dense_params: int  # parameters outside the input embedding
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "FlopCounter":
        """Counted on the unwrapped, unsharded model (before LoRA or FSDP change the parameter list)."""
        config = model.config
        embedding = model.get_input_embeddings().weight.numel()
        total = sum(p.numel() for p in model.parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(total - embedding, config.num_hidden_layers, config.num_attention_heads, head_dim)

    def batch_flops(self, sample_lengths) -> float:
        tokens = sum(sample_lengths)
        attention = 12 * self.layers * self.heads * self.head_dim * sum(n * n for n in sample_lengths)
        return 6.0 * self.dense_params * tokens + float(attention)
