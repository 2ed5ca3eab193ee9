"""Cross-entropy over logits split by vocabulary (tensor parallel's head): each process holds its share of every
row's logits, and three all-reduces of one value a row (the maximum, the sum of exponentials, the target's logit)
give the loss, as Megatron-LM's vocabulary-parallel cross-entropy does. The whole-vocabulary logits are never
gathered: for a 152k-token vocabulary they would be the step's largest tensor on every process.

Same math as `F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")` (the plain path): the
softmax in fp32, the loss summed over the rows with a target. The same three all-reduces give each position's target
log-probability (`vocab_parallel_target_logps`), which the preference losses sum over each response (stage: dpo and
kto under tensor parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

IGNORE = -100  # a row without a target (data/collate.py's IGNORE; the model package does not import data)


@dataclass(frozen=True)
class VocabShard:
    """Which share of the vocabulary this process's logits cover: ids [start, start + its width)."""

    group: dist.ProcessGroup  # the tensor-parallel group, whose processes hold the other shares
    start: int


class _VocabParallelTargetLogProbs(torch.autograd.Function):
    """Each row's log-probability of its target (0 for a row without one), its gradient that of the whole
    vocabulary's log-softmax restricted to this process's share."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        row_max = logits.max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)
        exp = (logits - row_max[:, None]).exp_()
        sum_exp = exp.sum(dim=1)
        dist.all_reduce(sum_exp, group=shard.group)
        local = targets - shard.start
        here = (targets != IGNORE) & (local >= 0) & (local < logits.size(1))
        rows = here.nonzero().squeeze(1)
        target_logit = torch.zeros_like(sum_exp)
        target_logit[rows] = logits[rows, local[rows]] - row_max[rows]
        dist.all_reduce(target_logit, group=shard.group)
        valid = targets != IGNORE
        logps = (target_logit - sum_exp.log()) * valid
        exp.div_(sum_exp[:, None])  # the softmax: the gradient, once the target's one is taken off
        ctx.save_for_backward(exp, rows, local, valid)
        return logps

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor):
        softmax, rows, local, valid = ctx.saved_tensors
        grad = softmax.neg_()  # d log p(target) / d logit = [is the target] - softmax
        grad[rows, local[rows]] += 1.0
        grad.mul_((valid.to(grad.dtype) * grad_logps)[:, None])
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_target_logps(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The log-probability of each position's target (shape of `targets`; 0 where it is IGNORE) from `logits`
    (..., this process's vocabulary share), in fp32 and differentiable: the same value on every process of the
    group, each process's gradient reaching its own share of the logits."""
    width = logits.size(-1)
    return _VocabParallelTargetLogProbs.apply(logits.reshape(-1, width), targets.reshape(-1), shard).view(
        targets.shape)


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Summed cross-entropy of `logits` (..., this process's vocabulary share) against `targets` (...), in fp32."""
    return -vocab_parallel_target_logps(logits, targets, shard).sum()


def vocab_shard(model: torch.nn.Module) -> VocabShard | None:
    """The vocabulary share of `model`'s logits where tensor parallel split its head (model/tensor_parallel.py);
    None where its logits are whole."""
    return getattr(model, "meshtune_vocab_shard", None)
