"""The CUDA step of StochasticBf16AdamW: one Triton kernel launch updates every parameter.

The kernel reads a table of the tensors' addresses (weights, gradients, moments), element counts, random keys and
per-parameter factors, and each program updates one chunk of one parameter. The host's work per step is to refill
that table (gradients are new tensors each step) and copy it from pinned memory without waiting for the GPU; the
arithmetic is `bf16_adamw_reference.reference_update`'s, element by element, with IEEE division and square root.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from meshtune.train.bf16_adamw_reference import GOLDEN32, MASK32, MIX32, reference_update

BLOCK = 1024
CHUNK_BLOCKS = 8  # a program updates CHUNK = 8,192 elements of one parameter
CHUNK = BLOCK * CHUNK_BLOCKS
COLUMNS = 6  # the int64 table: weight, gradient, first and second moment addresses, element count, random key
# the hash's constants, as Triton lets a kernel read globals
HASH_GOLDEN = tl.constexpr(GOLDEN32)
HASH_MASK = tl.constexpr(MASK32)
HASH_MIX = tl.constexpr(MIX32)


@triton.jit
def adamw_bf16_kernel(table, factors, chunk_param, chunk_start, one_minus_beta1, beta2, one_minus_beta2, eps,
                      bias_correction2_sqrt, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(chunk_param + pid).to(tl.int64)
    start = tl.load(chunk_start + pid)
    row = table + i * 6
    p_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
    numel = tl.load(row + 4)
    key = tl.load(row + 5)
    decay_factor = tl.load(factors + 2 * i)
    step_size = tl.load(factors + 2 * i + 1)
    golden = tl.full([1], HASH_GOLDEN, tl.int64)
    mask32 = tl.full([1], HASH_MASK, tl.int64)
    mix = tl.full([1], HASH_MIX, tl.int64)
    for b in range(CHUNK_BLOCKS):
        idx = start + b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        live = idx < numel
        g = tl.load(g_ptr + idx, mask=live, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=live, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=live, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=live, other=0.0).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        tl.store(m_ptr + idx, m.to(tl.bfloat16), mask=live)
        tl.store(v_ptr + idx, v.to(tl.bfloat16), mask=live)
        p = p * decay_factor
        p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps)
        # stochastic rounding: the random bits of bf16_adamw.random_16bit for this element
        x = ((idx & 0x7FFFFFFF) * golden + key) & mask32
        x = (((x >> 16) ^ x) * mix) & mask32
        x = (((x >> 16) ^ x) * mix) & mask32
        r = (((x >> 16) ^ x) & 0xFFFF).to(tl.int32)
        bits = p.to(tl.int32, bitcast=True)
        toward_zero = bits & -0x10000
        rounded = tl.where(r < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
        tl.store(p_ptr + idx, rounded.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=live)


class KernelLauncher:
    """Keeps the chunk map (which parameter and offset each program takes; rebuilt when the element counts
    change) and two pinned host tables used in turn, each reused once the copy out of it has finished."""

    def __init__(self, device: torch.device):
        self.device = device
        self.numels: tuple[int, ...] | None = None
        self.slot = 0

    def chunk_map(self, numels: tuple[int, ...]) -> None:
        params, starts = [], []
        for i, n in enumerate(numels):
            count = -(-n // CHUNK)
            params.append(np.full(count, i, dtype=np.int32))
            starts.append(np.arange(count, dtype=np.int64) * CHUNK)
        self.chunk_param = torch.from_numpy(np.concatenate(params)).to(self.device)
        self.chunk_start = torch.from_numpy(np.concatenate(starts)).to(self.device)
        rows = len(numels) * COLUMNS + len(numels)  # the table, then 2 fp32 factors a parameter (one int64 slot)
        self.host = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.copied = [None, None]
        self.table = torch.empty(rows, dtype=torch.int64, device=self.device)
        self.numels = numels

    def update(self, params, grads, exp_avgs, exp_avg_sqs, keys, decay_factors, step_sizes, beta1, beta2, eps,
               bias_correction2_sqrt) -> None:
        tensors = (params, grads, exp_avgs, exp_avg_sqs)
        if not all(t.is_contiguous() for group in tensors for t in group):  # flat indexing needs dense tensors
            reference_update(params, grads, exp_avgs, exp_avg_sqs, keys, decay_factors, step_sizes, beta1, beta2,
                             eps, bias_correction2_sqrt)
            return
        numels = tuple(p.numel() for p in params)
        if numels != self.numels:
            self.chunk_map(numels)
        if self.chunk_param.numel() == 0:
            return
        n = len(params)
        slot = self.slot
        self.slot ^= 1
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the copy of two steps ago, long done: the slot may be rewritten
        host = self.host[slot].numpy()
        table = host[:n * COLUMNS].reshape(n, COLUMNS)
        for column, group in enumerate(tensors):
            table[:, column] = [t.data_ptr() for t in group]
        table[:, 4] = numels
        table[:, 5] = keys
        host[n * COLUMNS:].view(np.float32)[:] = np.array([decay_factors, step_sizes], dtype=np.float32).T.reshape(-1)
        self.table.copy_(self.host[slot], non_blocking=True)
        self.copied[slot] = torch.cuda.Event()
        self.copied[slot].record()
        factors = self.table[n * COLUMNS:].view(torch.float32)
        adamw_bf16_kernel[(self.chunk_param.numel(),)](
            self.table, factors, self.chunk_param, self.chunk_start, 1 - beta1, beta2, 1 - beta2, eps,
            bias_correction2_sqrt, BLOCK=BLOCK, CHUNK_BLOCKS=CHUNK_BLOCKS, num_warps=4)
