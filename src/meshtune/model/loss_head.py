"""Fused output projection + cross-entropy: the full-vocabulary logits never exist at once.

The model's output head (`lm_head`, an nn.Linear) gets a subclass whose forward, while `targets_for` is active,
returns the summed token loss instead of logits. It projects only the positions that carry a target, in chunks of
rows, and computes each chunk's gradient (softmax - one-hot) right away, so the stored state is one gradient of
the hidden states (and of the head weight when it trains) instead of tokens x vocabulary fp32 logits: for
152k-vocabulary Qwen that is gigabytes per micro-batch. Parameters and state-dict keys stay those of the model,
and the head runs inside the model's forward, so DDP and FSDP2 hooks see it as usual.

Same math as `F.cross_entropy(logits.float(), targets, reduction="sum")` (the plain path): logits in the compute
dtype, softmax in fp32.

While `logps_for` is active the head returns each row's summed log-probability of its targets instead (what
preference losses compare): the same chunks, the log-probs kept per position and summed per row; backward computes
each chunk's logits again and scales its (one-hot - softmax) by the loss's gradient of that position's row, since
that gradient is known only once the pair's loss is.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# logits a chunk: 441 rows of a 152k vocabulary, 128 MiB in bf16. A chunk's logits and their gradient are alive at
# the end of the forward, the step's peak, beside every kept block's activations: 2**28 (1,765 rows) held about
# 1 GiB there, which memory_budget's fit then gave to recomputed blocks; 441 rows still fill the matmul units
ROWS_ELEMENTS = 2**26


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


@contextmanager
def _head_rows(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor):
    """The rows of `hidden` (..., H) at flat `positions` and the head's weight, both in the compute dtype (autocast's,
    else the weight's), and the rows a chunk takes; autocast is off inside, so each chunk's matmul keeps that dtype."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        yield (hidden.reshape(-1, hidden.size(-1)).index_select(0, positions).to(dtype), weight.to(dtype),
               chunk_rows(weight.size(0)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                         targets: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Summed cross-entropy of `hidden` (..., H) rows at flat `positions` against `targets` (same length)."""
    with _head_rows(hidden, weight, positions) as (rows, w, chunk):
        if torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad):
            return _LinearCrossEntropy.apply(rows, w, targets, chunk, compiled)
        return _chunked_loss(rows, w, targets, False, False, chunk, compiled)[0]


def _chunk_token_logps(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, softmax_dtype: torch.dtype):
    """The chunk's log-probability of each row's target."""
    logits, lse, _ = _chunk_logits(h, weight, t, softmax_dtype)
    return logits.gather(1, t[:, None]).squeeze(1) - lse


def _chunk_logps_grad(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
                      softmax_dtype: torch.dtype):
    """d(sum of g x log-prob)/d(logits) = g (one-hot - softmax), in the compute dtype."""
    logits, lse, _ = _chunk_logits(h, weight, t, softmax_dtype)
    onehot = torch.arange(logits.size(1), device=t.device)[None, :] == t[:, None]
    return ((onehot.to(softmax_dtype) - torch.exp(logits - lse[:, None])) * g[:, None].to(softmax_dtype)).to(h.dtype)


def _token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                 compiled: bool) -> torch.Tensor:
    """(N,): each row of `hidden` (N, H)'s log-probability of its target, chunk by chunk; fp32 at least."""
    softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.empty(hidden.size(0), dtype=softmax_dtype, device=hidden.device)
    for start in range(0, hidden.size(0), chunk):
        out[start:start + chunk] = _kernel(_chunk_token_logps, compiled)(
            hidden[start:start + chunk], weight, targets[start:start + chunk], softmax_dtype)
    return out


class _LinearLogProbs(torch.autograd.Function):
    """Each row's target log-prob; backward recomputes each chunk's logits (no tokens x vocabulary tensor is kept)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, compiled):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.compiled = chunk, compiled
        ctx.softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)
        return _token_logps(hidden, weight, targets, chunk, compiled)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=ctx.softmax_dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.size(0), ctx.chunk):
            h = hidden[start:start + ctx.chunk]
            g = _kernel(_chunk_logps_grad, ctx.compiled)(h, weight, targets[start:start + ctx.chunk],
                                                         grad_out[start:start + ctx.chunk], ctx.softmax_dtype)
            if need_hidden:
                torch.mm(g, weight, out=grad_hidden[start:start + ctx.chunk])
            if need_weight:
                grad_weight += g.t() @ h
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def linear_row_logps(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                     rows: torch.Tensor, n_rows: int, compiled: bool = False) -> torch.Tensor:
    """(n_rows,): each row's summed log-probability of `targets` at flat `positions` of `hidden` (..., H), `rows`
    naming each position's row; fp32 at least."""
    with _head_rows(hidden, weight, positions) as (flat, w, chunk):
        if torch.is_grad_enabled() and (flat.requires_grad or w.requires_grad):
            token = _LinearLogProbs.apply(flat, w, targets, chunk, compiled)
        else:
            token = _token_logps(flat, w, targets, chunk, compiled)
        return torch.zeros(n_rows, dtype=token.dtype, device=token.device).index_add(0, rows, token)


class LossHead(torch.nn.Linear):
    """The model's own output head; returns the summed loss while `pending` holds (positions, targets), or each
    row's summed log-prob while `pending_logps` holds (positions, targets, rows, number of rows)."""

    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    pending_logps: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
    compiled = False  # the loss chunks through torch.compile (with torch_compile)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pending_logps is not None:
            positions, targets, rows, n_rows = self.pending_logps
            self.pending_logps = None
            return linear_row_logps(hidden, self.weight, positions, targets, rows, n_rows, self.compiled)
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


def sequence_of_positions(positions: torch.Tensor, row_length: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The sequence each flat position lies in: its row, or under padding-free its sample of the one row."""
    if cu_seqlens is None:
        return positions // row_length
    return torch.searchsorted(cu_seqlens[1:].to(positions.device, torch.long), positions, right=True)


@contextmanager
def logps_for(model: torch.nn.Module, targets: torch.Tensor, ignore_index: int,
              cu_seqlens: torch.Tensor | None = None):
    """During the next forward, the head returns each sequence's summed log-prob of `targets` ((rows, positions),
    the model's shifted labels, `ignore_index` where nothing is trained): a row's, or under padding-free (one row,
    `cu_seqlens` its samples' bounds) each sample's."""
    flat = targets.reshape(-1)
    positions = (flat != ignore_index).nonzero().squeeze(1)
    head = output_head(model)
    sequences = targets.size(0) if cu_seqlens is None else len(cu_seqlens) - 1
    head.pending_logps = (positions, flat.index_select(0, positions),
                          sequence_of_positions(positions, targets.size(1), cu_seqlens), sequences)
    try:
        yield
    finally:
        head.pending_logps = None
