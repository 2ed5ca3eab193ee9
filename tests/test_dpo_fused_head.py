"""stage: dpo with fused_loss: the model's head returns each row's summed target log-prob in row chunks (its logits
computed again in backward), and the pair loss, its rewards and every gradient are those of the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from meshtune.data.collate import IGNORE, Batch
from meshtune.distributed import DistEnv
from meshtune.model import loss_head
from meshtune.model.loss_head import install_loss_head, linear_row_logps
from meshtune.train.objectives.pair_loss import PairLoss
from meshtune.train.objectives.preference import PreferenceSettings


def plain_row_logps(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    token = -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                             reduction="none").view(targets.shape)
    return token.sum(dim=1)


def test_the_heads_row_log_probs_and_their_gradients_are_the_full_logits(monkeypatch):
    monkeypatch.setattr(loss_head, "ROWS_ELEMENTS", 1)  # the smallest chunks (64 rows): 3 of them here
    g = torch.Generator().manual_seed(0)
    rows, length, hidden_size, vocab = 3, 50, 16, 40
    hidden = torch.randn(rows, length, hidden_size, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, length), generator=g)
    targets[:, :7] = IGNORE  # a prompt
    targets[2, 30:] = IGNORE  # padding
    upstream = torch.randn(rows, generator=g)

    flat = targets.reshape(-1)
    positions = (flat != IGNORE).nonzero().squeeze(1)
    fused = linear_row_logps(hidden, weight, positions, flat[positions], positions // length, rows)
    grads = torch.autograd.grad((fused * upstream).sum(), (hidden, weight))
    plain = plain_row_logps(hidden, weight, targets)
    expected = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the reference's way: no gradient, the same values
        torch.testing.assert_close(linear_row_logps(hidden, weight, positions, flat[positions],
                                                    positions // length, rows), plain, rtol=1e-6, atol=1e-5)


def pair_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    rows, length = 4, 24  # 2 pairs: chosen rows first
    input_ids = torch.randint(0, vocab, (rows, length), generator=g)
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, :9] = IGNORE
    targets[:, -1] = IGNORE
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[3, 18:] = 0  # a shorter rejected response, padded
    targets[3, 17:] = IGNORE
    return Batch(input_ids=input_ids, targets=targets, position_ids=torch.arange(length).expand(rows, length),
                 attention_mask=attention_mask, num_tokens=int(attention_mask.sum()))


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_the_pair_loss_and_every_gradient_are_those_of_the_full_logits(loss):
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    reference = Qwen2ForCausalLM(config)  # another set of weights: the ratios are not zero
    batch = pair_batch(config.vocab_size)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    settings = PreferenceSettings(loss=loss, beta=0.2)

    class Frozen:  # a reference whose head is not fused: its log-probs from full logits in both runs
        vocab = None  # its logits cover the whole vocabulary

        def logits(self, inputs):
            with torch.no_grad():
                return reference(**inputs, use_cache=False).logits

        def row_logps(self, inputs, targets, ignore_index):
            return None

    results = []
    for fused in (False, True):
        if fused:
            assert install_loss_head(model)
        model.zero_grad()
        objective = PairLoss(model, env, pad_id=0, settings=settings,
                             reference=Frozen() if settings.needs_reference else None, fused=fused)
        total = objective.loss_sum(batch)
        total.backward()
        results.append((total.detach(), objective.metric_sums(batch),
                        {name: p.grad.clone() for name, p in model.named_parameters()}))
    (plain_loss, plain_metrics, plain_grads), (fused_loss, fused_metrics, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=1e-6)
    # rewards are differences of log-probs near -70: their fp32 sums in another order differ in the last bits
    torch.testing.assert_close(fused_metrics, plain_metrics, rtol=1e-6, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
