"""AdamW for bf16 weights with bf16 moments (`master_weights: bf16`): 8 bytes a parameter instead of 16.

Each update is computed in fp32 (torch's AdamW formula) and the new weight is rounded to bf16 stochastically: away
from zero with the probability of the dropped 16 bits, so an update below bf16's resolution still moves the weight
in expectation (a plain bf16 AdamW, as HF Trainer on a bf16 model, drops it). The moments are rounded to nearest.

On CUDA one Triton kernel updates every parameter (bf16_adamw_kernel.py): the step costs one launch of host time,
where an optimizer that launches per parameter (torchao's AdamW: a compiled call each, about 0.5 ms) leaves the GPU
idle for a large model's hundreds of parameters. Elsewhere, or without Triton, `reference_update`
(bf16_adamw_reference.py) does the same arithmetic with torch operators, parameter by parameter.

The rounding's random bits are a hash of (seed, step, parameter, element index), not a generator's state: the
kernel and the reference draw the same bits, and a resumed run draws what the uninterrupted run drew. FSDP2 shards
(DTensor) are updated through their local shards, so layouts agree within bf16 rounding rather than exactly.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from meshtune.train.bf16_adamw_reference import parameter_key, reference_update, step_key


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def triton_kernel_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class StochasticBf16AdamW(torch.optim.Optimizer):
    """AdamW on bf16 parameters: fp32 math, bf16 moments, stochastically rounded bf16 weights. State keys as
    torch's AdamW (step, exp_avg, exp_avg_sq), so checkpoints carry it like any optimizer's. `kernel`: None picks
    the Triton kernel on CUDA when Triton is installed; False forces the reference (a test's comparison)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, seed: int = 0, kernel: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len({(tuple(g["betas"]), g["eps"]) for g in self.param_groups}) > 1:
            raise ValueError("StochasticBf16AdamW: every parameter group needs the same betas and eps")
        self.seed = seed
        self.kernel = kernel
        self._launcher = None
        self.parameter_keys: list[int] = []  # by place among all parameters, made once

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads, exp_avgs, exp_avg_sqs, steps, groups, positions = [], [], [], [], [], [], []
        position = -1  # a parameter's place among all: its random key, whichever parameters have gradients
        for group in self.param_groups:
            for p in group["params"]:
                position += 1
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16 or p.grad.dtype != torch.bfloat16:
                    raise TypeError(f"StochasticBf16AdamW updates bf16 parameters with bf16 gradients; got "
                                    f"{p.dtype} with {p.grad.dtype} gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)  # a DTensor for a DTensor: the shard's zeros
                    state["exp_avg_sq"] = torch.zeros_like(p)
                params.append(local(p))
                grads.append(local(p.grad))
                exp_avgs.append(local(state["exp_avg"]))
                exp_avg_sqs.append(local(state["exp_avg_sq"]))
                steps.append(state["step"])
                groups.append(group)
                positions.append(position)
        if not params:
            return loss
        torch._foreach_add_(steps, 1.0)
        step = int(steps[0].item())  # CPU tensors: no device sync
        beta1, beta2 = self.param_groups[0]["betas"]
        eps = self.param_groups[0]["eps"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
        decay_factors = [1 - float(g["lr"]) * g["weight_decay"] for g in groups]
        step_sizes = [float(g["lr"]) / bias_correction1 for g in groups]
        this_step = step_key(step)
        self.parameter_keys += [parameter_key(self.seed, i) for i in range(len(self.parameter_keys), position + 1)]
        keys = [self.parameter_keys[i] ^ this_step for i in positions]
        if self.use_kernel(params[0].device):
            if self._launcher is None:
                from meshtune.train.bf16_adamw_kernel import KernelLauncher
                self._launcher = KernelLauncher(params[0].device)
            self._launcher.update(params, grads, exp_avgs, exp_avg_sqs, keys, decay_factors, step_sizes, beta1,
                                  beta2, eps, bias_correction2_sqrt)
        else:
            reference_update(params, grads, exp_avgs, exp_avg_sqs, keys, decay_factors, step_sizes, beta1, beta2,
                             eps, bias_correction2_sqrt)
        return loss

    def use_kernel(self, device: torch.device) -> bool:
        return triton_kernel_usable(device) if self.kernel is None else self.kernel
