"""Tokenized cache: truncation and drop counts, round trip, reuse, crash safety, one builder among processes."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest

from meshtune import logs
from meshtune.data import tokenized
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.formats import DatasetSpec, file_spec
from meshtune.data.pipeline import describe
from meshtune.data.registry import resolve
from meshtune.data.templates import FORMATS
from meshtune.data.tokenized import TokenizedDataset, build_tokenized, cache_key, load_or_build
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.errors import DataError

# LLaMA-Factory data files: our own small fixtures always, the real files too where ../shared/compat exists.
FIXTURE_COMPAT = Path(__file__).resolve().parent / "fixtures" / "compat" / "llamafactory" / "data"
SHARED_COMPAT = Path(__file__).resolve().parents[2] / "shared" / "compat" / "llamafactory" / "data"
NEEDS_SHARED = pytest.mark.skipif(
    not SHARED_COMPAT.is_dir(), reason=f"compat data folder {SHARED_COMPAT} is absent (not in a user's clone)"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Sure, here is a short answer to your question.",
    "The weather today is sunny with a light breeze.",
] * 8
RECORDS = [
    {"instruction": "What is the capital of France?", "input": "", "output": "Paris."},
    {"instruction": "Describe the weather.", "input": "today", "output": "Sunny with a light breeze."},
    {"instruction": "Say something.", "output": "The quick brown fox jumps over the lazy dog."},
]


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(SENTENCES)


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS))
    return path


def build(tokenizer, paths, cache_dir, **overrides):
    kwargs = dict(fmt=None, template=None, cutoff_len=64, skip_invalid=False, show_progress=False)
    kwargs.update(overrides)
    return load_or_build(paths, tokenizer, cache_dir=cache_dir, **kwargs)


def conversation(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_truncation_and_dropped_samples(tokenizer):
    """cutoff_len as LLaMA-Factory cuts: a long prompt is shortened and its response still trained whole; a sample
    is dropped only when its response gets no token of what is left."""
    template = ChatTemplate(tokenizer)
    short = conversation("Hi.", "Paris.")
    long_answer = conversation("Hi.", "The quick brown fox jumps over the lazy dog. " * 4)
    long_prompt = conversation("The weather today is sunny. " * 20, "Paris.")
    no_room = conversation("The weather today is sunny. " * 200, "The quick brown fox jumps over the lazy dog. " * 2)
    cutoff = len(template.encode(short)[0]) + 3
    (prompt, response), = template.encode_turns(no_room).turns
    assert 2 * response >= cutoff and 2 * prompt >= cutoff and cutoff * response < prompt + response  # gets 0
    dataset = build_tokenized([short, long_answer, long_prompt, no_room], template, cutoff, show_progress=False,
                              sources=[f"d.json: record {n}" for n in range(1, 5)],
                              skipped=["d.json: record 5: missing 'output'"])
    assert dataset.stats == {
        "n_records": 4,
        "n_samples": 3,
        "n_dropped_no_target": 1,
        "n_truncated": 2,  # the long answer and the long prompt; the dropped sample is not counted twice
        "n_tokens": int(dataset.lengths.sum()),
        "n_target_tokens": int((dataset.labels != IGNORE_INDEX).sum()),
        "n_skipped_invalid": 1,
        "dropped_examples": ["d.json: record 4"],
        "skipped_examples": ["d.json: record 5: missing 'output'"],
    }
    report = describe("train data", dataset.stats)
    assert report[1:] == [
        "warning: train data: skipped 1 malformed records (skip_invalid: true): d.json: record 5: missing 'output'",
        "warning: train data: dropped 1 samples with no assistant token left after truncation to cutoff_len: "
        "d.json: record 4",
        "train data: 2 samples truncated to cutoff_len"]
    assert dataset.lengths.tolist() == [cutoff - 3, cutoff, cutoff]
    ids, labels = dataset[0]
    assert (ids.tolist(), labels.tolist()) == tuple(template.encode(short))
    ids, labels = dataset[2]  # the long prompt: its first tokens, then the whole response, trained
    full_ids, _ = template.encode(long_prompt)
    (prompt, response), = template.encode_turns(long_prompt).turns
    assert ids.tolist() == full_ids[:cutoff - response] + full_ids[prompt:]
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "Paris.<|im_end|>\n"


CUTOFF_FIXTURE = json.loads((FIXTURE_COMPAT.parent / "cutoff_len.json").read_text())


@pytest.mark.parametrize("case", CUTOFF_FIXTURE["turn_lengths"])
def test_a_turn_is_cut_as_llamafactory_cuts_it(case):
    """LLaMA-Factory's infer_seqlen, by the expected counts of its own tests and ours (fixtures/compat)."""
    from meshtune.data.truncation import turn_lengths

    assert list(turn_lengths(case["prompt"], case["response"], case["room"])) == case["kept"]


@pytest.mark.parametrize("case", CUTOFF_FIXTURE["conversations"])
def test_a_conversation_keeps_the_tokens_llamafactory_keeps(case):
    """Turn by turn as LLaMA-Factory's supervised processor (mask_history: the last turn first), each turn keeping
    the first tokens of its prompt and of its response, the eos after the last turn always."""
    from meshtune.data.truncation import kept_positions

    turns = [tuple(turn) for turn in case["turns"]]
    kept = kept_positions(turns, case["suffix"], case["cutoff_len"], case["mask_history"]).tolist()
    expected, start = [], 0
    for (prompt, response), (kept_prompt, kept_response) in zip(turns, case["kept"]):
        expected += [*range(start, start + kept_prompt), *range(start + prompt, start + prompt + kept_response)]
        start += prompt + response
    expected += list(range(start, start + case["suffix_kept"]))
    assert kept == expected and len(kept) <= case["cutoff_len"]


def test_turns_are_each_assistant_reply_and_the_prompt_before_it(tokenizer):
    """What cutoff_len cuts by: a turn's prompt is the system, user and tool turns since the last reply and the
    assistant header; its response the reply with its end-of-turn."""
    template = ChatTemplate(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, *conversation("Hi.", "Paris."),
                *conversation("Bye.", "Lyon.")]
    encoded = template.encode_turns(messages)
    assert sum(p + r for p, r in encoded.turns) + encoded.suffix == len(encoded.input_ids)
    texts, start = [], 0
    for prompt, response in encoded.turns:
        texts += [tokenizer.decode(encoded.input_ids[start:start + prompt]),
                  tokenizer.decode(encoded.input_ids[start + prompt:start + prompt + response])]
        start += prompt + response
    assert texts == ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n"
                     "<|im_start|>assistant\n", "Paris.<|im_end|>\n",
                     "<|im_start|>user\nBye.<|im_end|>\n<|im_start|>assistant\n", "Lyon.<|im_end|>\n"]


def test_each_sample_keeps_its_record_and_length_before_cutoff(tokenizer, tmp_path):
    """What `meshtune preview` names and measures samples by: the record each came from (a dropped one is no
    sample) and its tokens before cutoff_len; a cache written without them (a benchmark's) still loads."""
    template = ChatTemplate(tokenizer)
    short = conversation("Hi.", "Paris.")
    no_room = conversation("The weather today is sunny. " * 200, "The quick brown fox jumps over the lazy dog. " * 2)
    long_answer = conversation("Hi.", "The quick brown fox jumps over the lazy dog. " * 4)
    cutoff = len(template.encode(short)[0]) + 3
    dataset = build_tokenized([no_room, short, long_answer], template, cutoff, show_progress=False)
    full = [len(template.encode(c)[0]) for c in (short, long_answer)]
    assert dataset.record_index.tolist() == [1, 2] and dataset.full_lengths.tolist() == full
    assert full[1] > cutoff == dataset.lengths[1]
    dataset.save(tmp_path / "cache")
    loaded = TokenizedDataset.load(tmp_path / "cache")
    assert loaded.record_index.tolist() == [1, 2] and loaded.full_lengths.tolist() == full
    TokenizedDataset(dataset.input_ids, dataset.labels, dataset.offsets, dataset.stats).save(tmp_path / "bare")
    bare = TokenizedDataset.load(tmp_path / "bare")
    assert bare.record_index is None and bare.full_lengths is None and len(bare) == 2


def test_nothing_left_raises(tokenizer):
    with pytest.raises(DataError, match="raise cutoff_len"):
        build_tokenized([conversation("Hi.", "Paris.")], ChatTemplate(tokenizer), 2, show_progress=False)


def test_save_load_round_trip(tokenizer, tmp_path):
    template = ChatTemplate(tokenizer)
    dataset = build_tokenized([conversation("Hi.", "Paris.")] * 3, template, 64, show_progress=False)
    dataset.save(tmp_path / "ds")
    loaded = TokenizedDataset.load(tmp_path / "ds")
    assert isinstance(loaded.input_ids, np.memmap)
    assert (loaded.input_ids.dtype, loaded.labels.dtype, loaded.offsets.dtype) == (np.int32, np.int32, np.int64)
    assert len(loaded) == 3 and loaded.stats == dataset.stats
    for i in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(loaded[i], dataset[i]))


def test_cache_is_reused(tokenizer, data_file, tmp_path, monkeypatch):
    first = build(tokenizer, [data_file], tmp_path / "cache")
    assert first.stats["n_samples"] == 3

    def no_build(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(tokenized, "build_tokenized", no_build)
    again = build(tokenizer, [data_file], tmp_path / "cache")
    assert np.array_equal(again.input_ids, first.input_ids)


def test_cache_key_inputs(tokenizer, data_file):
    spec = file_spec(data_file)
    base = ([spec], tokenizer, None, 64, False)
    key = cache_key(*base)
    assert key == cache_key(*base) == cache_key(*base, max_samples=None)
    assert key != cache_key([spec], tokenizer, "chatml", 64, False)
    assert key != cache_key([spec], tokenizer, None, 65, False)
    assert key != cache_key([file_spec(data_file, "alpaca")], tokenizer, None, 64, False)
    assert key != cache_key([spec], tokenizer, None, 64, True)
    assert key != cache_key([spec], tokenizer, None, 64, False, max_samples=2)
    assert key != cache_key([spec, spec], tokenizer, None, 64, False)
    assert key != cache_key([spec], train_tokenizer(SENTENCES[:8], vocab_size=300), None, 64, False)
    masked = {cache_key(*base, train_on_prompt=True), cache_key(*base, mask_history=True),
              cache_key(*base, train_on_prompt=True, mask_history=True)}
    assert len(masked) == 3 and key not in masked
    prompts = {cache_key(*base, default_system="Be brief."), cache_key(*base, default_system="Be kind.")}
    assert len(prompts) == 2 and key not in prompts
    lf_alpaca = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
                 "tools": None}
    registered = DatasetSpec("d", [data_file], "alpaca", lf_alpaca, None, data_file.parent / "dataset_info.json")
    other_columns = DatasetSpec("d", [data_file], "alpaca", {**lf_alpaca, "query": None}, None, registered.registry)
    assert len({key, cache_key([registered], *base[1:]), cache_key([other_columns], *base[1:])}) == 3
    data_file.write_text(json.dumps(RECORDS[:2]))
    assert key != cache_key(*base)


def test_failed_build_leaves_nothing_and_leftovers_are_removed(tokenizer, data_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    key = cache_key([file_spec(data_file)], tokenizer, None, 64, False)
    cache.mkdir()
    (cache / f"{key}.tmp-999999").mkdir()  # as left by a builder killed mid-write
    (cache / f"{key}.tmp-999999" / "input_ids.npy").write_bytes(b"half")

    def crash(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(tokenized, "build_tokenized", crash)
    with pytest.raises(RuntimeError):
        build(tokenizer, [data_file], cache)
    assert sorted(p.name for p in cache.iterdir()) == [f"{key}.lock"]
    monkeypatch.undo()
    assert len(build(tokenizer, [data_file], cache)) == 3


def _worker(tokenizer_dir: str, data_file: str, cache_dir: str, marker_dir: str, barrier) -> None:
    """Runs in a spawned process; leaves marker files saying whether it built, waited and finished."""
    from transformers import AutoTokenizer

    markers, pid = Path(marker_dir), multiprocessing.current_process().pid
    original = tokenized.build_tokenized

    class NoteWait(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting for another process"):
                (markers / f"waiting-{pid}").touch()

    def build_once_other_waits(*args, **kwargs):
        (markers / f"built-{pid}").touch()
        deadline = time.monotonic() + 30  # hold the lock until the other process is blocked on it
        while not any(markers.glob("waiting-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return original(*args, **kwargs)

    logs.configure()  # the console, as the command line sets it up in each process
    tokenized.logger.addHandler(NoteWait())
    tokenized.build_tokenized = build_once_other_waits
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    barrier.wait(timeout=60)
    dataset = build(tok, [Path(data_file)], Path(cache_dir), show_progress=True)
    (markers / f"done-{pid}").write_text(str(len(dataset)))


@pytest.mark.slow
def test_two_processes_build_once(tokenizer, data_file, tmp_path, capfd):
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    markers = tmp_path / "markers"
    markers.mkdir()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    args = (str(tmp_path / "tok"), str(data_file), str(tmp_path / "cache"), str(markers), barrier)
    procs = [ctx.Process(target=_worker, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(list(markers.glob("built-*"))) == 1
    assert len(list(markers.glob("waiting-*"))) == 1
    assert [m.read_text() for m in markers.glob("done-*")] == ["3", "3"]
    assert "waiting for another process to tokenize" in capfd.readouterr().out


class RecordingTemplate:
    """Stands in for ChatTemplate: remembers the tools each conversation came with; refuses any that has tools
    when `refuse_tools`, as a chat template without a tool format does."""

    mask_history = False

    def __init__(self, tokenizer, refuse_tools: bool = False) -> None:
        self.inner, self.refuse_tools, self.tools = ChatTemplate(tokenizer), refuse_tools, []

    def encode_turns(self, messages, tools=None):
        self.tools.append(tools)
        if self.refuse_tools and tools:
            raise DataError("this chat template has no tool format")
        return self.inner.encode_turns([{"role": m["role"], "content": m["content"] or "call"} for m in messages])


def test_each_conversation_is_encoded_with_its_tools(tokenizer):
    tools = [[{"name": "search"}], None]
    template = RecordingTemplate(tokenizer)
    build_tokenized([conversation("Hi.", "Paris.")] * 2, template, 64, show_progress=False, tools=tools)
    assert template.tools == tools


def test_a_template_error_names_the_record(tokenizer):
    with pytest.raises(DataError, match=r"^g\.json: record 2: this chat template has no tool format$"):
        build_tokenized([conversation("Hi.", "Paris.")] * 2, RecordingTemplate(tokenizer, refuse_tools=True), 64,
                        show_progress=False, sources=["g.json: record 1", "g.json: record 2"],
                        tools=[None, [{"name": "search"}]])


def test_max_samples_and_registry_specs_through_the_cache(tokenizer, tmp_path):
    specs = resolve(["identity", "alpaca_en_demo"], FIXTURE_COMPAT)
    assert build(tokenizer, specs, tmp_path / "cache", max_samples=2).stats["n_records"] == 4
    assert build(tokenizer, specs, tmp_path / "cache").stats["n_records"] == 9
    assert len(list((tmp_path / "cache").glob("*.lock"))) == 2  # two keys, two caches


# Our fixtures are small enough that every record gives one whole sample; the real files only have to give
# one sample or one dropped record each.
FIXTURE_STATS = {"n_samples": 8, "n_dropped_no_target": 0, "n_truncated": 0, "n_skipped_invalid": 0}


@pytest.mark.parametrize(
    "data_dir, n_records, exact_stats",
    [
        pytest.param(FIXTURE_COMPAT, 8, FIXTURE_STATS, id="fixtures"),
        pytest.param(SHARED_COMPAT, 391, {}, id="shared", marks=NEEDS_SHARED),
    ],
)
@pytest.mark.parametrize("by_name", [True, False], ids=["by-name", "by-path"])
def test_llamafactory_compat_files_tokenize(tokenizer, tmp_path, data_dir, n_records, exact_stats, by_name):
    """By dataset_info.json name and by path alike, tool calls and tool schemas rendered into the samples."""
    names = ["identity", "glaive_toolcall_en_demo"]
    datasets = resolve(names, data_dir) if by_name else [data_dir / f"{name}.json" for name in names]
    dataset = build(tokenizer, datasets, tmp_path / "cache", cutoff_len=4096)
    assert dataset.stats["n_records"] == n_records
    assert dataset.stats["n_samples"] + dataset.stats["n_dropped_no_target"] == n_records
    assert dataset.stats["n_target_tokens"] > 0
    assert {k: dataset.stats[k] for k in exact_stats} == exact_stats
    if data_dir == FIXTURE_COMPAT:  # the first glaive sample shows the tool offered and trains the call
        ids, labels = dataset[4]
        text, trained = tokenizer.decode(ids), tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
        assert "get_forecast" in text and "Get the weather forecast for a city" in text
        assert "get_forecast" in trained and "Lisbon" in trained


def test_labels_options_build_their_own_datasets(tokenizer, data_file, tmp_path):
    plain = build(tokenizer, [data_file], tmp_path / "cache")
    prompts = build(tokenizer, [data_file], tmp_path / "cache", train_on_prompt=True)
    assert np.array_equal(prompts.input_ids, plain.input_ids) and np.array_equal(prompts.labels, prompts.input_ids)
    assert (plain.labels == IGNORE_INDEX).any()
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 2


def test_mask_history_cuts_the_last_turn_first(tokenizer):
    """As LLaMA-Factory: the trained last turn takes cutoff_len's tokens first, the earlier turns what is left."""
    long = [*conversation("Hi.", "Paris."), *conversation("What is the capital of France? " * 8, "Lyon.")]
    template = ChatTemplate(tokenizer, mask_history=True)
    encoded = template.encode_turns(long)
    (first_prompt, first_response), (last_prompt, last_response) = encoded.turns
    cutoff = last_prompt + last_response + 2  # the first turn no longer fits whole: 2 of its prompt's tokens
    assert 2 * first_response >= 2 and 2 * first_prompt >= 2 and 2 * first_response < first_prompt + first_response
    kept = build_tokenized([long], template, cutoff, show_progress=False)
    assert kept.stats["n_truncated"] == 1
    ids, labels = kept[0]
    first = first_prompt + first_response
    assert list(ids) == encoded.input_ids[:2] + encoded.input_ids[first:]
    assert list(labels) == encoded.labels[:2] + encoded.labels[first:]
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "Lyon.<|im_end|>\n"
    in_order = build_tokenized([long], ChatTemplate(tokenizer), cutoff, show_progress=False)[0][0].tolist()
    assert in_order[:first] == encoded.input_ids[:first]  # without mask_history the first turn is kept whole


@pytest.mark.parametrize("key", ["train_on_prompt", "mask_history"])
def test_label_keys_of_the_config_reach_the_data(tokenizer, tmp_path, key, caplog):
    from meshtune.config import TrainConfig
    from meshtune.data.pipeline import prepare_datasets

    path = tmp_path / "two_rounds.json"
    path.write_text(json.dumps([{"messages": [*conversation("Hi.", "Paris."), *conversation("Bye.", "Lyon.")]}]))
    caplog.set_level(logging.INFO, logger="meshtune")
    cfg = TrainConfig(model_name_or_path="m", dataset=[str(path)], output_dir=str(tmp_path / "out"), **{key: True})
    train, _ = prepare_datasets(cfg, tokenizer, False)
    lines = caplog.messages
    ids, labels = train[0]
    trained = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    assert trained == (tokenizer.decode(ids) if key == "train_on_prompt" else "Lyon.<|im_end|>\n")
    assert "trained on prompts too" in lines[0] if key == "train_on_prompt" else "only the last" in lines[0]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_formats_turns_are_its_trained_replies(name):
    """The turns cutoff_len cuts by are the tokens the labels train: each response is exactly a trained run (the
    formats without an end-of-turn marker: the reply, its eos the label of the next prompt's first token and of
    the suffix)."""
    tok = train_tokenizer(SENTENCES)
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    template = ChatTemplate(tok, name)
    messages = [{"role": "system", "content": "Be brief."}, *conversation("Hi.", "Paris."),
                *conversation("Bye.", "Lyon.")]
    encoded = template.encode_turns(messages)
    assert sum(p + r for p, r in encoded.turns) + encoded.suffix == len(encoded.input_ids)
    assert len(encoded.turns) == 2 and encoded.suffix == int(FORMATS[name].efficient_eos)
    trained = np.asarray(encoded.labels) != IGNORE_INDEX
    start, responses = 0, np.zeros(len(trained), dtype=bool)
    for prompt, response in encoded.turns:
        responses[start + prompt:start + prompt + response] = True
        start += prompt + response
    if FORMATS[name].efficient_eos:  # the eos labels: the second prompt's first token and the suffix
        responses[encoded.turns[0][0] + encoded.turns[0][1]] = True
        responses[-1] = True
    assert trained.tolist() == responses.tolist()
