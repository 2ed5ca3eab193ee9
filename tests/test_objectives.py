"""The objective seam: what an objective reports besides its loss reaches metrics.jsonl as a ratio of sums over the
step (numerators and normaliser reduced across ranks and micro-steps), the way the loss does."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import base_config
from meshtune.config import build_config
from meshtune.train.objectives import normalised
from meshtune.train.objectives.token_loss import TokenLoss


@dataclass(frozen=True)
class ReportingTokenLoss(TokenLoss):
    """The token loss reporting two values of its own: its targets over the step's (1 exactly) and the loss again."""

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("targets/share", "loss/again")

    def loss_sum(self, batch):
        loss = super().loss_sum(batch)
        object.__setattr__(self, "last", torch.stack([torch.tensor(float(batch.num_targets), dtype=torch.float64),
                                                      loss.detach().double()]))
        return loss

    def metric_sums(self, batch) -> torch.Tensor:
        return self.last


def test_an_objectives_own_metrics_are_ratios_of_the_steps_sums(tmp_path, tiny_model_dir, tiny_dataset, monkeypatch):
    from meshtune.train import loop
    from meshtune.train.objectives import by_stage

    monkeypatch.setattr(by_stage, "TokenLoss", ReportingTokenLoss)
    records = loop.run(build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=3,
                                                logging_steps=1, gradient_accumulation_steps=2))).records
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    for record in steps:
        assert record["targets/share"] == pytest.approx(1.0, abs=1e-12)
        assert record["loss/again"] == record["loss"]


def test_normalised_divides_by_the_count_and_leaves_an_empty_batch_at_zero():
    assert normalised(torch.tensor(6.0), 3).item() == 2.0
    assert normalised(torch.tensor(0.0), 0).item() == 0.0
    assert normalised(torch.tensor([6.0, 3.0]), torch.tensor(3.0, dtype=torch.float64)).tolist() == [2.0, 1.0]
