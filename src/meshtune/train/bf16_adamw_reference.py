"""The arithmetic of meshtune's bf16 AdamW, operator by operator, and the hash its stochastic rounding draws from.

`reference_update` is the step on any device (bf16_adamw.py's CPU path, and the kernel's for non-dense tensors);
bf16_adamw_kernel.py computes the same, element by element, from the same hash constants.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1  # Weyl step over the element index; index < 2^31, so index * GOLDEN32 < 2^63
MIX32 = 0x045D9F3B  # 32-bit avalanche multiplier; x < 2^32, so x * MIX32 < 2^59: no int64 overflow anywhere
PIECE = 1 << 22  # elements updated at a time: the fp32 and int64 temporaries of a piece (~0.2 GB), not of a whole
# embedding (a 1.5B model's 233 M elements would take ~10 GB of them at once)


def mix32(x):
    """The hash's mixing rounds, on a Python int (the keys made on the host) or an int64 tensor below 2^32 (the
    element bits): the same operators, so both give the same values."""
    x = ((x >> 16) ^ x) * MIX32 & MASK32
    x = ((x >> 16) ^ x) * MIX32 & MASK32
    return (x >> 16) ^ x


def parameter_key(seed: int, position: int) -> int:
    return mix32(mix32(seed & MASK32) ^ position)


def step_key(step: int) -> int:
    return mix32(step * GOLDEN32 & MASK32)


def random_16bit(numel: int, key: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """Uniform integers in [0, 2^16), one per element index from `start`, from a 32-bit key (int32, flat)."""
    x = torch.arange(start, start + numel, device=device, dtype=torch.int64) & 0x7FFFFFFF
    return (mix32((x * GOLDEN32 + key) & MASK32) & 0xFFFF).to(torch.int32)


def round_to_bf16_stochastically(value: torch.Tensor, key: int, start: int = 0) -> torch.Tensor:
    """fp32 -> bf16, away from zero with the probability of the 16 dropped bits read as an unsigned fraction; the
    random bits of element indices from `start` (`value` a piece of a flat parameter)."""
    bits = value.reshape(-1).view(torch.int32)
    fraction = bits & 0xFFFF
    toward_zero = bits & -0x10000  # the upper 16 bits
    rounded = torch.where(random_16bit(bits.numel(), key, value.device, start) < fraction, toward_zero + 0x10000,
                          toward_zero)
    return rounded.view(torch.float32).to(torch.bfloat16).view(value.shape)  # exact: the low 16 bits are zero


def reference_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], keys: list[int], decay_factors: list[float],
                     step_sizes: list[float], beta1: float, beta2: float, eps: float, bias_correction2_sqrt: float
                     ) -> None:
    """One step in place, parameter by parameter, as torch's AdamW computes it in fp32: p *= decay_factor;
    m = lerp(m, g, 1 - beta1); v = v * beta2 + (1 - beta2) * g * g; p -= step_size * m / (sqrt(v) /
    bias_correction2_sqrt + eps); then p rounded stochastically with `keys[i]`, the moments to nearest. A large
    contiguous parameter goes PIECE elements at a time: every operator is element-wise and the rounding's bits are
    drawn by element index, so the result is the same as at once."""
    for p, g, m, v, key, decay_factor, step_size in zip(params, grads, exp_avgs, exp_avg_sqs, keys, decay_factors,
                                                        step_sizes):
        if p.numel() <= PIECE or not all(t.is_contiguous() for t in (p, g, m, v)):
            update_piece(p, g, m, v, key, 0, decay_factor, step_size, beta1, beta2, eps, bias_correction2_sqrt)
            continue
        flat = [t.view(-1) for t in (p, g, m, v)]
        for start in range(0, p.numel(), PIECE):
            pieces = [t[start:start + PIECE] for t in flat]
            update_piece(*pieces, key, start, decay_factor, step_size, beta1, beta2, eps, bias_correction2_sqrt)


def update_piece(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, key: int, start: int,
                 decay_factor: float, step_size: float, beta1: float, beta2: float, eps: float,
                 bias_correction2_sqrt: float) -> None:
    """`reference_update`'s step on one parameter, or on a piece of one from element `start`, in place."""
    g32 = g.float()
    m32 = m.float().lerp(g32, 1 - beta1)
    v32 = v.float() * beta2 + (1 - beta2) * g32 * g32
    m.copy_(m32)
    v.copy_(v32)
    p32 = p.float() * decay_factor
    p32 = p32 - step_size * (m32 / (v32.sqrt() / bias_correction2_sqrt + eps))
    p.copy_(round_to_bf16_stochastically(p32, key, start))
