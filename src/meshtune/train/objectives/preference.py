"""The preference losses of a chosen / rejected pair, from each response's log-probability under the policy and,
where the loss has one, the reference: LLaMA-Factory's `pref_loss` values with TRL's arithmetic.

- sigmoid (DPO), hinge and ipo compare the policy's log-ratio to the reference's, as TRL's DPOTrainer does (ipo's
  log-ratios averaged per response token, as TRL does); sigmoid's `label_smoothing` is conservative DPO's.
- simpo and orpo need no reference and use each response's mean token log-prob: simpo as TRL's CPOTrainer
  (`simpo_gamma` the target margin), orpo as TRL's ORPOTrainer's odds ratio plus the chosen response's negative
  mean log-prob, per pair, as LLaMA-Factory sums them.
- `ftx` adds the chosen response's mean token negative log-likelihood (LLaMA-Factory's `pref_ftx`).

The loss of a pair is a sum over its terms and the normaliser a count of pairs, so a step's loss is the mean over
its global batch on any layout. The reported values are sums over pairs too (`metric_sums`), divided by the summed
pair count once reduced: TRL's names, exact across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtune.data.collate import IGNORE, sequence_sums
from meshtune.model.vocab_parallel_loss import VocabShard, vocab_parallel_target_logps

PREF_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceSettings:
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid and simpo
    simpo_gamma: float = 0.5
    ftx: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in PREF_LOSSES:
            raise ValueError(f"pref_loss {self.loss!r}: use one of {', '.join(PREF_LOSSES)}")

    @property
    def needs_reference(self) -> bool:
        return self.loss not in ("orpo", "simpo")


@dataclass
class PairLosses:
    losses: torch.Tensor  # (pairs,), differentiable
    chosen_rewards: torch.Tensor  # (pairs,), detached
    rejected_rewards: torch.Tensor


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None,
                   vocab: VocabShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its targets (labels shifted as collate shifts them, so no sequence
    reaches into the next) and its count of target tokens; fp32 whatever the compute dtype. A sequence is a row, or
    under padding-free (`cu_seqlens`) a sample of the one row. `vocab`: the logits are this process's share of the
    vocabulary (tensor parallel), each token's log-prob computed across the shares."""
    return sequence_sums(token_logps(logits, targets, vocab), cu_seqlens), target_counts(targets, cu_seqlens)


def target_counts(targets: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's count of target tokens."""
    return sequence_sums((targets != IGNORE).long(), cu_seqlens)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, vocab: VocabShard | None = None) -> torch.Tensor:
    """Each position's log-probability of its target (0 where there is none), fp32, in the shape of `targets`."""
    if vocab is not None:
        return vocab_parallel_target_logps(logits, targets, vocab)
    return -F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="none").view(targets.shape)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable near 0 (the form TRL's ORPO uses)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(settings: PreferenceSettings, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                ref_rejected: torch.Tensor | None = None) -> PairLosses:
    """Each pair's loss and rewards from the responses' summed log-probs (`chosen`, `rejected`: (pairs,)) and
    their target-token counts; `ref_*` the reference's summed log-probs, for the losses that have a reference."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen_mean = chosen / chosen_tokens.clamp(min=1)
    if settings.needs_reference:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"pref_loss {settings.loss} compares against the reference's log-probs")
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if settings.loss == "sigmoid":
            losses = -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing
        elif settings.loss == "hinge":
            losses = torch.relu(1 - beta * delta)
        else:  # ipo
            per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (per_token - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    else:
        rejected_mean = rejected / rejected_tokens.clamp(min=1)
        if settings.loss == "simpo":
            margin = chosen_mean - rejected_mean - settings.simpo_gamma / beta
            losses = -F.logsigmoid(beta * margin) * (1 - smoothing) - F.logsigmoid(-beta * margin) * smoothing
        else:  # orpo
            log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
            losses = -chosen_mean - beta * F.logsigmoid(log_odds)
        chosen_rewards, rejected_rewards = beta * chosen_mean.detach(), beta * rejected_mean.detach()
    if settings.ftx:
        losses = losses - settings.ftx * chosen_mean
    return PairLosses(losses, chosen_rewards, rejected_rewards)


def metric_sums(pairs: PairLosses, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """METRICS' numerators summed over the pairs, in fp64: all-reduced with the pair count, then divided once."""
    c, r = pairs.chosen_rewards.double(), pairs.rejected_rewards.double()
    return torch.stack([c.sum(), r.sum(), (c > r).double().sum(), (c - r).sum(), chosen.detach().double().sum(),
                        rejected.detach().double().sum()])


def metrics(sums: torch.Tensor, pairs: torch.Tensor | float) -> dict[str, float]:
    """The reported values from the summed numerators and the summed pair count."""
    count = float(pairs)
    return {name: float(value) / max(count, 1.0) for name, value in zip(METRICS, sums.tolist())}
