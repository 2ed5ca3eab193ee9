"""Dataset entries by name through LLaMA-Factory's dataset_info.json: files, formatting, columns and tags read as
LLaMA-Factory reads them, tool calls, max_samples, and the entries refused with what to do instead."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from meshtune.config import TrainConfig
from meshtune.checksums import dataset_checksum
from meshtune.data.formats import file_spec, read_dataset
from meshtune.data.pipeline import prepare_datasets
from meshtune.data.registry import resolve
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.errors import DataError

# LLaMA-Factory data folders: our own small fixtures always, the real one too where ../shared/compat exists.
FIXTURE_COMPAT = Path(__file__).resolve().parent / "fixtures" / "compat" / "llamafactory" / "data"
SHARED_COMPAT = Path(__file__).resolve().parents[2] / "shared" / "compat" / "llamafactory" / "data"
NEEDS_SHARED = pytest.mark.skipif(
    not SHARED_COMPAT.is_dir(), reason=f"compat data folder {SHARED_COMPAT} is absent (not in a user's clone)"
)
DATA_DIRS = [pytest.param(FIXTURE_COMPAT, id="fixtures"), pytest.param(SHARED_COMPAT, id="shared", marks=NEEDS_SHARED)]
COUNTS = {
    FIXTURE_COMPAT: {"alpaca_en_demo": 5, "identity": 4, "glaive_toolcall_en_demo": 4},
    SHARED_COMPAT: {"alpaca_en_demo": 999, "identity": 91, "glaive_toolcall_en_demo": 300},
}
FIRST_USER = {
    FIXTURE_COMPAT: {"alpaca_en_demo": "Give two tips for keeping houseplants healthy.", "identity": "hey there"},
    SHARED_COMPAT: {"alpaca_en_demo": "Describe a process of making crepes.", "identity": "hi"},
}
NAMES = ["alpaca_en_demo", "identity", "glaive_toolcall_en_demo"]


def raw(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def registry(tmp_path: Path, entries: dict, files: dict[str, list] | None = None) -> Path:
    """A dataset_dir with its dataset_info.json and data files."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "dataset_info.json").write_text(json.dumps(entries))
    for name, records in (files or {}).items():
        (tmp_path / name).write_text(json.dumps(records))
    return tmp_path


ALPACA = [{"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "You add.", "history": [["1+1?", "2"]]}]


@pytest.mark.parametrize("data_dir", DATA_DIRS)
def test_names_resolve_to_files_formatting_and_columns(data_dir):
    alpaca, identity, glaive = resolve(NAMES, data_dir)
    info = data_dir / "dataset_info.json"
    assert [(s.name, s.files, s.fmt, s.registry) for s in (alpaca, identity, glaive)] == [
        ("alpaca_en_demo", [data_dir / "alpaca_en_demo.json"], "alpaca", info),
        ("identity", [data_dir / "identity.json"], "alpaca", info),
        ("glaive_toolcall_en_demo", [data_dir / "glaive_toolcall_en_demo.json"], "sharegpt", info),
    ]
    assert alpaca.columns == {"prompt": "instruction", "query": "input", "response": "output", "history": None,
                              "system": None, "tools": None}
    assert glaive.columns == {"messages": "conversations", "system": None, "tools": "tools"}
    assert glaive.tags["role_tag"] == "from" and glaive.tags["function_tag"] == "function_call"


@pytest.mark.parametrize("data_dir", DATA_DIRS)
@pytest.mark.parametrize("name", ["alpaca_en_demo", "identity"])
def test_alpaca_entries_read_every_record(data_dir, name):
    read = read_dataset(resolve([name], data_dir))
    assert (len(read.conversations), read.skipped) == (COUNTS[data_dir][name], [])
    assert read.conversations[0][0] == {"role": "user", "content": FIRST_USER[data_dir][name]}
    for record, conversation in zip(raw(data_dir / f"{name}.json"), read.conversations):
        user = "\n".join(part for part in (record["instruction"], record["input"]) if part)
        assert conversation == [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    assert set(read.tools) == {None}
    if name == "identity":  # placeholders stay as written, as LLaMA-Factory leaves them
        assert any("{{name}}" in c[1]["content"] and "{{author}}" in c[1]["content"] for c in read.conversations)


@pytest.mark.parametrize("data_dir", DATA_DIRS)
def test_glaive_tools_function_calls_and_observations(data_dir):
    read = read_dataset(resolve(["glaive_toolcall_en_demo"], data_dir))
    records = raw(data_dir / "glaive_toolcall_en_demo.json")
    assert (len(read.conversations), read.skipped) == (COUNTS[data_dir]["glaive_toolcall_en_demo"], [])
    n_calls = 0
    for record, messages, tools in zip(records, read.conversations, read.tools):
        assert tools == (json.loads(record["tools"]) or None)
        assert len(messages) == len(record["conversations"])
        for turn, message in zip(record["conversations"], messages):
            if turn["from"] == "function_call":
                call = json.loads(turn["value"])
                assert message == {"role": "assistant", "content": "",
                                   "tool_calls": [{"name": call["name"], "arguments": call["arguments"]}]}
                n_calls += 1
            elif turn["from"] == "observation":
                assert message == {"role": "tool", "content": turn["value"]}
            else:
                assert message["role"] == {"human": "user", "gpt": "assistant"}[turn["from"]]
    assert n_calls == sum(t["from"] == "function_call" for r in records for t in r["conversations"]) > 0
    assert any(tools is None for tools in read.tools) and any(tools for tools in read.tools)


def test_glaive_fixture_first_conversation():
    read = read_dataset(resolve(["glaive_toolcall_en_demo"], FIXTURE_COMPAT))
    assert read.conversations[0][:3] == [
        {"role": "user", "content": "Will I need an umbrella in Lisbon tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_forecast",
                                                              "arguments": {"city": "Lisbon", "days": 1}}]},
        {"role": "tool", "content": '{"city": "Lisbon", "forecast": [{"day": 1, "sky": "light rain", "high_c": 17}]}'},
    ]
    assert [t["name"] for t in read.tools[0]] == ["get_forecast"]
    assert read.sources[0] == f"{FIXTURE_COMPAT / 'glaive_toolcall_en_demo.json'}: record 1"


def test_columns_and_tags_are_remapped():
    """role/content messages with user/assistant tags and a system column; a leading system turn wins."""
    read = read_dataset(resolve(["role_content_demo"], FIXTURE_COMPAT))
    assert read.conversations == [
        [{"role": "system", "content": "Answer in one sentence."},
         {"role": "user", "content": "What is the boiling point of water at sea level?"},
         {"role": "assistant", "content": "100 degrees Celsius."}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Capital of Japan?"}, {"role": "assistant", "content": "Tokyo."},
         {"role": "user", "content": "And of Canada?"}, {"role": "assistant", "content": "Ottawa."}],
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."}],
    ]


def test_columns_an_entry_leaves_out_are_none_as_in_llamafactory():
    only = read_dataset(resolve(["alpaca_en_demo_instruction_only"], FIXTURE_COMPAT)).conversations
    assert only[1][0] == {"role": "user", "content": "Rewrite the sentence in the passive voice."}  # input left out
    assert read_dataset(resolve(["alpaca_en_demo"], FIXTURE_COMPAT)).conversations[1][0]["content"].endswith(
        "\nThe committee approved the new budget.")


def test_registry_reads_only_the_columns_it_maps_while_a_file_path_reads_system_and_history(tmp_path):
    data_dir = registry(tmp_path, {"plain": {"file_name": "a.json"},
                                   "mapped": {"file_name": "a.json", "columns": {
                                       "prompt": "instruction", "query": "input", "response": "output",
                                       "system": "system", "history": "history"}}}, {"a.json": ALPACA})
    plain, mapped = (read_dataset(resolve([name], data_dir)).conversations[0] for name in ("plain", "mapped"))
    assert plain == [{"role": "user", "content": "Add.\n2 and 3"}, {"role": "assistant", "content": "5"}]
    assert [m["role"] for m in mapped] == ["system", "user", "assistant", "user", "assistant"]
    assert read_dataset(resolve([str(data_dir / "a.json")], tmp_path / "nowhere")).conversations[0] == mapped


def test_tags_an_entry_leaves_out_are_none_as_in_llamafactory(tmp_path):
    """No system_tag: a leading system turn is not taken as the system prompt, so the turns do not alternate."""
    record = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]}
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    data_dir = registry(tmp_path, {
        "no_system": {"file_name": "m.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                      "tags": tags},
        "system": {"file_name": "m.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                   "tags": {**tags, "system_tag": "system"}}}, {"m.json": [record]})
    with pytest.raises(DataError, match=r"m\.json: record 1: messages\[0\]: unknown 'role' value 'system'.*"
                                        r"dataset 'no_system' of .*dataset_info\.json, formatting sharegpt"):
        read_dataset(resolve(["no_system"], data_dir))
    assert read_dataset(resolve(["system"], data_dir)).conversations[0][0] == {"role": "system", "content": "S"}


def test_bad_function_call_is_a_record_error_skip_invalid_applies(tmp_path):
    good = raw(FIXTURE_COMPAT / "glaive_toolcall_en_demo.json")[0]
    bad = {**good, "conversations": [good["conversations"][0], {"from": "function_call", "value": "{name: x}"}]}
    data_dir = registry(tmp_path, {"calls": {"file_name": "c.json", "formatting": "sharegpt",
                                             "columns": {"messages": "conversations", "tools": "tools"}}},
                        {"c.json": [good, bad, good]})
    with pytest.raises(DataError, match=r"c\.json: record 2: conversations\[1\]: function call is not valid JSON.*"
                                        r"skip_invalid: true"):
        read_dataset(resolve(["calls"], data_dir))
    read = read_dataset(resolve(["calls"], data_dir), skip_invalid=True)
    assert len(read.conversations) == len(read.tools) == 2
    assert read.skipped[0].startswith(f"{data_dir / 'c.json'}: record 2: conversations[1]: function call is not")


@pytest.mark.parametrize("data_dir", DATA_DIRS)
def test_max_samples_first_records_of_each_dataset(data_dir):
    read = read_dataset(resolve(NAMES, data_dir), max_samples=2)
    assert len(read.conversations) == 6
    assert [s.rsplit("/", 1)[-1] for s in read.sources] == [
        "alpaca_en_demo.json: record 1", "alpaca_en_demo.json: record 2", "identity.json: record 1",
        "identity.json: record 2", "glaive_toolcall_en_demo.json: record 1", "glaive_toolcall_en_demo.json: record 2"]


def test_a_folder_is_read_whole_in_name_order_and_max_samples_spans_its_files(tmp_path):
    folder = tmp_path / "data" / "parts"
    folder.mkdir(parents=True)
    (folder / "b.jsonl").write_text(json.dumps(ALPACA[0]) + "\n")
    (folder / "a.json").write_text(json.dumps(ALPACA * 2))
    data_dir = registry(tmp_path / "data", {"parts": {"file_name": "parts"}})
    for spec in (resolve(["parts"], data_dir)[0], resolve([str(folder)], tmp_path / "nowhere")[0]):
        assert spec.files == [folder / "a.json", folder / "b.jsonl"]
        assert len(read_dataset([spec]).conversations) == 3
        assert read_dataset([spec], max_samples=2).sources == [f"{folder / 'a.json'}: record {n}" for n in (1, 2)]
    (folder / "README.md").write_text("notes")
    with pytest.raises(DataError, match=r"parts: a dataset folder is read whole, and 'README\.md' in it is not a "
                                        r"\.json or \.jsonl file; move it out"):
        resolve(["parts"], data_dir)


def test_a_file_path_entry_is_read_with_dataset_format(tmp_path):
    path = FIXTURE_COMPAT / "glaive_toolcall_en_demo.json"
    (spec,) = resolve([str(path)], tmp_path / "no_dataset_dir")
    assert (spec.name, spec.files, spec.fmt, spec.columns, spec.registry) == (str(path), [path], None, None, None)
    read = read_dataset([spec])
    assert read.conversations == read_dataset(resolve(["glaive_toolcall_en_demo"], FIXTURE_COMPAT)).conversations
    assert read.tools[0][0]["name"] == "get_forecast"
    assert resolve([str(path)], tmp_path, "sharegpt")[0].fmt == "sharegpt"


def test_unknown_name_lists_close_names_and_where_it_looked():
    with pytest.raises(DataError, match=r"dataset 'identiy': no file or folder of that name in .*, and no entry "
                                        r"'identiy' in .*dataset_info\.json \(close names: identity\)"):
        resolve(["identiy"], FIXTURE_COMPAT)
    with pytest.raises(DataError, match=r"close names: alpaca_en_demo"):
        resolve(["data/alpaca_en_demo.json"], FIXTURE_COMPAT)  # a path that is not there is looked up by its stem


def test_name_without_dataset_info(tmp_path):
    with pytest.raises(DataError, match=rf"dataset 'identity': no file or folder of that name in .*, and "
                                        rf"{tmp_path / 'dataset_info.json'} does not exist.*set dataset_dir"):
        resolve(["identity"], tmp_path)


def test_a_missing_eval_dataset_is_named_with_its_key(tmp_path, monkeypatch):
    """What the launcher, the doctor and the workers' agreement check read: each entry under its config key."""
    from meshtune.data.pipeline import prepare_datasets
    from meshtune.data.registry import resolve_all

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    cfg = TrainConfig(model_name_or_path="m", dataset=["train.jsonl"], eval_dataset=["eval.jsonl"],
                      output_dir=str(tmp_path / "out"))
    for read in (lambda: resolve_all(cfg), lambda: prepare_datasets(cfg, train_tokenizer(["a b"] * 4), False)):
        with pytest.raises(DataError, match=r"^eval_dataset 'eval\.jsonl': no file or folder of that name in "):
            read()
    with pytest.raises(DataError, match=r"^dataset 'nope\.jsonl': no file or folder"):
        resolve_all(cfg.model_copy(update={"dataset": ["nope.jsonl"]}))


@pytest.mark.parametrize("data_dir", DATA_DIRS)
@pytest.mark.parametrize(
    "name, problem",
    [
        ("alpaca_en", r"'alpaca_en' is not a local file \(hf_hub_url: llamafactory/alpaca_en, ms_hub_url: "
                      r"llamafactory/alpaca_en, om_hub_url: HaM/alpaca_en\); meshtune downloads nothing and runs no "
                      r"loading scripts: download the data, put it under dataset_dir .* and give the entry a "
                      r"file_name, or pass the file path"),
        ("mllm_demo", r"'mllm_demo' maps media columns \(images: images\); meshtune trains on text only"),
        ("kto_en_demo", r"'kto_en_demo' maps kto_tag \(label\): data for KTO \(answers marked desirable or not\); "
                        r"train it with stage: kto"),
    ],
)
def test_llamafactory_entries_meshtune_refuses(data_dir, name, problem):
    with pytest.raises(DataError, match=rf"dataset_info\.json: dataset {problem}"):
        resolve([name], data_dir)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"script_url": "my_loader"}, r"is not a local file \(script_url: my_loader\); meshtune downloads nothing"),
        ({"formatting": "sharegpt"}, "has no file_name; give it the data file's name relative to dataset_dir"),
        ({"file_name": "a.json", "formatting": "openai"},
         r"has formatting: \"openai\"; meshtune reads alpaca or sharegpt entries \(role/content messages read as "
         r"sharegpt with tags role_tag: role"),
        ({"file_name": "a.json", "num_samples": 100},
         "has num_samples: 100: LLaMA-Factory draws that many records at random .* use max_samples"),
        ({"file_name": "a.json", "split": "validation"},
         r"has split: \"validation\", but a local file has one split, train .* remove split"),
        ({"file_name": "a.json", "split": "train[:10]"}, r"has split: \"train\[:10\]\".*for the first N records use "
                                                         r"max_samples"),
        ({"file_name": "a.json", "columns": {"promt": "q"}},
         "columns has 'promt', which LLaMA-Factory does not read; use prompt, query, response"),
        ({"file_name": "a.json", "columns": {"prompt": "q"}}, "its columns leave out 'response', which alpaca needs"),
        ({"file_name": "a.json", "formatting": "sharegpt", "columns": {"tools": "tools"}},
         "its columns leave out 'messages', which sharegpt needs"),
        ({"file_name": "a.json", "formatting": "sharegpt", "tags": {"role_tag": "role"}},
         "its tags leave out content_tag, which sharegpt needs"),
        ({"file_name": "a.json", "columns": ["prompt"]}, "columns must be an object"),
        ({"file_name": "a.json", "columns": {"prompt": 3}}, "columns.prompt must be a string"),
        ({"file_name": "missing.json"}, r"missing\.json not found \(file_name 'missing\.json' is relative to "
                                        r"dataset_dir .*\); put the data there or fix file_name"),
        ({"file_name": "wiki_demo.txt"}, r"wiki_demo\.txt is a '\.txt' file; meshtune reads \.json or \.jsonl"),
        ("a.json", "must be an object with file_name"),
    ],
)
def test_entries_refused_with_the_reason(tmp_path, entry, problem):
    data_dir = registry(tmp_path, {"d": entry}, {"a.json": ALPACA})
    (data_dir / "wiki_demo.txt").write_text("text")
    with pytest.raises(DataError, match=rf"{data_dir / 'dataset_info.json'}: dataset 'd'.*{problem}"):
        resolve(["d"], data_dir)


def test_subset_and_folder_are_ignored_for_a_local_file_as_in_llamafactory(tmp_path):
    data_dir = registry(tmp_path, {"d": {"file_name": "a.json", "subset": "en", "folder": "x", "split": "train",
                                         "ranking": False, "hf_hub_url": "someone/else"}}, {"a.json": ALPACA})
    assert len(read_dataset(resolve(["d"], data_dir)).conversations) == 1


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"d": {"file_name": "a.json"},}', r"dataset_info\.json: invalid JSON at line 1, column 31"),
        ('[{"file_name": "a.json"}]', r"dataset_info\.json: expected a JSON object of dataset names.*found list"),
    ],
)
def test_invalid_dataset_info(tmp_path, text, problem):
    (tmp_path / "dataset_info.json").write_text(text)
    with pytest.raises(DataError, match=problem):
        resolve(["d"], tmp_path)


def test_only_named_entries_need_dataset_info(tmp_path):
    """A broken dataset_info.json does not matter while every entry is a path, and the checksum then is the
    file's read in the default way; with a name it covers how the entry reads its file (columns), not the rest
    of the dataset_info.json."""
    (tmp_path / "dataset_info.json").write_text("{broken")
    path = FIXTURE_COMPAT / "identity.json"
    assert dataset_checksum(resolve([str(path)], tmp_path)) == dataset_checksum([file_spec(path)])
    data_dir = shutil.copytree(FIXTURE_COMPAT, tmp_path / "data")
    first = dataset_checksum(resolve(["identity", str(path)], data_dir))
    info = data_dir / "dataset_info.json"
    info.write_text(info.read_text().replace('"alpaca_en_demo.json"', '"alpaca_en_demo.json" '))
    assert dataset_checksum(resolve(["identity", str(path)], data_dir)) == first  # another entry, spaces
    entries = json.loads(info.read_text())
    entries["identity"]["columns"] = {"prompt": "instruction", "response": "output"}  # no query column
    info.write_text(json.dumps(entries))
    assert dataset_checksum(resolve(["identity", str(path)], data_dir)) != first


def test_prepare_datasets_resolves_names_and_cuts_train_and_eval(tmp_path, caplog):
    cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), dataset=["identity", "glaive_toolcall_en_demo"],
                      eval_dataset=["alpaca_en_demo"], dataset_dir=str(FIXTURE_COMPAT), max_samples=3,
                      cutoff_len=4096, output_dir=str(tmp_path / "out"))
    tokenizer = train_tokenizer([r["output"] for r in raw(FIXTURE_COMPAT / "alpaca_en_demo.json")] * 4)
    caplog.set_level(logging.INFO, logger="meshtune")
    train, evaluation = prepare_datasets(cfg, tokenizer, show_progress=False)
    lines = caplog.messages
    assert (train.stats["n_records"], evaluation.stats["n_records"]) == (6, 3)
    assert (len(train), len(evaluation)) == (6, 3)
    assert lines[0] == "chat template: chatml (written out)"
    assert lines[1].startswith("train data: 6 samples") and lines[2].startswith("eval data: 3 samples")
