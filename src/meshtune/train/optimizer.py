"""AdamW over the trainable parameters, and gradient clipping that sees every shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtune.config import TrainConfig
from meshtune.train.bf16_adamw import StochasticBf16AdamW


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool
                    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW; like HF, no weight decay on biases and norm weights (1-D tensors). Returns it with its parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # an empty group where nothing trains: a pipeline process holding only stages without LoRA weights (zbv's first
    # and last, the embedding and the head) steps nothing, and torch refuses an optimizer without a group
    groups = [g for g in groups if g["params"]] or [{"params": [], "weight_decay": 0.0}]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.master_weights == "bf16":
        return StochasticBf16AdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon,
                                   seed=cfg.seed), params
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, fused=fused)
    return optimizer, params


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float,
                   stages: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global gradient norm (DTensor shards included), clipping when max_norm > 0. `stages`: the processes of one
    pipeline, each holding its stage's parameters; the norm is then the whole model's, from each stage's."""
    grads = [p.grad for p in params if p.grad is not None]
    total = gradient_norm(grads)
    if stages is not None:
        squared = total.double() ** 2
        dist.all_reduce(squared, group=stages)
        total = squared.sqrt().to(total.dtype)
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
