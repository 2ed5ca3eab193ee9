"""Exact evaluation across ranks: the objective's loss over the whole held-out set (its sum over the set / its summed
normaliser), at the steps the config names."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshtune.data.collate import Batch
from meshtune.distributed import DistEnv, all_reduce_sum
from meshtune.train.objectives import normalised


class Evaluator:
    """Decides when to evaluate (`due`) and runs it (`run`): every `eval_steps` optimizer steps, after each step of
    `also_at` (the ends of epochs) and at the last one, when there is held-out data. Collective: every rank calls
    both at the same steps."""

    def __init__(self, dataset, batch_size: int, eval_steps: int | None, total_steps: int, env: DistEnv,
                 collate: Callable[[list[list[int]]], Batch], loss: Callable[[Batch], torch.Tensor],
                 count: Callable[[Batch], float], also_at: frozenset[int] = frozenset(), target_share: float = 1.0,
                 metric_names: tuple[str, ...] = (), metric_sums: Callable[[Batch], torch.Tensor] | None = None,
                 metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
                 prepare: Callable[[list[list[int]], list[list[list[int]]]], None] | None = None):
        self.dataset, self.batch_size, self.eval_steps, self.total_steps = dataset, batch_size, eval_steps, total_steps
        self.env, self.collate, self.loss, self.count, self.also_at = env, collate, loss, count, also_at
        # the objective's own values (sums over the set, turned into values by `metrics` once all-reduced),
        # reported as eval_<name>
        self.metric_names, self.metric_sums, self.metrics = metric_names, metric_sums, metrics
        # 1 / cp under context parallel: each process of a cp group sums the loss of its share of the batch's targets
        self.target_share = target_share
        # the objective's pass over the held-out set before its loss (the rows, this rank's micro-batches of them),
        # as over a step's global batch: KTO's KL estimate
        self.prepare = prepare

    def due(self, step: int) -> bool:
        if self.dataset is None:
            return False
        return step == self.total_steps or bool(self.eval_steps and step % self.eval_steps == 0) or step in self.also_at

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> dict[str, float]:
        """`eval_loss` and the objective's values as `eval_<name>`. Every rank runs the same number of forwards (FSDP2
        gathers parameters collectively); a rank with nothing left runs a batch whose targets are all ignored."""
        model.eval()
        env, size = self.env, self.batch_size
        sums = torch.zeros(2 + len(self.metric_names), dtype=torch.float64, device=env.device)
        starts = range(0, len(self.dataset), size * env.world_size)
        if self.prepare is not None:  # over the whole held-out set in its order, this rank's share as it evaluates
            rounds = [range(start + env.rank * size, min(start + (env.rank + 1) * size, len(self.dataset)))
                      for start in starts]
            self.prepare([[i] for i in range(len(self.dataset))], [[[i] for i in share] for share in rounds])
        for start in starts:
            first = start + env.rank * size
            mine = list(range(first, min(first + size, len(self.dataset))))
            batch = self.collate([[i] for i in mine] or [[0]])
            if not mine:
                batch.ignore_all()
            loss = self.loss(batch.to(env.device))
            count = torch.tensor(self.count(batch) * self.target_share, dtype=torch.float64, device=env.device)
            sums[:2] += torch.stack([loss.double(), count])
            if self.metric_names:
                sums[2:] += self.metric_sums(batch)
        all_reduce_sum(sums)
        model.train()
        values = (self.metrics(sums[2:], sums[1]) if self.metrics is not None
                  else dict(zip(self.metric_names, normalised(sums[2:], sums[1]))))
        # a value the set does not define (NaN: KTO's desirable rewards of a set with no desirable sample) is left out
        return {"eval_loss": normalised(sums[0], sums[1]).item(),
                **{f"eval_{name}": float(value) for name, value in values.items() if not math.isnan(float(value))}}
