"""The preference losses against TRL's own code, on CPU in fp32: DPOTrainer's loss for sigmoid, hinge and ipo (the
loss, the rewards it logs and the gradients of a real model's weights), CPOTrainer's for simpo and smoothed sigmoid,
ORPOTrainer's odds ratio for orpo. trl is a test-only dependency."""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshtune.data.collate import IGNORE
from meshtune.train.objectives import normalised
from meshtune.train.objectives.preference import (METRICS, PreferenceSettings, metric_sums, metrics, pair_losses,
                                                  sequence_logps)

trl = pytest.importorskip("trl")

PAIRS, LENGTH, PROMPT = 3, 14, 5
CPU = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                      unwrap_model=lambda m: m)


def pair_batch(vocab: int):
    """2 x PAIRS rows, chosen first, as TRL's collator lays them out: a prompt, then the response (completion_mask),
    a rejected response and a chosen one padded short."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2 * PAIRS, LENGTH), generator=generator)
    attention, completion = torch.ones_like(ids), torch.zeros_like(ids)
    completion[:, PROMPT:] = 1
    for row, end in ((1, 10), (PAIRS + 2, 12)):
        attention[row, end:], completion[row, end:] = 0, 0
    ref = torch.tensor([-41.0, -30.5, -38.0, -40.0, -31.0, -37.5])
    return ids, attention, completion, ref


def trl_dpo(model, loss_type: str, beta: float, ids, attention, completion, ref):
    """TRL DPOTrainer's loss and logged metrics for this batch, with precomputed reference log-probs."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = SimpleNamespace(model=model, accelerator=CPU, aux_loss_enabled=False, ld_alpha=None,
                              precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                              loss_weights=[1.0], beta=beta, use_weighting=False, label_smoothing=0.0,
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, {name: values[-1] for name, values in trainer._metrics["eval"].items()}


def meshtune_dpo(model, settings: PreferenceSettings, ids, attention, completion, ref):
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE)  # collate's shift
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    logps, tokens = sequence_logps(logits, targets)
    pairs = pair_losses(settings, logps[:PAIRS], logps[PAIRS:], tokens[:PAIRS], tokens[PAIRS:], ref[:PAIRS],
                        ref[PAIRS:])
    loss = normalised(pairs.losses.sum(), PAIRS)
    return loss, metrics(metric_sums(pairs, logps[:PAIRS], logps[PAIRS:]), PAIRS)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_losses_rewards_and_gradients_are_trls(tiny_model_dir, loss_type):
    from meshtune.model.loading import load_model

    model = load_model(tiny_model_dir, torch.float32).eval()
    theirs = copy.deepcopy(model)
    batch = pair_batch(model.config.vocab_size)
    beta = 0.1 if loss_type != "hinge" else 0.02  # hinge: a margin inside the hinge, so a gradient flows
    want, logged = trl_dpo(theirs, loss_type, beta, *batch)
    got, reported = meshtune_dpo(model, PreferenceSettings(loss_type, beta), *batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in METRICS:
        assert reported[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    want.backward()
    got.backward()
    assert want.item() > 0
    for (name, mine), other in zip(model.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-5, atol=1e-6, msg=name)


def reference_free_inputs():
    generator = torch.Generator().manual_seed(1)
    chosen = (-torch.rand(5, generator=generator) * 40 - 1).requires_grad_()
    rejected = (-torch.rand(5, generator=generator) * 40 - 1).requires_grad_()
    tokens = torch.tensor([12, 30, 7, 19, 25]), torch.tensor([9, 33, 14, 19, 40])
    return chosen, rejected, tokens


@pytest.mark.parametrize("loss_type, smoothing", [("simpo", 0.0), ("simpo", 0.1), ("sigmoid", 0.2)])
def test_simpo_and_smoothed_sigmoid_are_trls_cpo(loss_type, smoothing):
    """CPOTrainer's loss on the responses' mean log-probs (simpo) or summed ones against a zero reference (sigmoid:
    conservative DPO's smoothing)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen, rejected, (chosen_tokens, rejected_tokens) = reference_free_inputs()
    settings = PreferenceSettings(loss_type, beta=2.0 if loss_type == "simpo" else 0.1, label_smoothing=smoothing)
    zero = torch.zeros(5)
    mine = pair_losses(settings, chosen, rejected, chosen_tokens, rejected_tokens,
                       *((zero, zero) if loss_type == "sigmoid" else ()))
    cpo = SimpleNamespace(alpha=0.0, loss_type=loss_type, beta=settings.beta, simpo_gamma=settings.simpo_gamma,
                          label_smoothing=smoothing, accelerator=CPU)
    scale = (chosen_tokens, rejected_tokens) if loss_type == "simpo" else (1, 1)
    theirs, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, chosen / scale[0], rejected / scale[1])
    torch.testing.assert_close(mine.losses, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(mine.rejected_rewards, rejected_rewards)
    grads = torch.autograd.grad(mine.losses.sum(), (chosen, rejected))
    torch.testing.assert_close(grads, torch.autograd.grad(theirs.sum(), (chosen, rejected)))


def test_orpo_is_trls_odds_ratio_plus_the_chosen_mean_nll():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    chosen, rejected, (chosen_tokens, rejected_tokens) = reference_free_inputs()
    chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
    mine = pair_losses(PreferenceSettings("orpo", beta=0.1), chosen, rejected, chosen_tokens, rejected_tokens)
    ratio, chosen_rewards, _, _, _ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.1, accelerator=CPU),
                                                                  chosen_mean, rejected_mean)
    theirs = -chosen_mean - ratio
    torch.testing.assert_close(mine.losses, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.chosen_rewards, chosen_rewards)
    grads = torch.autograd.grad(mine.losses.sum(), (chosen, rejected))
    torch.testing.assert_close(grads, torch.autograd.grad(theirs.sum(), (chosen, rejected)))


def test_ftx_adds_the_chosen_mean_nll_and_the_metrics_are_sums_over_pairs():
    chosen, rejected, (chosen_tokens, rejected_tokens) = reference_free_inputs()
    ref = torch.zeros(5), torch.full((5,), -20.0)
    plain = pair_losses(PreferenceSettings(), chosen, rejected, chosen_tokens, rejected_tokens, *ref)
    with_ftx = pair_losses(PreferenceSettings(ftx=0.5), chosen, rejected, chosen_tokens, rejected_tokens, *ref)
    torch.testing.assert_close(with_ftx.losses - plain.losses, -0.5 * chosen / chosen_tokens)
    whole = metric_sums(plain, chosen, rejected)
    halves = [pair_losses(PreferenceSettings(), chosen[s], rejected[s], chosen_tokens[s], rejected_tokens[s],
                          ref[0][s], ref[1][s]) for s in (slice(0, 2), slice(2, 5))]
    split = metric_sums(halves[0], chosen[:2], rejected[:2]) + metric_sums(halves[1], chosen[2:], rejected[2:])
    torch.testing.assert_close(split, whole)  # two ranks' sums are one rank's
    assert metrics(whole, 5)["rewards/accuracies"] == pytest.approx(
        float((plain.chosen_rewards > plain.rejected_rewards).double().mean()))
    with pytest.raises(ValueError, match="pref_loss 'kto': use one of sigmoid, hinge, ipo, orpo, simpo"):
        PreferenceSettings("kto")
    with pytest.raises(ValueError, match="pref_loss sigmoid compares against the reference's log-probs"):
        pair_losses(PreferenceSettings(), chosen, rejected, chosen_tokens, rejected_tokens)
