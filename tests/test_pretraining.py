"""stage: pt: raw text in, every token trained, an EOS after each document, long documents split (not dropped), packed
with no attention across documents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LLAMAFACTORY_DATA, base_config
from meshtune.config import build_config
from meshtune.data.collate import IGNORE, collate
from meshtune.data.pipeline import prepare_datasets
from meshtune.data.raw_text import load_or_build_raw_text, pieces
from meshtune.data.registry import resolve
from meshtune.errors import ConfigError, DataError
from meshtune.model.model_dir import load_tokenizer



def write_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def pt_config(tmp_path: Path, model_dir: Path, dataset, **extra):
    values = base_config(model_dir, dataset, tmp_path / "out", stage="pt")
    values.update(extra)
    return build_config(values)


@pytest.mark.parametrize("length, cutoff", [(4, 4), (5, 4), (10, 4), (11, 4), (2, 2), (9, 2)])
def test_pieces_overlap_by_one_token_so_every_token_after_the_first_is_a_target_once(length, cutoff):
    cuts = pieces(length, cutoff)
    assert all(2 <= c.stop - c.start <= cutoff for c in cuts)
    assert cuts[0].start == 0 and cuts[-1].stop == length
    targets = [position for c in cuts for position in range(c.start + 1, c.stop)]
    assert targets == list(range(1, length))


def test_documents_end_with_eos_and_long_ones_are_split_not_dropped(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    texts = ["the quick brown fox", "a lazy dog " * 40, "seven small birds"]
    data = load_or_build_raw_text(resolve([str(write_texts(tmp_path / "t.jsonl", texts))], tmp_path, "text"),
                                  tokenizer, cutoff_len=32, skip_invalid=False, cache_dir=tmp_path / "cache",
                                  show_progress=False)
    assert data.stats["n_documents"] == 3 and data.stats["n_split_documents"] == 1
    assert (np.asarray(data.labels) == np.asarray(data.input_ids)).all()  # every token is trained
    assert data.lengths.max() <= 32 and len(data) > 3
    for n, text in enumerate(texts):
        mine = [i for i in range(len(data)) if data.record_index[i] == n]
        ids = [int(t) for t in data[mine[0]][0]]
        for i in mine[1:]:  # each piece starts on the last token of the one before
            piece = [int(t) for t in data[i][0]]
            assert piece[0] == ids[-1]
            ids += piece[1:]
        assert ids == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        assert data.full_lengths[mine[0]] == len(ids)
    assert data.stats["n_target_tokens"] == int(data.lengths.sum()) - len(data)


def test_llamafactory_prompt_column_a_text_file_and_bad_records_are_named(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    c4 = resolve(["c4_demo"], LLAMAFACTORY_DATA, "text")
    assert c4[0].columns == {"prompt": "text"}
    built = load_or_build_raw_text(c4, tokenizer, cutoff_len=64, skip_invalid=False, cache_dir=tmp_path / "c",
                                   show_progress=False)
    assert built.stats["n_documents"] == 40 and built.stats["n_split_documents"] >= 4
    text_file = tmp_path / "book.txt"
    text_file.write_text("first line of the book\n\nsecond line\n")
    lines = load_or_build_raw_text(resolve([str(text_file)], tmp_path, "text"), tokenizer, cutoff_len=64,
                                   skip_invalid=False, cache_dir=tmp_path / "c", show_progress=False)
    assert lines.stats["n_documents"] == 2  # a document a line; blank lines are no documents
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n{"text": "  "}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: record 2 \(line 2\): no 'text' field"):
        load_or_build_raw_text(resolve([str(bad)], tmp_path, "text"), tokenizer, cutoff_len=64, skip_invalid=False,
                               cache_dir=tmp_path / "c", show_progress=False)
    skipped = load_or_build_raw_text(resolve([str(bad)], tmp_path, "text"), tokenizer, cutoff_len=64,
                                     skip_invalid=True, cache_dir=tmp_path / "c", show_progress=False)
    assert skipped.stats["n_documents"] == 1 and skipped.stats["n_skipped_invalid"] == 2
    assert "record 3 (line 3): 'text' is empty" in skipped.stats["skipped_examples"][1]


def test_a_packed_row_attends_within_each_document_only(tmp_path, tiny_model_dir):
    """The loss of a packed row of three documents is the sum of their losses alone."""
    from meshtune.model.loading import load_model
    from meshtune.train.objectives.token_loss import token_loss_sum

    cfg = pt_config(tmp_path, tiny_model_dir, write_texts(tmp_path / "t.jsonl", [
        "the quick brown fox jumps", "over a lazy dog while seven", "small birds sing about rain"]))
    assert cfg.packing  # pre-training packs by default
    train, _ = prepare_datasets(cfg, load_tokenizer(tiny_model_dir), show_progress=False, report=False)
    model = load_model(tiny_model_dir, torch.float32)
    with torch.no_grad():
        loss = lambda batch: token_loss_sum(model(**batch.model_inputs(), use_cache=False).logits,  # noqa: E731
                                            batch.targets)
        packed = collate([[0, 1, 2]], train, pad_id=0, packed=True)
        alone = [collate([[i]], train, pad_id=0, packed=False) for i in range(3)]
        assert packed.num_targets == sum(b.num_targets for b in alone) == int(train.lengths.sum()) - 3
        torch.testing.assert_close(loss(packed), sum(loss(b) for b in alone), rtol=1e-5, atol=1e-5)
    assert (packed.targets[0, np.cumsum(train.lengths)[:3] - 1] == IGNORE).all()  # no document predicts the next


def test_pretraining_keys_and_the_stages_meshtune_does_not_train(tmp_path, tiny_model_dir, tiny_dataset):
    assert pt_config(tmp_path, tiny_model_dir, tiny_dataset, packing=False).packing is False
    assert build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path)).packing is False  # sft: as before
    with pytest.raises(ConfigError, match="train_on_prompt choose which turns of a conversation train; stage: pt"):
        pt_config(tmp_path, tiny_model_dir, tiny_dataset, train_on_prompt=True)
    with pytest.raises(ConfigError, match="dataset_format: alpaca reads conversations; stage: pt reads raw text"):
        pt_config(tmp_path, tiny_model_dir, tiny_dataset, dataset_format="alpaca")
    for stage, what in (("rm", r"reward-model training \(rm\)"), ("ppo", "PPO"), ("grpo", "GRPO")):
        with pytest.raises(ConfigError, match=f"{stage}: {what} is another trainer's; meshtune trains supervised "
                                              f"fine-tuning \\(sft\\), continued pre-training on raw text \\(pt\\), "
                                              f"DPO-family preference training on pairs \\(dpo\\) and KTO on "
                                              f"unpaired preference data \\(kto\\)"):
            build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path, stage=stage))


def test_pretraining_trains_every_token_of_the_raw_text(tmp_path, tiny_model_dir):
    from meshtune.train.loop import run

    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(24)]
    cfg = pt_config(tmp_path, tiny_model_dir, write_texts(tmp_path / "t.jsonl", texts), max_steps=4, cutoff_len=48)
    records = run(cfg).records
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


def test_preview_shows_raw_text_rows_with_their_document_boundaries(tmp_path, tiny_model_dir):
    from meshtune.data.preview import BOUNDARY, preview, render_text

    texts = ["the quick brown fox", "a lazy dog " * 12, "seven small birds", "sing about rain"]
    cfg = pt_config(tmp_path, tiny_model_dir, write_texts(tmp_path / "t.jsonl", texts), cutoff_len=64)
    report = preview(cfg, load_tokenizer(tiny_model_dir), samples=2)
    train = report["datasets"]["train"]
    assert train["documents"] == 4 and train["split"]["count"] == 1 and train["trained_tokens"] == (
        train["tokens"] - train["samples"])
    pieces_shown = [piece for row in report["rows"] for piece in row["pieces"]]
    assert len(report["rows"]) == 2 and any(len(row["pieces"]) > 1 for row in report["rows"])
    assert all(row["tokens"] <= 64 for row in report["rows"])
    assert {p["source"].rsplit(": ", 1)[1] for p in pieces_shown} <= {f"record {n} (line {n})" for n in range(1, 5)}
    text = render_text(report, color=False)
    assert "trains every token of the raw text, the EOS ending each document included" in text
    assert "4 records -> 4 documents -> " in text and "split: 1 documents longer than cutoff_len 64" in text
    assert f" {BOUNDARY} [sample " in text and "t.jsonl: record " in text
    long_pieces = [p for p in pieces_shown if p["source"].endswith("record 2 (line 2)")]
    assert all(p["pieces"] == 2 and f"piece {p['piece']} of 2]" in text for p in long_pieces)


@pytest.mark.slow
def test_pretraining_losses_are_the_same_on_one_process_and_on_two(tmp_path, tiny_model_dir):
    """Packed raw-text rows dealt to 2 ranks x 1 micro-step train as 1 rank x 2: every step's loss and the final
    eval loss."""
    from test_topology import assert_close, train_losses

    rng = np.random.default_rng(1)
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(4, 90)))) for _ in range(60)]
    data = write_texts(tmp_path / "pt.jsonl", texts)
    one = train_losses(tmp_path, tiny_model_dir, data, "lora", "ddp", 1, 2, stage="pt", cutoff_len=48)
    two = train_losses(tmp_path, tiny_model_dir, data, "lora", "ddp", 2, 1, stage="pt", cutoff_len=48)
    assert one[4] < one[0]
    assert_close(two, one, "stage pt on 2 processes x 1 micro-step")
