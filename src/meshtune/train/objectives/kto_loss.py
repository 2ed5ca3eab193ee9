"""The KTO loss of unpaired samples from each response's log-probability under the policy and the reference, with
TRL's KTOTrainer arithmetic (tests/test_kto.py holds it to TRL's own code).

A desirable response's loss is 1 - sigmoid(beta (log-ratio - KL)), an undesirable one's 1 - sigmoid(beta (KL -
log-ratio)), weighted by `kto_chosen_weight` / `kto_rejected_weight` (TRL's desirable_weight / undesirable_weight);
the log-ratio is the response's summed log-prob under the policy minus under the reference, and KL the batch's
estimate of the policy's divergence from the reference: the mean log-ratio of mismatched pairs (each prompt with
another sample's response), clamped at 0 and detached, as TRL forms it. The loss of a sample is its term and the
normaliser a count of samples, so a step's loss is the mean over its samples; the reported values are sums with
their counts (`metric_sums`), divided once they are summed over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "desirable", "undesirable", "kl")


@dataclass(frozen=True)
class KTOSettings:
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass
class UnpairedLosses:
    losses: torch.Tensor  # (samples,), weighted, differentiable
    rewards: torch.Tensor  # (samples,), beta x log-ratio, detached


def kl_sums(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The numerator and count of the KL estimate over mismatched pairs (fp64: summed across micro-batches and
    ranks before the one division in `kl_estimate`)."""
    return torch.stack([(logps - ref_logps).detach().double().sum(),
                        torch.tensor(float(logps.numel()), dtype=torch.float64, device=logps.device)])


def kl_estimate(sums: torch.Tensor) -> torch.Tensor:
    """KL from its summed numerator and count: their mean, at least 0, as TRL's clamp(min=0); 0 without pairs."""
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()


def kto_losses(settings: KTOSettings, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor) -> UnpairedLosses:
    """Each sample's weighted loss and reward from its response's summed log-probs under the policy (`logps`) and
    the reference (`ref_logps`), its tag (`desirable`, bool) and the batch's KL estimate (detached)."""
    ratio = logps - ref_logps
    beta, kl = settings.beta, kl.detach().to(ratio.dtype)
    chosen = settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return UnpairedLosses(torch.where(desirable, chosen, rejected), beta * ratio.detach())


def metric_sums(samples: UnpairedLosses, logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
                real: torch.Tensor) -> torch.Tensor:
    """SUMS over the `real` samples (a filler row counts for nothing), in fp64: the rewards and log-probs of each
    class with its count, and KL once per sample (so the step's KL is its sum over the sample count)."""
    chosen, rejected = (desirable & real).double(), (~desirable & real).double()
    rewards, logps = samples.rewards.double(), logps.detach().double()
    return torch.stack([(rewards * chosen).sum(), (rewards * rejected).sum(), (logps * chosen).sum(),
                        (logps * rejected).sum(), chosen.sum(), rejected.sum(),
                        kl.detach().double() * real.double().sum()])


def metrics(sums: torch.Tensor, count: torch.Tensor | float) -> dict[str, torch.Tensor]:
    """METRICS from SUMS summed over every rank and micro-step: each class's mean over its own samples (NaN where
    the step has none, which the interval's mean leaves out, as TRL logs nothing then), the margin between them,
    and KL."""
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=sums.device)
    chosen, rejected = sums[4], sums[5]
    per_class = [torch.where(n > 0, total / n.clamp(min=1), nan)
                 for total, n in ((sums[0], chosen), (sums[1], rejected), (sums[2], chosen), (sums[3], rejected))]
    count = torch.as_tensor(count, dtype=torch.float64, device=sums.device)
    values = [per_class[0], per_class[1], per_class[0] - per_class[1], per_class[2], per_class[3],
              sums[6] / count.clamp(min=1)]
    return dict(zip(METRICS, values))
