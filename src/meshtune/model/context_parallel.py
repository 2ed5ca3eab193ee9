"""Context parallel: the processes of a cp group split every row's positions between them, each holding 1/cp of
the activations, and attention runs as torch's ring attention (`context_parallel`, over the CUDA SDPA kernels):
keys and values pass around the group while each process computes its queries' share.

The rows are cut into 2 x cp chunks and process i keeps chunks i and 2cp-1-i (torch's load balancing), so every
process does the same share of causal attention. Rows are padded at their end so that each chunk is a multiple of
32 positions (train/sequence_split.py's `row_multiple`); a causal row never attends forward, so the padding changes
nothing the targets see. The model's attention runs as
`meshtune_context_parallel`: causal SDPA with no mask (transformers builds none for it, and would otherwise read the
split positions as packed samples), which the ring replaces while a micro-step runs (train/sequence_split.py).

The gradients of a cp group's processes are partial sums over their shares of the positions: the data-parallel
wrapper reduces them over every process (the cp dimension is flattened into FSDP2's shards, or DDP's replicas, as
torchtitan does), and the loss is scaled by the processes that reduce, not the data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtune.errors import ModelError
from meshtune.model.attention import use_attention

NAME = "meshtune_context_parallel"
# what some models' layers pass their attention beyond causal sdpa: refused, never silently dropped
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


def causal_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers' attention-function interface: (batch, heads, positions, dim) in, (batch, positions, heads, dim)
    out. Key-value heads are repeated for grouped-query attention: the ring's flash and memory-efficient kernels take
    equal head counts."""
    if dropout:
        raise ModelError("context parallel attention has no attention dropout; set attention_dropout to 0")
    asked = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if asked:
        raise ModelError(f"context_parallel runs plain causal attention, and {type(module).__name__} asks for "
                         f"{', '.join(f'{name} {kwargs[name]}' for name in asked)}; set context_parallel: 1")
    groups = query.size(1) // key.size(1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_context_parallel_attention(model: torch.nn.Module) -> None:
    use_attention(model, NAME, causal_attention_forward)
