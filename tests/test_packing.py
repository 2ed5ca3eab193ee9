"""Packing puts several samples in one row with restarting positions and no attention across samples:
every token's loss must equal the loss of running its sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtune.data.collate import IGNORE, collate
from meshtune.data.sampler import pack_rows
from meshtune.data.tokenized import load_or_build
from meshtune.model.loading import load_model
from meshtune.model.model_dir import load_tokenizer


@pytest.fixture(scope="module")
def model_and_data(tiny_model_dir, tiny_dataset, tmp_path_factory):
    tokenizer = load_tokenizer(tiny_model_dir)
    data = load_or_build([tiny_dataset], tokenizer, fmt=None, template=None, cutoff_len=64, skip_invalid=False,
                         cache_dir=tmp_path_factory.mktemp("tok"), show_progress=False)
    model = load_model(tiny_model_dir).eval()
    return model, data, tokenizer.pad_token_id


def token_losses(model, batch) -> list[torch.Tensor]:
    """Per-row vectors of the losses at target positions, in order."""
    with torch.no_grad():
        logits = model(**batch.model_inputs(), use_cache=False).logits
    losses = F.cross_entropy(logits.transpose(1, 2), batch.targets, ignore_index=IGNORE, reduction="none")
    return [row[targets != IGNORE] for row, targets in zip(losses, batch.targets)]


@pytest.mark.parametrize("rows", [[[0, 1, 2]], [[3, 4], [5]], [[6], [7, 8, 9, 10]]])
def test_packed_rows_give_the_per_token_losses_of_single_samples(model_and_data, rows):
    model, data, pad_id = model_and_data
    alone = {i: token_losses(model, collate([[i]], data, pad_id, packed=False))[0] for row in rows for i in row}
    packed = token_losses(model, collate(rows, data, pad_id, packed=True))
    for row, got in zip(rows, packed):
        want = torch.cat([alone[i] for i in row])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_padded_batch_gives_the_losses_of_single_samples(model_and_data):
    model, data, pad_id = model_and_data
    padded = token_losses(model, collate([[0], [1], [2]], data, pad_id, packed=False))
    for i, got in enumerate(padded):
        torch.testing.assert_close(got, token_losses(model, collate([[i]], data, pad_id, packed=False))[0],
                                   rtol=1e-4, atol=1e-5)


def test_targets_never_cross_sample_boundaries(model_and_data):
    _, data, pad_id = model_and_data
    batch = collate([[0, 1]], data, pad_id, packed=True)
    first_len = len(data[0][0])
    assert batch.targets[0, first_len - 1] == IGNORE  # the last token of sample 0 does not predict sample 1
    assert batch.position_ids[0, first_len] == 0


def test_pack_rows_fills_in_order_up_to_capacity():
    lengths = np.array([5, 4, 3, 6, 2])
    assert pack_rows([0, 1, 2, 3, 4], lengths, capacity=9) == [[0, 1], [2, 3], [4]]
    assert pack_rows([3, 0], lengths, capacity=6) == [[3], [0]]
