"""Padding-free attention: the samples of a micro-batch lie end to end in one row, and each attends only to itself.

Registered with transformers as the attention implementation "meshtune_varlen", which receives the boundaries of
the samples as `cu_seq_lens_q` / `max_length_q` (transformers passes these keyword arguments down to the
attention function of every layer and builds no mask for an implementation it has no mask function for).
On CUDA it is torch's variable-length flash attention (`torch.nn.attention.varlen`), so no FLOP is spent on
padding or across samples; elsewhere each sample runs through `scaled_dot_product_attention` on its own, the same
math, which is how the CPU tests check this path (and what fp32 runs on CUDA use: flash kernels need 16 bits).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


NAME = "meshtune_varlen"


def _find_varlen():
    """torch's varlen attention and the keywords this torch spells causal with (2.10: `is_causal=True`; 2.11+:
    `window_size=(-1, 0)`, plus `enable_gqa` for grouped-query attention). Looked up once, at import: inside a
    compiled block, `inspect` or an import would break the graph at every layer."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return varlen_attn, kwargs


VARLEN_ATTN, VARLEN_KWARGS = _find_varlen()


def causal_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_length: int, scale: float | None) -> torch.Tensor:
    """(tokens, heads, dim) in and out; key / value may have fewer heads (GQA)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # autocast leaves RoPE's fp32 products alone (sdpa would cast them; a custom op is not on its list)
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if VARLEN_ATTN is not None and query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        return VARLEN_ATTN(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, scale=scale,
                           **VARLEN_KWARGS)
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                        enable_gqa=k.size(0) != q.size(0)).transpose(0, 1)
    return out


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers' attention-function interface: (batch 1, heads, tokens, dim) in, (1, tokens, heads, dim) out."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or query.size(0) != 1:
        raise RuntimeError("meshtune_varlen attention needs one padding-free row and cu_seq_lens_q; "
                           "set padding_free: false to use sdpa")
    if dropout:
        raise RuntimeError("meshtune_varlen attention has no attention dropout; set attention_dropout to 0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    out = causal_varlen(q, k, v, cu_seqlens, kwargs["max_length_q"], scaling)
    return out.unsqueeze(0), None


def use_varlen(model: torch.nn.Module) -> None:
    """Switch a loaded model (every sub-config) to the padding-free attention."""
    use_attention(model, NAME, varlen_attention_forward)


def use_attention(model: torch.nn.Module, name: str, forward) -> None:
    """Register `forward` with transformers as attention implementation `name` and switch a loaded model (every
    sub-config) to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, forward)
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError):  # transformers versions without the setter, or that check names strictly
        for module in model.modules():
            if hasattr(getattr(module, "config", None), "_attn_implementation"):
                module.config._attn_implementation = name
