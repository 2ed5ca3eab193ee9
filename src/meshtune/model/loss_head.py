"""Fused output projection + cross-entropy: the full-vocabulary logits never exist at once.

The model's output head (`lm_head`, an nn.Linear) gets a subclass whose forward, while `targets_for` is active,
returns the summed token loss instead of logits. It projects only the positions that carry a target, in chunks of
rows, and computes each chunk's gradient (softmax - one-hot) right away, so the stored state is one gradient of
the hidden states (and of the head weight when it trains) instead of tokens x vocabulary fp32 logits: for
152k-vocabulary Qwen that is gigabytes per micro-batch. Parameters and state-dict keys stay those of the model,
and the head runs inside the model's forward, so DDP and FSDP2 hooks see it as usual.

Same math as `F.cross_entropy(logits.float(), targets, reduction="sum")` (the plain path): logits in the compute
dtype, softmax in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

ROWS_ELEMENTS = 2**28  # about 1 GiB of fp32 logits per chunk


def chunk_rows(vocab_size: int) -> int:
    return max(64, ROWS_ELEMENTS // vocab_size)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, softmax_dtype: torch.dtype):
    """The chunk's logits, their log-sum-exp per row and its summed loss."""
    logits = (h @ weight.t()).to(softmax_dtype)
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse, (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, softmax_dtype: torch.dtype):
    return _chunk_logits(h, weight, t, softmax_dtype)[2]


def _chunk_loss_and_grad(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, softmax_dtype: torch.dtype):
    """The chunk's summed loss and d(loss)/d(logits) = softmax - one-hot, in the compute dtype. Written as
    whole-tensor expressions so that torch.compile fuses everything after the matmul into two passes."""
    logits, lse, loss = _chunk_logits(h, weight, t, softmax_dtype)
    onehot = torch.arange(logits.size(1), device=t.device)[None, :] == t[:, None]
    grad = (torch.exp(logits - lse[:, None]) - onehot.to(softmax_dtype)).to(h.dtype)
    return loss, grad


_COMPILED: dict = {}


def _kernel(fn, compiled: bool):
    if not compiled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, need_hidden: bool,
                  need_weight: bool, chunk: int, compiled: bool = False):
    """Summed loss of rows `hidden` (N, H) against `targets` (N,), plus d(loss)/d(hidden) and d(loss)/d(weight)."""
    softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least, as the plain path
    total = torch.zeros((), dtype=softmax_dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=softmax_dtype, device=weight.device) if need_weight else None
    for start in range(0, hidden.size(0), chunk):
        h = hidden[start:start + chunk]
        t = targets[start:start + chunk]
        if not (need_hidden or need_weight):
            total += _kernel(_chunk_loss, compiled)(h, weight, t, softmax_dtype)
            continue
        loss, g = _kernel(_chunk_loss_and_grad, compiled)(h, weight, t, softmax_dtype)
        total += loss
        if need_hidden:
            torch.mm(g, weight, out=grad_hidden[start:start + chunk])
        if need_weight:
            grad_weight += g.t() @ h
    return total, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass (as Liger's fused linear cross-entropy); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, compiled):
        total, ctx.grad_hidden, ctx.grad_weight = _chunked_loss(
            hidden, weight, targets, ctx.needs_input_grad[0], ctx.needs_input_grad[1], chunk, compiled)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden = grad_weight = None
        if ctx.grad_hidden is not None:
            grad_hidden = ctx.grad_hidden * grad_total.to(ctx.grad_hidden.dtype)
        if ctx.grad_weight is not None:
            grad_weight = (ctx.grad_weight * grad_total).to(ctx.weight_dtype)
        ctx.grad_hidden = ctx.grad_weight = None
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                         targets: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Summed cross-entropy of `hidden` (..., H) rows at flat `positions` against `targets` (same length)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, positions).to(dtype)
        w = weight.to(dtype)
        chunk = chunk_rows(weight.size(0))
        if torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad):
            return _LinearCrossEntropy.apply(rows, w, targets, chunk, compiled)
        return _chunked_loss(rows, w, targets, False, False, chunk, compiled)[0]


class LossHead(torch.nn.Linear):
    """The model's own output head; returns the summed loss while `pending` holds (positions, targets)."""

    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    compiled = False  # the loss chunks through torch.compile (with torch_compile)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pending is None:
            return super().forward(hidden)
        positions, targets = self.pending
        self.pending = None
        return linear_cross_entropy(hidden, self.weight, positions, targets, self.compiled)


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The head that computes the logits: the model's own, or with additional_target naming it, its trainable copy
    (peft's ModulesToSaveWrapper runs that copy), so the fused loss reads and trains the copy's weight."""
    base = getattr(model, "get_base_model", lambda: model)()
    head = base.get_output_embeddings()
    copies = getattr(head, "modules_to_save", None)
    return copies[head.active_adapters[0]] if isinstance(copies, torch.nn.ModuleDict) else head


def install_loss_head(model: torch.nn.Module, compiled: bool = False) -> bool:
    """Turn the model's output head into a LossHead in place; False when it is not a bias-free nn.Linear."""
    head = output_head(model)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    head.__class__ = LossHead
    head.compiled = compiled
    return True


@contextmanager
def targets_for(model: torch.nn.Module, positions: torch.Tensor, targets: torch.Tensor):
    """During the next forward, the head returns the summed loss of `targets` at flat `positions`."""
    head = output_head(model)
    head.pending = (positions, targets)
    try:
        yield
    finally:
        head.pending = None
