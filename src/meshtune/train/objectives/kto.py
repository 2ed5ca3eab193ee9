"""`stage: kto`: KTO over unpaired samples (data/unpaired.py), the loss as TRL's KTOTrainer computes it
(train/objectives/kto_loss.py), against the frozen reference of model/reference.py (the model with its adapters off
under LoRA and Q-LoRA, a frozen copy under full fine-tuning or with ref_model).

The unit of data is a sample (a prompt and one response, with its tag); the normaliser is the count of samples, so
a step's loss is the mean of its samples' weighted losses, as TRL's mean over a batch.

**The KL estimate, layout-free.** TRL pairs each prompt of a device batch with the response of the sample before
it (the batch's completions rotated by one) and takes the mean log-ratio of those pairs per device batch, gathered
across processes as a mean of the processes' means; under gradient accumulation each micro-batch has its own. Here
the pairs are formed over the step's whole global batch, in the epoch's order (sample j's prompt with sample j-1's
response, the first with the last's), and their log-ratios are summed in a no-grad pass before the step's
micro-batches (`prepare_step`), then all-reduced as a sum and a count: one KL for the whole step, clamped at 0 and
detached as TRL's. One process with one micro-batch a step is exactly TRL's batch; two processes, accumulation, a
resume on another world size all see the same pairs and the same KL, so their losses are the same. A mismatched
pair is cut to cutoff_len as samples are (the response kept, the prompt's start cut).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from meshtune.data.collate import Batch, collate
from meshtune.data.sampler import Row
from meshtune.data.unpaired import response_start
from meshtune.distributed import DistEnv, all_reduce_sum
from meshtune.model.reference import Reference
from meshtune.model.vocab_parallel_loss import VocabShard
from meshtune.train.objectives.kto_loss import (SUMS, KTOSettings, kl_estimate, kl_sums, kto_losses, metric_sums,
                                                metrics)
from meshtune.train.objectives.preference import sequence_logps


@dataclass
class UnpairedBatch(Batch):
    """A micro-batch of unpaired samples, a sample a row (or end to end in one row, padding-free): each sample's
    tag, and whether it is real (a filler trains nothing)."""

    desirable: torch.Tensor | None = None  # (samples,) bool
    real: torch.Tensor | None = None  # (samples,) bool

    def ignore_all(self) -> UnpairedBatch:
        super().ignore_all()
        self.real = torch.zeros_like(self.real)
        return self

    def to(self, device: torch.device) -> UnpairedBatch:
        moved = super().to(device)
        return UnpairedBatch(**{name: getattr(moved, name) for name in Batch.__dataclass_fields__},
                             desirable=self.desirable.to(device), real=self.real.to(device)).located_as(moved)

    def located_as(self, other: Batch) -> UnpairedBatch:
        self.target_positions, self.target_ids = other.target_positions, other.target_ids
        return self


class MismatchedPairs:
    """Samples made of one sample's prompt and another's response, as a dataset collate reads: `pairs[(p, r)]` is
    the (input ids, labels) of p's prompt then r's response, cut to `cutoff_len` from the prompt's start."""

    def __init__(self, dataset, cutoff_len: int):
        self.dataset, self.cutoff_len = dataset, cutoff_len

    def __getitem__(self, pair: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        prompt_ids, prompt_labels = self.dataset[pair[0]]
        response_ids, response_labels = self.dataset[pair[1]]
        prompt, response = response_start(prompt_labels), response_start(response_labels)
        ids = np.concatenate([prompt_ids[:prompt], response_ids[response:]])[-self.cutoff_len:]
        labels = np.concatenate([prompt_labels[:prompt], response_labels[response:]])[-self.cutoff_len:]
        return ids, labels


@dataclass
class KTOLoss:
    """`loss_sum`: the summed weighted KTO loss of a micro-batch, its reference log-probs from `reference`. `kl`:
    the current step's estimate, set by `prepare_step` (0 before the first)."""

    model: torch.nn.Module
    env: DistEnv
    pad_id: int
    autocast_bf16: bool
    settings: KTOSettings
    cutoff_len: int
    reference: Reference
    autocast_fp16: bool = False
    padding_free: bool = False
    vocab: VocabShard | None = None  # tensor parallel: the logits are this process's share of the vocabulary
    pad_to_multiple: int = 1  # tensor parallel: every process holds an equal share of a row's positions
    # whether this process's KL sums count (the run's mesh, mesh.py's owns_loss): a tensor-parallel group's processes
    # hold the same values, and its first one counts them
    owns_loss: bool = True
    kl: torch.Tensor = field(default_factory=lambda: torch.zeros(()), init=False)
    _sums: torch.Tensor | None = field(default=None, init=False, repr=False)  # of the micro-batch loss_sum last saw

    def collate(self, rows: list[Row], dataset, packed: bool) -> UnpairedBatch:
        samples = [index for row in rows for index in row]
        tags = dataset.desirable
        return self._unpaired(collate(rows, dataset=dataset, pad_id=self.pad_id, packed=False,
                                      pad_to_multiple=self.pad_to_multiple, padding_free=self.padding_free),
                              torch.tensor([bool(tags[i]) for i in samples], dtype=torch.bool))

    def _unpaired(self, batch: Batch, desirable: torch.Tensor) -> UnpairedBatch:
        return UnpairedBatch(**{name: getattr(batch, name) for name in Batch.__dataclass_fields__},
                             desirable=desirable, real=torch.ones_like(desirable))

    def prepare_step(self, step_rows: list[Row], micro_rows: list[list[Row]], dataset) -> None:
        """The step's KL estimate over mismatched pairs of its global batch (see the module's docstring); every rank
        runs one no-grad pass of the policy and one of the reference per micro-batch, a filler for an empty one."""
        order = [row[0] for row in step_rows]
        previous = dict(zip(order, order[-1:] + order[:-1]))  # sample -> the sample whose response it is paired with
        pairs = MismatchedPairs(dataset, self.cutoff_len)
        sums = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for rows in micro_rows:
            mine = [[(row[0], previous[row[0]])] for row in rows] or [[(order[0], order[0])]]
            batch = collate(mine, dataset=pairs, pad_id=self.pad_id, packed=False,
                            pad_to_multiple=self.pad_to_multiple, padding_free=self.padding_free)
            batch = batch.to(self.env.device)
            with torch.no_grad():
                logps = self._logps(batch)
            ref_logps = self._ref_logps(batch)
            if rows:
                sums += kl_sums(logps, ref_logps)
        self.kl = kl_estimate(all_reduce_sum(sums * float(self.owns_loss)))

    def _logps(self, batch: Batch) -> torch.Tensor:
        """Each sample's summed log-prob of its targets under the policy (fp32)."""
        with self._autocast():
            logits = self.model(**batch.model_inputs(), use_cache=False).logits
        return sample_logps(logits, batch, self.vocab)

    @torch.no_grad()
    def _ref_logps(self, batch: Batch) -> torch.Tensor:
        """The same under the reference, without a graph."""
        with self._autocast():
            logits = self.reference.logits(batch.model_inputs())
        return sample_logps(logits, batch, self.reference.vocab)

    def _autocast(self):
        dtype = torch.float16 if self.autocast_fp16 else torch.bfloat16
        return torch.autocast(self.env.device.type, dtype=dtype, enabled=self.autocast_bf16 or self.autocast_fp16)

    def loss_sum(self, batch: UnpairedBatch) -> torch.Tensor:
        ref_logps = self._ref_logps(batch)  # first: its logits are freed before the policy's exist
        logps = self._logps(batch)
        kl = self.kl.to(logps.device)
        samples = kto_losses(self.settings, logps, ref_logps, batch.desirable, kl)
        self._sums = metric_sums(samples, logps, batch.desirable, kl, batch.real)
        return torch.where(batch.real, samples.losses, torch.zeros_like(samples.losses)).sum()

    def count(self, batch: UnpairedBatch) -> int:
        return int(batch.real.sum())

    @property
    def metric_names(self) -> tuple[str, ...]:
        return SUMS

    def metric_sums(self, batch: Batch) -> torch.Tensor:
        return self._sums

    def metrics(self, sums: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        return metrics(sums, count)


def sample_logps(logits: torch.Tensor, batch: Batch, vocab: VocabShard | None = None) -> torch.Tensor:
    """Each sample's summed log-prob of its (shifted) targets: a row's, or under padding-free each sample's of the
    one row. `vocab`: the logits are this process's share of the vocabulary (tensor parallel)."""
    return sequence_logps(logits, batch.targets, batch.cu_seqlens, vocab)[0]
