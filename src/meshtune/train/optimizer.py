"""AdamW over the trainable parameters, and gradient clipping that sees every shard."""

from __future__ import annotations

import torch

from meshtune.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool
                    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW; like HF, no weight decay on biases and norm weights (1-D tensors). Returns it with its parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=fused)
    return optimizer, params


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor shards included), clipping when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
