"""`stage: dpo`: the preference loss of chosen / rejected pairs (train/objectives/preference.py's arithmetic).

The unit of data is a pair (data/pairs.py's `Pairs`). A micro-batch of n pairs is one padded batch of 2n rows, the
chosen responses first and the rejected after them (TRL's concatenated forward): one policy forward, and one
reference forward (model/reference.py) where the loss has a reference, unless its log-probs were precomputed
(`precompute_ref_log_probs`: train/reference_pass.py) and come with the batch. Each row's log-prob is the sum over
its response's tokens (with `fused_loss`, summed in chunks by the model's head: model/loss_head.py's `logps_for`;
under tensor parallel across the processes' shares of the vocabulary: model/vocab_parallel_loss.py). The loss is
the sum over pairs, the normaliser the pair count, so a step's loss is the mean over its global batch whatever the
layout; the reported values (TRL's names) are sums over pairs, divided once by the summed count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from meshtune.data.collate import IGNORE, Batch, collate
from meshtune.data.sampler import Row
from meshtune.distributed import DistEnv
from meshtune.model.loss_head import logps_for
from meshtune.model.parallel import unwrap
from meshtune.model.reference import Reference
from meshtune.model.vocab_parallel_loss import VocabShard
from meshtune.train.objectives import normalised
from meshtune.train.objectives.preference import (METRICS, PreferenceSettings, metric_sums, pair_losses,
                                                  sequence_logps, target_counts)


class PairRows:
    """A micro-batch's pairs as rows of single sequences: the chosen ones, then the rejected ones."""

    def __init__(self, pairs: list[int], dataset):
        self.sequences = [dataset[i][0] for i in pairs] + [dataset[i][1] for i in pairs]

    def __getitem__(self, i: int):
        return self.sequences[i]


def collate_pairs(rows: list[Row], dataset, pad_id: int, padding_free: bool = False,
                  pad_to_multiple: int = 1) -> Batch:
    """Rows of pairs -> a batch of 2 x pairs sequences, the chosen ones first: padded rows, a sequence each (padded
    to a multiple of `pad_to_multiple`: tensor parallel's equal shares of positions; padding has no target), or
    with `padding_free` every sequence end to end in one row (a pair's two responses in it, each attending only to
    itself); with the sequences' precomputed reference log-probs where the dataset holds them
    (data/reference_logps.py's `WithReference`)."""
    pairs = [index for row in rows for index in row]
    sequences = PairRows(pairs, dataset)
    batch = collate([[i] for i in range(2 * len(pairs))], dataset=sequences, pad_id=pad_id, packed=False,
                    pad_to_multiple=pad_to_multiple, padding_free=padding_free)
    known = getattr(dataset, "reference_logps", None)
    if known is not None:
        batch.reference_logps = torch.from_numpy(np.concatenate([known[pairs, 0], known[pairs, 1]]))
    return batch


def reference_logps(reference: Reference, batch: Batch, device: torch.device, autocast_bf16: bool,
                    autocast_fp16: bool, fused: bool = False) -> torch.Tensor:
    """Each row's summed log-prob under the reference: the step's arithmetic, which the precomputing pass
    (train/reference_pass.py) runs too; with `fused`, the fused head's, as the policy's are summed (so a policy
    equal to its reference has a margin of exactly 0)."""
    dtype = torch.float16 if autocast_fp16 else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype, enabled=autocast_bf16 or autocast_fp16):
        rows = reference.row_logps(batch.model_inputs(), batch.targets, IGNORE) if fused else None
        if rows is not None:
            return rows
        return sequence_logps(reference.logits(batch.model_inputs()), batch.targets, batch.cu_seqlens,
                              reference.vocab)[0]


@dataclass
class PairLoss:
    model: torch.nn.Module
    env: DistEnv
    pad_id: int
    settings: PreferenceSettings
    reference: Reference | None
    autocast_bf16: bool = False
    autocast_fp16: bool = False
    precomputed: bool = False  # the reference's log-probs come with each batch (precompute_ref_log_probs)
    fused: bool = False  # fused_loss: the policy's head returns each row's summed log-prob (model/loss_head.py)
    padding_free: bool = False  # a micro-batch's sequences end to end in one row
    vocab: VocabShard | None = None  # tensor parallel: the logits are this process's share of the vocabulary
    pad_to_multiple: int = 1  # tensor parallel: every process holds an equal share of a row's positions
    last: dict = field(default_factory=dict)  # what loss_sum computed, for metric_sums

    def collate(self, rows: list[Row], dataset, packed: bool) -> Batch:
        return collate_pairs(rows, dataset, self.pad_id, self.padding_free, self.pad_to_multiple)

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        dtype = torch.float16 if self.autocast_fp16 else torch.bfloat16
        inputs = batch.model_inputs()
        n = batch.num_sequences // 2
        if self.precomputed:
            ref = batch.reference_logps
            if ref is None:
                raise RuntimeError("precompute_ref_log_probs: a batch of pairs came without their reference log-probs")
        else:  # the reference first, reduced to a value a row: its logits are freed before the policy's exist
            ref = (reference_logps(self.reference, batch, self.env.device, self.autocast_bf16, self.autocast_fp16,
                                   self.fused) if self.reference is not None else None)
        with torch.autocast(self.env.device.type, dtype=dtype, enabled=self.autocast_bf16 or self.autocast_fp16):
            if self.fused:  # no rows x positions x vocabulary logits: the head sums each row's log-probs in chunks
                with logps_for(unwrap(self.model), batch.targets, IGNORE, batch.cu_seqlens):
                    logps = self.model(**inputs, use_cache=False).logits
                tokens = target_counts(batch.targets, batch.cu_seqlens)
            else:
                logps, tokens = sequence_logps(self.model(**inputs, use_cache=False).logits, batch.targets,
                                               batch.cu_seqlens, self.vocab)
        pairs = pair_losses(self.settings, logps[:n], logps[n:], tokens[:n], tokens[n:],
                            None if ref is None else ref[:n], None if ref is None else ref[n:])
        self.last = {"pairs": pairs, "chosen": logps[:n], "rejected": logps[n:], "weight": 0.0 if batch.filler else 1.0}
        if batch.filler:  # keeps the collectives in step and trains nothing (its log-probs are sums over no token)
            return logps.sum() * 0.0
        return pairs.losses.sum()

    def count(self, batch: Batch) -> int:
        return 0 if batch.filler else batch.num_sequences // 2

    def prepare_step(self, step_rows: list[Row], micro_rows: list[list[Row]], dataset) -> None:
        pass  # a pair's loss is its own

    def metrics(self, sums: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.metric_names, normalised(sums, count)))  # each a sum over pairs / the pair count

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS

    def metric_sums(self, batch: Batch) -> torch.Tensor:
        last = self.last
        return metric_sums(last["pairs"], last["chosen"], last["rejected"]) * last["weight"]
