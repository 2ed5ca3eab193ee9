"""stage: dpo around the loss: preference pairs as people have them (LLaMA-Factory's ranking data, TRL's prompt /
chosen / rejected, messages), rendered as SFT renders the prompt with only the responses trained, cut to cutoff_len
from the prompt's left, each bad record named; the keys; a run with its metrics under TRL's names in training and
evaluation; preview, export and chat on its results. (The loss against TRL: tests/test_dpo_parity.py; layouts and
resume: tests/test_dpo_layouts.py.)"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LLAMAFACTORY_DATA, base_config
from meshtune.cli import main
from meshtune.compat.job_config import load_job_config
from meshtune.config import build_config
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.pairs import Pairs, load_or_build_pairs, pairs_key
from meshtune.data.pipeline import prepare_datasets
from meshtune.data.preview import preview, render_text
from meshtune.data.registry import resolve
from meshtune.data.sampler import GlobalBatchPlan
from meshtune.data.split import split_validation
from meshtune.data.tokenized import cache_key
from meshtune.errors import ConfigError, DataError, ModelError
from meshtune.model.model_dir import load_tokenizer

PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pairs_of(path_or_name, folder: Path, tokenizer, cutoff_len: int = 256, skip_invalid: bool = False) -> Pairs:
    return load_or_build_pairs(resolve([str(path_or_name)], folder), tokenizer, template=None, cutoff_len=cutoff_len,
                               skip_invalid=skip_invalid, cache_dir=folder / "cache", show_progress=False)


def sft_encoding(tokenizer, prompt: list[dict], reply: str):
    encoded = ChatTemplate(tokenizer, None).encode([*prompt, {"role": "assistant", "content": reply}])
    return [int(t) for t in encoded[0]], [int(t) for t in encoded[1]]


def test_every_pair_format_renders_its_prompt_as_sft_does_and_trains_only_the_responses(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    forms = {
        "trl_text": {"prompt": "the quick brown fox", "chosen": "jumps over", "rejected": "sleeps"},
        "trl_messages": {"prompt": messages, "chosen": [{"role": "assistant", "content": "jumps over"}],
                         "rejected": [{"role": "assistant", "content": "sleeps"}]},
        "trl_implicit": {"chosen": [*messages, {"role": "assistant", "content": "jumps over"}],
                         "rejected": [*messages, {"role": "assistant", "content": "sleeps"}]},
        "messages": {"messages": messages, "chosen": {"role": "assistant", "content": "jumps over"},
                     "rejected": "sleeps"},
        "sharegpt": {"conversations": [{"from": "human", "value": "the quick brown fox"}], "system": "be brief",
                     "chosen": {"from": "gpt", "value": "jumps over"}, "rejected": {"from": "gpt", "value": "sleeps"}},
        "alpaca": {"instruction": "the quick", "input": "brown fox", "chosen": "jumps over", "rejected": "sleeps"},
    }
    for name, record in forms.items():
        data = pairs_of(write_jsonl(tmp_path / f"{name}.jsonl", [record]), tmp_path, tokenizer)
        assert len(data) == 1 and data.stats["n_pairs"] == 1, name
        prompt = ([{"role": "user", "content": "the quick\nbrown fox"}] if name == "alpaca" else
                  [{"role": "user", "content": "the quick brown fox"}] if name == "trl_text" else messages)
        if name == "sharegpt":  # a file's sharegpt records take their system column as LLaMA-Factory does
            prompt = messages
        for (ids, labels), reply in zip(data[0], ("jumps over", "sleeps")):
            want_ids, want_labels = sft_encoding(tokenizer, prompt, reply)
            assert [int(t) for t in ids] == want_ids, name
            assert [int(t) for t in labels] == want_labels, name  # the response and its end-of-turn only
            trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
            assert trained == list(range(trained[0], len(labels))), name
        assert data.lengths[0] == len(data[0][0][0]) + len(data[0][1][0])


def test_llamafactorys_ranking_entries_read_as_pairs_and_other_stages_refuse_them(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    data = pairs_of("dpo_en_demo", LLAMAFACTORY_DATA, tokenizer, cutoff_len=4096)
    assert len(data) == 12 and data.stats["n_dropped_too_long"] == 0
    info = tmp_path / "dataset_info.json"
    write_jsonl(tmp_path / "rank.jsonl", [{"question": "the quick fox", "good": "jumps", "bad": "naps"}])
    info.write_text(json.dumps({"ranked": {"file_name": "rank.jsonl", "ranking": True,
                                           "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"}},
                                "plain": {"file_name": "rank.jsonl", "columns": {"prompt": "question",
                                                                                 "response": "good"}}}))
    alpaca = load_or_build_pairs(resolve(["ranked"], tmp_path), tokenizer, template=None, cutoff_len=256,
                                 skip_invalid=False, cache_dir=tmp_path / "c", show_progress=False)
    assert [int(t) for t in alpaca[0][0][0]] == sft_encoding(tokenizer, [{"role": "user", "content": "the quick fox"}],
                                                             "jumps")[0]
    base = base_config(tiny_model_dir, "ranked", tmp_path / "out", dataset_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="has ranking: true: preference pairs .* which stage: dpo trains; stage: sft"):
        prepare_datasets(build_config(base), tokenizer, show_progress=False)
    with pytest.raises(ConfigError, match="'plain' .* has no ranking: true, so it holds conversations"):
        prepare_datasets(build_config({**base, "dataset": "plain", "stage": "dpo"}), tokenizer, show_progress=False)


@pytest.mark.parametrize("record, problem", [
    ({"prompt": "the fox", "chosen": "jumps"}, "no 'rejected' field: a preference pair needs a chosen and a rejected"),
    ({"prompt": "the fox", "chosen": "jumps", "rejected": "  "}, r"the rejected response \('rejected'\) is empty"),
    ({"prompt": "the fox", "chosen": "jumps", "rejected": "jumps"}, "the chosen and rejected responses are identical"),
    ({"prompt": "", "chosen": "jumps", "rejected": "naps"}, "the prompt has no user turn with text"),
])
def test_each_bad_pair_is_named_by_file_and_record_or_skipped(tmp_path, tiny_model_dir, record, problem):
    tokenizer = load_tokenizer(tiny_model_dir)
    good = {"prompt": "the lazy dog", "chosen": "sleeps", "rejected": "runs"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, record, good])
    with pytest.raises(DataError, match=rf"pairs\.jsonl: record 2 \(line 2\): {problem}.*skip_invalid: true"):
        pairs_of(path, tmp_path, tokenizer)
    skipped = pairs_of(path, tmp_path, tokenizer, skip_invalid=True)
    assert len(skipped) == 2 and skipped.stats["n_skipped_invalid"] == 1


def test_a_long_pair_keeps_its_responses_and_loses_its_prompts_start_and_one_that_cannot_fit_is_dropped(
        tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    long_prompt = "the quick brown fox jumps over a lazy dog " * 6
    records = [{"prompt": long_prompt, "chosen": "seven small birds", "rejected": "rain"},
               {"prompt": "short", "chosen": "sun and wind " * 30, "rejected": "rain"},
               {"prompt": "short", "chosen": "sun", "rejected": "rain"}]
    full = pairs_of(write_jsonl(tmp_path / "long.jsonl", records), tmp_path / "a", tokenizer, cutoff_len=4096)
    cutoff = len(full[0][0][0]) - 10
    cut = pairs_of(tmp_path / "long.jsonl", tmp_path / "b", tokenizer, cutoff_len=cutoff)
    assert cut.stats["n_truncated"] == 1 and cut.stats["n_dropped_too_long"] == 1 and len(cut) == 2
    assert "long.jsonl: record 2" in cut.stats["dropped_examples"][0]
    for side in (0, 1):
        ids, labels = (np.asarray(a) for a in cut[0][side])
        whole_ids, whole_labels = (np.asarray(a) for a in full[0][side])
        assert len(ids) <= cutoff
        response = int((whole_labels != IGNORE_INDEX).sum())
        assert (labels != IGNORE_INDEX).sum() == response  # the response whole
        assert (ids == whole_ids[len(whole_ids) - len(ids):]).all()  # the end kept: the prompt cut from the left
    assert len(cut[0][0][0]) == cutoff  # the longer sequence fills cutoff_len
    assert list(cut[1][0][0]) == list(full[2][0][0])


def test_pairs_stay_whole_in_the_held_out_split_and_across_ranks_and_never_share_sfts_cache(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    data = pairs_of("dpo_en_demo", LLAMAFACTORY_DATA, tokenizer, cutoff_len=4096)
    train, held = split_validation(data, 3, seed=1)
    assert len(train) + len(held) == len(data) and not set(train.indices) & set(held.indices)
    assert all(held[i] is not None and len(held[i]) == 2 for i in range(len(held)))  # a unit is a pair
    assert (held.lengths == data.lengths[held.indices]).all()
    plan = GlobalBatchPlan(train.lengths, 0, 2, 1, 2)
    dealt = [i for rank in (0, 1) for micro in plan.micro_batches(0, 0, rank) for row in micro for i in row]
    assert sorted(dealt) == sorted(set(dealt)) and len(dealt) == 4  # 2 ranks x 2 pairs, each pair once
    specs = resolve(["dpo_en_demo"], LLAMAFACTORY_DATA)
    template = ChatTemplate(tokenizer, None, mask_history=True)
    assert pairs_key(specs, tokenizer, template, 4096, False, None) != cache_key(specs, tokenizer, None, 4096, False)


def test_the_keys_their_trl_names_and_what_makes_no_sense_for_the_stage(tmp_path, tiny_model_dir):
    base = base_config(tiny_model_dir, "d.jsonl", tmp_path, stage="dpo")
    cfg = build_config(base)
    assert (cfg.pref_beta, cfg.pref_loss, cfg.pref_ftx, cfg.dpo_label_smoothing, cfg.simpo_gamma) == (
        0.1, "sigmoid", 0.0, 0.0, 0.5)
    assert build_config({**base, "pref_beta": 0.2}).hash() != cfg.hash()  # part of the run's math
    loaded = load_job_config(None, [f"model_name_or_path={tiny_model_dir}", "dataset=d.jsonl", "stage=dpo"],
                             {"beta": 0.3, "loss_type": "ipo", "label_smoothing": 0.0})
    assert (loaded.config.pref_beta, loaded.config.pref_loss) == (0.3, "ipo")
    refusals = [
        ({"stage": "sft", "pref_beta": 0.2}, "pref_beta: preference-training keys, read only by stage: dpo and kto"),
        ({"kto_chosen_weight": 2.0}, "kto_chosen_weight: read only by stage: kto; this run is stage: dpo"),
        ({"pref_loss": "hinge", "dpo_label_smoothing": 0.1}, "smooths the sigmoid .* pref_loss: hinge does not read"),
        ({"pref_loss": "simpo", "ref_model": "/m"}, "pref_loss: simpo compares no reference"),
        ({"ref_model_adapters": "/a"}, "ref_model_adapters is an adapter merged into ref_model"),
        ({"packing": True}, "packing: true with stage: dpo: a micro-batch.s pairs are already end to end in one row"),
        ({"context_parallel": 2}, "context_parallel: 2 with stage: dpo is not supported: .* set context_parallel: 1"),
        ({"mask_history": True}, "mask_history choose which turns of a conversation train; stage: dpo"),
        ({"pref_loss": "kto_pair"}, "pref_loss"),
    ]
    for extra, message in refusals:
        with pytest.raises(ConfigError, match=message):
            build_config({**base, **extra})
    assert build_config({**base, "tensor_parallel": 2}).tensor_parallel == 2  # trained: tests/test_tensor_parallel.py
    with pytest.raises(ConfigError, match="packing.s rows of up to cutoff_len tokens do not apply to pairs"):
        load_job_config(None, [f"model_name_or_path={tiny_model_dir}", "dataset=d.jsonl", "stage=dpo"],
                        {"neat_packing": True})
    with pytest.raises(ConfigError, match="pref_bco_weight: 0.5 .* BCO"):
        load_job_config(None, [f"model_name_or_path={tiny_model_dir}", "dataset=d.jsonl", "stage=dpo"],
                        {"pref_bco_weight": 0.5})


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model_dir):
    """A LoRA dpo run on the repo's copy of LLaMA-Factory's dpo_en_demo, with a held-out split evaluated."""
    from meshtune.train.loop import run

    work = tmp_path_factory.mktemp("dpo_run")
    cfg = build_config(base_config(tiny_model_dir, "dpo_en_demo", work / "out", stage="dpo",
                                   dataset_dir=str(LLAMAFACTORY_DATA), cutoff_len=256, val_size=2, max_steps=2,
                                   eval_strategy="steps", eval_steps=2, learning_rate=5e-2))
    return cfg, run(cfg)


def test_a_run_reports_trls_metrics_in_training_and_evaluation(dpo_run):
    cfg, result = dpo_run
    lines = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
    assert all(name in line for line in lines for name in names)
    assert lines[0]["rewards/margins"] == 0 and lines[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert lines[-1]["rewards/margins"] > 0 and lines[-1]["loss"] < lines[0]["loss"]
    assert all(f"eval_{name}" in lines[-1] for name in names) and "eval_loss" in lines[-1]
    for line in lines:
        assert line["rewards/margins"] == pytest.approx(line["rewards/chosen"] - line["rewards/rejected"], abs=1e-6)
    plan = json.loads((Path(cfg.output_dir) / "run_plan.json").read_text())
    assert plan["fused_loss"] is True and "summed log-prob under the policy" in plan["why"]["fused_loss"]
    assert "adapters turned off" in plan["why"]["reference"]


def test_preview_shows_each_pair_with_both_responses_trained_tokens_marked(dpo_run, tiny_model_dir):
    cfg, _ = dpo_run
    report = preview(cfg, load_tokenizer(tiny_model_dir), samples=2)
    assert report["datasets"]["train"]["pairs"] == 12 and len(report["samples"]) == 2
    for sample in report["samples"]:
        for side in ("chosen", "rejected"):
            kinds = [segment["kind"] for segment in sample[side]["segments"]]
            assert kinds[0] == "context" and "trained" in kinds
    text = render_text(report, color=False)
    assert "--- pair 0 of 12 (" in text and "chosen (" in text and "rejected (" in text and "⟦" in text
    assert "12 pairs -> 24 samples" in text


def test_export_and_chat_take_a_dpo_runs_final(dpo_run, tmp_path, capfd, monkeypatch):
    cfg, result = dpo_run
    assert main(["export", str(cfg.output_dir), "--output", str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "chat_template.jinja").is_file()
    monkeypatch.setattr(sys, "stdin", io.StringIO("the quick brown fox\n"))
    capfd.readouterr()
    assert main(["chat", str(result.final_dir), "--max-new-tokens", "4"]) == 0
    out, _ = capfd.readouterr()
    assert out.strip()


def test_ref_model_adapters_are_merged_into_the_reference_copy(dpo_run, tiny_model_dir, tmp_path):
    """LLaMA-Factory's ref_model + ref_model_adapters: the reference is that model with the adapter folded in."""
    from peft import PeftModel

    from meshtune.distributed import DistEnv
    from meshtune.model.loading import load_model, model_size
    from meshtune.model.reference import FrozenCopy, build_reference
    from meshtune.plan import resolve as resolve_plan

    _, result = dpo_run
    cfg = build_config(base_config(tiny_model_dir, "d.jsonl", tmp_path, stage="dpo", finetuning_type="full",
                                   ref_model=str(tiny_model_dir), ref_model_adapters=str(result.final_dir)))
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    plan = resolve_plan(cfg, env, None, lambda: model_size(tiny_model_dir))
    assert "with the adapter" in plan.why["reference"]
    reference = build_reference(cfg, plan, env, plan.dims(env), policy=torch.nn.Identity())
    assert isinstance(reference, FrozenCopy) and not any(p.requires_grad for p in reference.model.parameters())
    ids = {"input_ids": torch.tensor([[5, 17, 42, 8, 99, 3]])}
    merged = PeftModel.from_pretrained(load_model(tiny_model_dir), result.final_dir).merge_and_unload().eval()
    with torch.no_grad():
        want, base = merged(**ids).logits, load_model(tiny_model_dir)(**ids).logits
    torch.testing.assert_close(reference.logits(ids), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, base, atol=1e-4)  # the adapter trained something
    with pytest.raises(ModelError, match="has no adapter_config.json"):
        build_reference(cfg.model_copy(update={"ref_model_adapters": str(tmp_path)}), plan, env, plan.dims(env),
                        torch.nn.Identity())
