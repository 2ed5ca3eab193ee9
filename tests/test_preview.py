"""`meshtune preview`: the samples it shows are the tokenized cache's rows, its trained marks the loss's targets, its
statistics those of the cache, its cut counts those of the tokenizer's rules; --json and the text agree; colour
only on a terminal; the errors train gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import base_config, run_cli_here, write_config
from meshtune.compat.job_config import load_config
from meshtune.data import tokenized
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.collate import collate
from meshtune.data.formats import read_dataset
from meshtune.data.pipeline import prepare_datasets
from meshtune.data.tokenized import TokenizedDataset
from meshtune.errors import MeshtuneError
from meshtune.model.model_dir import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def call(name: str, **arguments) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_records() -> list[dict]:
    """OpenAI messages: a system prompt, several turns, tool calls (one and two at once) and their results."""
    return [
        {"messages": [
            {"role": "system", "content": "the old house answers"},
            {"role": "user", "content": "rain in the valley"},
            {"role": "assistant", "content": None, "tool_calls": [call("get_weather", city="valley")]},
            {"role": "tool", "tool_call_id": "call_get_weather", "content": "seven small birds"},
            {"role": "assistant", "content": "the sun and wind"},
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "jumps over a lazy dog"},
        ], "tools": [WEATHER]},
        {"messages": [
            {"role": "system", "content": "sing about rain"},
            {"role": "user", "content": "the green valley"},
            {"role": "assistant", "content": "near our old house"},
            {"role": "user", "content": "seven birds"},
            {"role": "assistant", "content": "sing while the wind"},
            {"role": "user", "content": "a lazy dog"},
            {"role": "assistant", "content": "the quick fox"},
        ]},
        {"messages": [
            {"role": "user", "content": "wind and rain"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="house"),
                                                                 call("get_weather", city="valley")]},
            {"role": "tool", "content": "sun"},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "sun at the house, rain in the valley"},
        ], "tools": [WEATHER]},
        *({"messages": [{"role": "user", "content": f"the dog {n}"}, {"role": "assistant", "content": f"a fox {n}"}]}
          for n in range(5)),
    ]


def sharegpt_records() -> list[dict]:
    """LLaMA-Factory sharegpt with a system prompt, a function call and its observation."""
    return [
        {"conversations": [
            {"from": "human", "value": "rain over the old house"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "house"}})},
            {"from": "observation", "value": "wind"},
            {"from": "gpt", "value": "the wind sings"},
            {"from": "human", "value": "and the birds"},
            {"from": "gpt", "value": "seven small birds"},
        ], "system": "a lazy dog answers", "tools": json.dumps([WEATHER["function"]])},
        {"conversations": [{"from": "human", "value": "the fox"}, {"from": "gpt", "value": "jumps"}]},
    ]


@pytest.fixture
def chat_config(tmp_path, tiny_model_dir) -> Path:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(sharegpt_records()))
    values = base_config(tiny_model_dir, chat, tmp_path / "out", cutoff_len=4096, val_size=2)
    values["dataset"] = [str(chat), str(tools)]
    return write_config(tmp_path, **values)


def preview_out(capfd, *args: str) -> str:
    """What `meshtune preview ARGS` prints on stdout (run in this process)."""
    from meshtune.cli import main

    capfd.readouterr()
    code = main(["preview", *args])
    captured = capfd.readouterr()
    assert code == 0, captured.out + captured.err
    return captured.out


def preview_json(capfd, *args: str) -> dict:
    return json.loads(preview_out(capfd, *args, "--json"))


def preview_text(capfd, *args: str) -> str:
    return preview_out(capfd, *args)


def the_cache(config: Path) -> TokenizedDataset:
    """The one tokenized dataset in the run's cache folder, read as training reads it."""
    cfg = load_config(config)
    built = list((Path(cfg.output_dir) / "tokenized").glob("*/meta.json"))
    assert len(built) == 1, built
    return TokenizedDataset.load(built[0].parent)


def trained_runs(ids: np.ndarray, labels: np.ndarray) -> list[list[int]]:
    """The runs of tokens the loss has as targets, straight from the arrays: label not -100 and not a sample's
    first token."""
    runs, current = [], []
    for i, (token, label) in enumerate(zip(ids.tolist(), labels.tolist())):
        if i > 0 and label != IGNORE_INDEX:
            assert label == token  # ChatML: every target is the token at its place
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def sample_blocks(text: str) -> dict[int, str]:
    """Each sample's text, by position, from the text output."""
    parts = re.split(r"^--- sample (\d+) of [\d,]+ .*---$\n", text.removesuffix("\n"), flags=re.M)
    return {int(parts[i]): parts[i + 1].removesuffix("\n\n") for i in range(1, len(parts), 2)}


def test_trained_marks_are_the_caches_labels(chat_config, tiny_model_dir, capfd):
    """Every sample, shown and marked as the cache labels it: the JSON's ids, labels and trained flags against the
    cache's arrays and training's own batch, the text's ⟦ ⟧ spans against the trained runs, decoded."""
    positions = ",".join(str(i) for i in range(10))
    report = preview_json(capfd, str(chat_config), "--index", positions)
    cache = the_cache(chat_config)
    tokenizer = load_tokenizer(tiny_model_dir)
    assert len(report["samples"]) == len(cache) == 10
    read = read_dataset(load_config(chat_config).dataset)
    for sample in report["samples"]:
        ids, labels = (np.asarray(a) for a in cache[sample["position"]])
        assert sample["input_ids"] == ids.tolist() and sample["labels"] == labels.tolist()
        batch = collate([[sample["position"]]], cache, tokenizer.pad_token_id, packed=False)  # what a step trains on
        targets = batch.targets[0, :len(ids)].numpy()
        assert sample["trained"] == [0] + (targets[:-1] != IGNORE_INDEX).astype(int).tolist()
        assert sample["trained"] == [0] + (labels[1:] != IGNORE_INDEX).astype(int).tolist()
        assert sample["trained_tokens"] == int((targets != IGNORE_INDEX).sum()) > 0
        assert "".join(s["text"] for s in sample["segments"]) == tokenizer.decode(ids, skip_special_tokens=False)
        shown = [s["text"] for s in sample["segments"] if s["kind"] == "trained"]
        assert shown == [tokenizer.decode(run, skip_special_tokens=False) for run in trained_runs(ids, labels)]
        assert sample["source"] == read.sources[sample["position"]]  # nothing dropped: positions are records

    text = preview_text(capfd, str(chat_config), "--index", positions)
    blocks = sample_blocks(text)
    assert sorted(blocks) == list(range(10))
    for position, block in blocks.items():
        ids, labels = (np.asarray(a) for a in cache[position])
        assert re.findall(r"⟦(.*?)⟧", block, flags=re.S) == [
            tokenizer.decode(run, skip_special_tokens=False) for run in trained_runs(ids, labels)]
        assert block.replace("⟦", "").replace("⟧", "") == tokenizer.decode(ids, skip_special_tokens=False)
    # what is trained, in words: the calls and answers; never the system prompt, the tools or the tool results
    first = re.findall(r"⟦(.*?)⟧", blocks[0], flags=re.S)
    assert any('Action: get_weather\nAction Input: {"city": "valley"}' in span for span in first)  # chatml's tools
    assert any(span.startswith("the sun and wind<|im_end|>") for span in first)
    for untrained in ("the old house answers", "seven small birds", "Weather of a city", "<|im_start|>assistant"):
        assert untrained in blocks[0] and all(untrained not in span for span in first)
    two_calls = "".join(re.findall(r"⟦(.*?)⟧", blocks[2], flags=re.S))
    assert two_calls.count("get_weather") == 2 and "<|im_start|>tool" not in two_calls
    sharegpt = re.findall(r"⟦(.*?)⟧", blocks[8], flags=re.S)
    assert any('{"city": "house"}' in span for span in sharegpt) and "wind<|im_end|>" not in "".join(sharegpt)
    assert "(" + read.sources[8] + ")" in text


def test_training_reads_the_cache_preview_built(chat_config, tiny_model_dir, capfd, monkeypatch):
    report = preview_json(capfd, str(chat_config), "-n", "0")
    assert report["cache"]["built"] and report["samples"] == []

    def no_build(*args, **kwargs):
        raise AssertionError("training tokenized again")

    monkeypatch.setattr(tokenized, "build_tokenized", no_build)
    train, evaluation = prepare_datasets(load_config(chat_config), load_tokenizer(tiny_model_dir), False,
                                         report=False)
    assert len(train.dataset) == the_cache(chat_config).offsets.size - 1 == report["datasets"]["train"]["samples"]
    assert report["datasets"]["train"]["held_out"]["count"] == len(evaluation) == 2
    assert not preview_json(capfd, str(chat_config), "-n", "0")["cache"]["built"]


def test_statistics_are_the_caches(chat_config, tiny_model_dir, capfd):
    report = preview_json(capfd, str(chat_config), "-n", "0")
    cache = the_cache(chat_config)
    train = report["datasets"]["train"]
    lengths = np.diff(cache.offsets)
    starts = cache.offsets[:-1]
    trained = np.array([int((cache.labels[s + 1:e] != IGNORE_INDEX).sum()) for s, e in zip(starts, cache.offsets[1:])])
    assert train["samples"] == train["records"] == 10 and train["tokens"] == int(lengths.sum())
    assert train["trained_tokens"] == int(trained.sum())
    for key, values in (("tokens_per_sample", lengths), ("trained_per_sample", trained)):
        assert train[key] == {"min": int(values.min()), "median": float(np.median(values)),
                              "p95": float(np.percentile(values, 95)), "max": int(values.max())}
    template = ChatTemplate(load_tokenizer(tiny_model_dir))  # nothing is cut: lengths before cutoff_len are the same
    read = read_dataset(load_config(chat_config).dataset)
    full = [len(template.encode(c, tools=t)[0]) for c, t in zip(read.conversations, read.tools)]
    assert full == lengths.tolist() and train["tokens_before_cutoff"] == train["tokens_per_sample"]
    files = [f for entry in train["entries"] for f in entry["files"]]
    assert [(Path(f["path"]).name, f["format"], f["records"]) for f in files] == [
        ("chat.jsonl", "messages", 8), ("tools.json", "sharegpt", 2)]


def test_a_small_cutoff_len_truncates_and_drops(chat_config, tiny_model_dir, capfd):
    """Counted as the tokenizer's rules decide: longer than cutoff_len is truncated turn by turn as LLaMA-Factory
    cuts (data/truncation.py), unless no trained token is left in what is kept, which drops the sample; the report
    names a dropped record."""
    from meshtune.data.truncation import kept_positions

    read = read_dataset(load_config(chat_config).dataset)
    template = ChatTemplate(load_tokenizer(tiny_model_dir))
    turns = [template.encode_turns(c, tools=t) for c, t in zip(read.conversations, read.tools)]
    encoded = [(e.input_ids, e.labels) for e in turns]
    cutoff = 8  # a prompt long against its answer leaves it no token of the 8 (its share rounds down to 0)

    def kept_labels(n: int) -> list[int]:
        return [turns[n].labels[i] for i in kept_positions(turns[n].turns, turns[n].suffix, cutoff, False)]

    dropped = [n for n, (ids, _) in enumerate(encoded) if len(ids) > cutoff and
               all(label == IGNORE_INDEX for label in kept_labels(n))]
    truncated = [n for n, (ids, _) in enumerate(encoded) if len(ids) > cutoff and n not in dropped]
    assert (dropped, truncated) == ([0, 8], [1, 2, 3, 4, 5, 6, 7, 9])  # 0, 8: the tool schemas in a system prompt

    report = preview_json(capfd, str(chat_config), f"cutoff_len={cutoff}", "val_size=0", "--index", "0")
    train = report["datasets"]["train"]
    assert train["truncated"]["count"] == len(truncated) and train["dropped"]["count"] == len(dropped)
    assert train["dropped"]["examples"] == [read.sources[n] for n in dropped][:3]
    assert train["samples"] == len(encoded) - len(dropped) and train["tokens_per_sample"]["max"] == cutoff
    kept = [n for n in range(len(encoded)) if n not in dropped]
    assert train["tokens_before_cutoff"]["max"] == max(len(encoded[n][0]) for n in kept)
    assert report["samples"][0]["source"] == read.sources[kept[0]]  # positions skip the dropped records
    assert report["samples"][0]["tokens_before_cutoff"] == len(encoded[kept[0]][0])

    text = preview_text(capfd, str(chat_config), f"cutoff_len={cutoff}", "val_size=0", "-n", "0")
    assert (f"truncated: {len(truncated)} samples longer than cutoff_len {cutoff} tokens after the chat template "
            f"(cut as LLaMA-Factory cuts them: turns in order") in text
    assert f"dropped: {len(dropped)} samples with no trained token left in the {cutoff} tokens kept" in text
    assert read.sources[dropped[0]] in text


def test_json_and_text_say_the_same(chat_config, capfd):
    args = [str(chat_config), "--seed", "3", "-n", "4"]
    report, text = preview_json(capfd, *args), preview_text(capfd, *args)
    again = preview_json(capfd, *args)
    assert (report["cache"]["built"], again["cache"]["built"]) == (True, False)
    assert again["samples"] == report["samples"]  # a seed draws the same samples every time
    positions = [s["position"] for s in report["samples"]]
    assert len(positions) == 4 and positions == sorted(positions) and positions != [0, 1, 2, 3]
    assert sorted(sample_blocks(text)) == positions
    train = report["datasets"]["train"]
    for key, label in (("tokens_per_sample", "tokens per sample"), ("trained_per_sample", "trained per sample"),
                       ("tokens_before_cutoff", "before cutoff_len")):
        d = train[key]
        numbers = re.search(rf"{label}: +min ([\d.,]+), median ([\d.,]+), p95 ([\d.,]+), max ([\d.,]+)", text)
        assert [float(n.replace(",", "")) for n in numbers.groups()] == pytest.approx(
            [d["min"], d["median"], d["p95"], d["max"]], abs=0.05)
    assert (f"{train['records']:,} records -> {train['samples']:,} samples, {train['tokens']:,} tokens, "
            f"{train['trained_tokens']:,} trained") in text
    for sample in report["samples"]:
        assert (f"--- sample {sample['position']} of {train['samples']} ({sample['source']}): {sample['tokens']} "
                f"tokens, {sample['trained_tokens']} trained") in text
    assert report["template"]["description"] in text and "held out: 2 samples" in text


def run_on_a_terminal(args: list[str], monkeypatch) -> str:
    """`meshtune ARGS` in this process with stdout a pseudo-terminal, as in an interactive shell."""
    from meshtune.cli import main

    leader, follower = os.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal was closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    terminal = open(follower, "w", encoding="utf-8", closefd=True)
    monkeypatch.setattr(sys, "stdout", terminal)
    try:
        assert terminal.isatty() and main(args) == 0
    finally:
        terminal.close()
        monkeypatch.undo()
    reader.join(timeout=30)
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_terminal_is_coloured_a_pipe_is_not(chat_config, capfd, monkeypatch):
    args = ["preview", str(chat_config), "--index", "0"]
    preview_out(capfd, str(chat_config), "-n", "0")  # the cache built first, so both runs read it
    piped = run_cli_here(args, capfd).stdout
    assert "\x1b[" not in piped and "⟦" in piped
    capfd.readouterr()
    coloured = run_on_a_terminal(args, monkeypatch)
    assert "\x1b[32m⟦" in coloured
    assert re.sub(r"\x1b\[\d+m", "", coloured).strip() == piped.strip()  # colour adds nothing else
    assert "\x1b[" not in run_cli_here([*args, "--color", "never"], capfd).stdout
    assert "\x1b[32m" in run_cli_here([*args, "--color", "always"], capfd).stdout


def test_errors_are_trains(chat_config, tmp_path, capfd):
    """A bad key and a missing data file or model stop preview with the words train uses."""
    def error(args: list[str]) -> str:
        result = run_cli_here(args, capfd)
        assert result.returncode == 1, result.stdout
        return result.stdout.strip().splitlines()[-1]

    bad_key = error(["preview", str(chat_config), "learning_rat=1e-4"])
    assert "learning_rat" in bad_key and bad_key == error(["train", str(chat_config), "learning_rat=1e-4"])

    missing = tmp_path / "missing.jsonl"
    cfg = load_config(chat_config, [f"dataset={missing}"])
    with pytest.raises(MeshtuneError) as raised:  # what training's data step says
        prepare_datasets(cfg, load_tokenizer(cfg.model_name_or_path), False, report=False)
    assert error(["preview", str(chat_config), f"dataset={missing}"]) == f"meshtune: error: {raised.value}"
    assert str(missing) in str(raised.value)

    no_model = error(["preview", str(chat_config), f"model_name_or_path={tmp_path / 'nowhere'}"])
    assert "is not a local directory" in no_model and "meshtune never downloads" in no_model
    out_of_range = error(["preview", str(chat_config), "--index", "3,99"])
    assert "--index 99" in out_of_range and "numbered 0 to 9" in out_of_range
    assert "give one of them" in error(["preview", str(chat_config), "--index", "1", "--seed", "2"])


def test_help_says_what_the_marks_and_numbers_are(capfd):
    text = run_cli_here(["preview", "--help"], capfd).stdout
    for words in ("⟦text⟧", "⟦→x⟧", "label -100", "first token", "min / median / p95 / max", "before cutoff_len",
                  "truncates", "drops", "--json", "position in the tokenized training data", "--color"):
        assert words in text, words
    assert "preview" in run_cli_here(["--help"], capfd).stdout


def test_what_the_loss_trains_where_labels_are_not_the_tokens(chat_config, tmp_path, capfd):
    """train_on_prompt labels a sample's first token, which is no target; glm4 (no end-of-turn text) trains eos at
    the first token of the next turn, shown as ⟦→eos⟧ before it."""
    report = preview_json(capfd, str(chat_config), "train_on_prompt=true", "--index", "1")
    sample = report["samples"][0]
    assert sample["labels"][0] != IGNORE_INDEX and sample["trained"] == [0] + [1] * (sample["tokens"] - 1)

    plain = tmp_path / "turns.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in chat_records()[1:2]))
    args = [str(chat_config), f"dataset={plain}", "template=glm4", "val_size=0", "--index", "0"]
    sample = preview_json(capfd, *args)["samples"][0]
    swapped = [i for i, (token, label) in enumerate(zip(sample["input_ids"], sample["labels"]))
               if label not in (IGNORE_INDEX, token)]
    assert len(swapped) == 2  # after the first two answers; the last one's eos is appended as a token
    assert [s["kind"] for s in sample["segments"]].count("target") == 2
    block = sample_blocks(preview_text(capfd, *args))[0]
    assert block.count("⟦→<|im_end|>⟧") == 2 and "⟦→<|im_end|>⟧<|user|>" in block
    assert block.endswith("<|im_end|>⟧")


@pytest.fixture(scope="module")
def qwen25_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with Qwen2.5-Instruct's chat template (ChatML, a default system prompt of its own)."""
    directory = tmp_path_factory.mktemp("qwen25")
    shutil.copytree(tiny_model_dir, directory, dirs_exist_ok=True)
    tokenizer = load_tokenizer(directory)
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "templates" / "qwen2.5_instruct.jinja").read_text()
    tokenizer.save_pretrained(directory)
    return directory


def first_sample(report: dict) -> tuple[str, list[str]]:
    """The first sample's text and its trained spans."""
    segments = report["samples"][0]["segments"]
    return "".join(s["text"] for s in segments), [s["text"] for s in segments if s["kind"] == "trained"]


QWEN_DATA = Path(__file__).parent / "fixtures" / "compat" / "qwen" / "train.json"
FIRST_TURN = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, text, trained", [
    ("qwen3_nothink", FIRST_TURN + "Paris is the capital of France.<|im_end|>\n",
     ["Paris is the capital of France.<|im_end|>\n"]),
    ("qwen3", FIRST_TURN + "<think>\n\n</think>\n\nParis is the capital of France.<|im_end|>\n",
     ["<think>\n\n</think>\n\nParis is the capital of France.<|im_end|>\n"]),
])
def test_preview_of_a_named_template_on_a_chatml_tokenizer_is_llamafactorys(qwen25_model_dir, tmp_path, capfd,
                                                                           template, text, trained):
    """No tokenizer's default system prompt; qwen3's empty think block is trained (LLaMA-Factory's ReasoningTemplate
    with enable_thinking, its default). The first token is never a target, so the trained text is the reply's."""
    config = write_config(tmp_path, **base_config(qwen25_model_dir, QWEN_DATA, tmp_path / "out", template=template,
                                                  cutoff_len=256))
    report = preview_json(capfd, str(config), "-n", "1")
    assert report["template"]["description"] == f"{template} (written out)"
    assert first_sample(report) == (text, trained)


def test_preview_of_qwen_flags_shows_finetune_pys_system_prompt(qwen25_model_dir, tmp_path, capfd, monkeypatch):
    """finetune.py's preprocess: ChatML after the system prompt "You are a helpful assistant.", whatever the
    tokenizer's own template says."""
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    report = preview_json(capfd, "--model_name_or_path", str(qwen25_model_dir), "--data_path", str(QWEN_DATA),
                          "--use_lora", "True", "--model_max_length", "256", "--output_dir", str(tmp_path / "out"))
    assert report["template"]["description"] == "chatml (written out), default system prompt 'You are a helpful " \
                                                "assistant.'"
    assert first_sample(report) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + FIRST_TURN
                                    + "Paris is the capital of France.<|im_end|>\n",
                                    ["Paris is the capital of France.<|im_end|>\n"])


def test_a_named_template_that_is_not_the_tokenizers_says_what_final_saves(qwen25_model_dir, tmp_path, caplog):
    """LLaMA-Factory keeps the tokenizer's own template in the saved model under qwen3_nothink; meshtune saves the
    one it trained with, and says so in one line."""
    cfg = load_config(write_config(tmp_path, **base_config(qwen25_model_dir, QWEN_DATA, tmp_path / "out",
                                                           template="qwen3_nothink", cutoff_len=256)))
    with caplog.at_level("INFO", logger="meshtune.data.pipeline"):
        prepare_datasets(cfg, load_tokenizer(qwen25_model_dir), show_progress=False)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("template: qwen3_nothink:")]
    assert notes == ["template: qwen3_nothink: LLaMA-Factory saves the model with the tokenizer's own chat template, "
                     "which renders other text than this one; meshtune saves the template it trained with in final/, "
                     "so apply_chat_template renders prompts as trained"]
    caplog.clear()
    with caplog.at_level("INFO", logger="meshtune.data.pipeline"):
        prepare_datasets(load_config(write_config(tmp_path, **base_config(
            qwen25_model_dir, QWEN_DATA, tmp_path / "out", template="qwen", cutoff_len=256))),
            load_tokenizer(qwen25_model_dir), show_progress=False)
    assert not [r for r in caplog.records if r.getMessage().startswith("template: ")]  # its own: the same text
