"""AdamW over the trainable parameters, and gradient clipping that sees every shard."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from meshtune.config import TrainConfig
from meshtune.errors import ConfigError


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool
                    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW; like HF, no weight decay on biases and norm weights (1-D tensors). Returns it with its parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.master_weights == "bf16":
        return bf16_adamw(groups, cfg.learning_rate, betas, cfg.adam_epsilon), params
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, fused=fused)
    return optimizer, params


def bf16_adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW on bf16 weights with bf16 moments (master_weights bf16): torchao's, which computes each update in
    fp32 and rounds the new weight to bf16 stochastically, so an update below bf16's resolution still moves the
    weight in expectation (a plain bf16 AdamW, as HF Trainer on a bf16 model, drops it)."""
    try:
        from torchao.optim import _AdamW
    except ImportError as error:
        raise ConfigError(f"master_weights: bf16 needs torchao ({error}); install the release made for your torch "
                          f"(pip install torchao), or set master_weights: fp32") from None
    return _AdamW(groups, lr=lr, betas=betas, eps=eps, bf16_stochastic_round=True)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor shards included), clipping when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = gradient_norm(grads)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # the scale goes to each gradient's device
    return total


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients. FSDP2's shards: what torch's `get_total_norm` computes (each shard's norm,
    their norm, summed over the mesh), with the shards' norms moved to the mesh's device before the sum crosses
    the processes: cpu_offload leaves the gradients in host memory while the mesh is the GPUs', and NCCL carries
    no host tensors."""
    if not grads or not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    shard_norms = torch.stack(torch._foreach_norm(grads, 2.0))  # still partial: no collective yet
    return torch.linalg.vector_norm(on_mesh_device(shard_norms), 2.0).full_tensor()


def on_mesh_device(partial: DTensor) -> DTensor:
    """The DTensor with its local tensor on the device its mesh communicates on, its placements unchanged."""
    device_type = partial.device_mesh.device_type
    if partial.device.type == device_type:
        return partial
    return DTensor.from_local(partial.to_local().to(device_type), partial.device_mesh, partial.placements,
                              run_check=False, shape=partial.shape, stride=partial.stride())
