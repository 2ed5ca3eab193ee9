"""stage: dpo with padding_free: a micro-batch's pairs end to end in one row (each sequence attending only to itself
through the varlen attention), each sequence's log-prob summed over its own span: the pair loss, its rewards and
every gradient are those of the padded rows, with the plain logits and with the fused head."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from meshtune.data.collate import IGNORE, sequence_sums
from meshtune.distributed import DistEnv
from meshtune.model.attention import use_varlen
from meshtune.model.loss_head import install_loss_head, sequence_of_positions
from meshtune.train.objectives.pair_loss import PairLoss, collate_pairs
from meshtune.train.objectives.preference import PreferenceSettings

VOCAB = 96


def pair(g: np.random.Generator, prompt: int, chosen: int, rejected: int):
    """(chosen, rejected), each (ids, labels) as data/pairs.py gives them: one prompt, labels on the responses."""
    start = g.integers(1, VOCAB, prompt)
    out = []
    for length in (chosen, rejected):
        ids = np.concatenate([start, g.integers(1, VOCAB, length)])
        labels = ids.copy()
        labels[:prompt] = IGNORE
        out.append((ids, labels))
    return tuple(out)


class PairData:
    """Three pairs of unequal lengths."""

    def __init__(self):
        g = np.random.default_rng(0)
        self.pairs = [pair(g, 5, 7, 3), pair(g, 9, 2, 6), pair(g, 3, 4, 11)]

    def __getitem__(self, i: int):
        return self.pairs[i]


def test_a_padding_free_pair_batch_holds_every_sequence_once_chosen_first():
    data = PairData()
    padded = collate_pairs([[0], [1, 2]], data, pad_id=0)
    flat = collate_pairs([[0], [1, 2]], data, pad_id=0, padding_free=True)
    assert padded.num_sequences == flat.num_sequences == 6 and flat.input_ids.shape[0] == 1
    lengths = [len(data[i][0][0]) for i in range(3)] + [len(data[i][1][0]) for i in range(3)]
    assert flat.sample_lengths == tuple(lengths) and flat.num_tokens == padded.num_tokens == sum(lengths)
    for k, (start, end) in enumerate(zip(flat.cu_seqlens[:-1].tolist(), flat.cu_seqlens[1:].tolist())):
        assert torch.equal(flat.input_ids[0, start:end], padded.input_ids[k, :lengths[k]])
        assert torch.equal(flat.targets[0, start:end], padded.targets[k, :lengths[k]])
    counts = sequence_sums((flat.targets != IGNORE).long(), flat.cu_seqlens)
    assert counts.tolist() == (padded.targets != IGNORE).sum(dim=1).tolist()
    positions = (flat.targets.reshape(-1) != IGNORE).nonzero().squeeze(1)
    owners = sequence_of_positions(positions, flat.targets.size(1), flat.cu_seqlens)
    assert torch.bincount(owners, minlength=6).tolist() == counts.tolist()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_padding_free_pairs_give_the_padded_loss_rewards_and_gradients(fused, loss):
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    padded_model = Qwen2ForCausalLM(config)
    padded_model.set_attn_implementation("sdpa")
    flat_model = copy.deepcopy(padded_model)
    use_varlen(flat_model)
    reference = Qwen2ForCausalLM(config)  # other weights: the log-ratios are not zero
    reference.set_attn_implementation("sdpa")
    flat_reference = copy.deepcopy(reference)
    use_varlen(flat_reference)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    settings = PreferenceSettings(loss=loss, beta=0.2)
    data = PairData()

    class Frozen:
        vocab = None  # the whole vocabulary (no tensor parallel)

        def __init__(self, model):
            self.model = model

        def logits(self, inputs):
            with torch.no_grad():
                return self.model(**inputs, use_cache=False).logits

        def row_logps(self, inputs, targets, ignore_index):
            return None

    results = []
    for model, ref, padding_free in ((padded_model, reference, False), (flat_model, flat_reference, True)):
        if fused:
            assert install_loss_head(model)
        objective = PairLoss(model, env, pad_id=0, settings=settings, fused=fused, padding_free=padding_free,
                             reference=Frozen(ref) if settings.needs_reference else None)
        batch = objective.collate([[0], [1, 2]], data, packed=False)
        assert (batch.cu_seqlens is not None) == padding_free and objective.count(batch) == 3
        total = objective.loss_sum(batch)
        total.backward()
        results.append((total.detach(), objective.metric_sums(batch),
                        {name: p.grad.clone() for name, p in model.named_parameters()}))
    (padded_loss, padded_metrics, padded_grads), (flat_loss, flat_metrics, flat_grads) = results
    torch.testing.assert_close(flat_loss, padded_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat_metrics, padded_metrics, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
