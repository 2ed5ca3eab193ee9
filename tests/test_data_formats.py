"""Records of every supported format → validated conversations, and errors that name file, record and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtune.data.formats import convert, detect_format, load_records, read_dataset
from meshtune.errors import DataError

# LLaMA-Factory data files: our own small fixtures always, the real files too where ../shared/compat exists.
FIXTURE_COMPAT = Path(__file__).resolve().parent / "fixtures" / "compat" / "llamafactory" / "data"
SHARED_COMPAT = Path(__file__).resolve().parents[2] / "shared" / "compat" / "llamafactory" / "data"
NEEDS_SHARED = pytest.mark.skipif(
    not SHARED_COMPAT.is_dir(), reason=f"compat data folder {SHARED_COMPAT} is absent (not in a user's clone)"
)

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {
        "instruction": "And now?",
        "input": "",
        "output": "7",
        "system": "You are a calculator.",
        "history": [["What is 1+1?", "2"], ["And 3+3?", "6"]],
    },
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "Find a recipe with rice."},
            {"from": "function_call", "value": '{"name": "search", "arguments": {"q": "rice"}}'},
            {"from": "observation", "value": '{"recipes": ["fried rice"]}'},
            {"from": "gpt", "value": "Try fried rice."},
        ],
        "system": "You can call tools.",
        "tools": '[{"name": "search"}]',
    }
]
QWEN = [
    {
        "id": "identity_0",
        "conversations": [{"from": "user", "value": "Who are you?"}, {"from": "assistant", "value": "A model."}],
    }
]
MESSAGES = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there."}]},
            {"role": "assistant", "content": "Hi."},
        ]
    }
]


def to_messages(record, fmt: str) -> list[dict]:
    return convert(record, fmt)[0]


def write(path: Path, records: list) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n\n" for r in records))  # blank lines are allowed
    else:
        path.write_text(json.dumps(records))
    return path


@pytest.mark.parametrize(
    "records, fmt", [(ALPACA, "alpaca"), (SHAREGPT, "sharegpt"), (QWEN, "qwen"), (MESSAGES, "messages")]
)
def test_detect_format(records, fmt):
    assert detect_format(records, Path("d.json")) == fmt


def test_detect_format_unknown_names_keys_and_option():
    with pytest.raises(DataError, match=r"d\.json.*keys: prompt, text.*dataset_format:"):
        detect_format([{"text": "x", "prompt": "y"}], Path("d.json"))


def test_alpaca_input_system_and_history():
    assert to_messages(ALPACA[0], "alpaca") == [
        {"role": "user", "content": "Add the numbers.\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert [(m["role"], m["content"]) for m in to_messages(ALPACA[1], "alpaca")] == [
        ("system", "You are a calculator."),
        ("user", "What is 1+1?"),
        ("assistant", "2"),
        ("user", "And 3+3?"),
        ("assistant", "6"),
        ("user", "And now?"),
        ("assistant", "7"),
    ]


def test_sharegpt_tool_calls_and_system():
    messages, tools = convert(SHAREGPT[0], "sharegpt")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = {"name": "search", "arguments": {"q": "rice"}}
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert messages[3] == {"role": "tool", "content": '{"recipes": ["fried rice"]}'}
    assert tools == [{"name": "search"}]


def test_parallel_function_calls_and_tools_as_a_list():
    record = {
        "conversations": [
            {"from": "human", "value": "Weather in Paris and Rome?"},
            {"from": "function_call",
             "value": '[{"name": "w", "arguments": {"c": "Paris"}}, {"name": "w", "arguments": {"c": "Rome"}}]'},
            {"from": "observation", "value": "sunny; rain"},
            {"from": "gpt", "value": "Paris is sunny, Rome rainy."},
        ],
        "tools": [{"name": "w"}],
    }
    messages, tools = convert(record, "sharegpt")
    assert [c["arguments"]["c"] for c in messages[1]["tool_calls"]] == ["Paris", "Rome"]
    assert tools == [{"name": "w"}]
    for empty in ("[]", "", None):
        assert convert({**record, "tools": empty}, "sharegpt")[1] is None


def test_openai_tool_calls_are_trained_as_calls():
    """An assistant message's OpenAI tool_calls (content null, arguments JSON text or an object) become the calls
    the chat template writes, as a sharegpt function call does."""
    record = {"messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "w", "arguments": '{"c": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "w", "arguments": {"c": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
    ], "tools": [{"type": "function", "function": {"name": "w"}}]}
    messages, tools = convert(record, "messages")
    calls = [{"name": "w", "arguments": {"c": "Paris"}}, {"name": "w", "arguments": {"c": "Rome"}}]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert messages[2:4] == [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"}]
    assert tools == [{"type": "function", "function": {"name": "w"}}]


def test_conversation_ending_in_a_function_call_trains_the_call():
    record = {"conversations": [{"from": "human", "value": "Set a timer."},
                                {"from": "function_call", "value": '{"name": "timer", "arguments": {"min": 5}}'}]}
    assert convert(record, "sharegpt")[0][-1]["tool_calls"] == [{"name": "timer", "arguments": {"min": 5}}]


def test_sharegpt_own_system_turn_wins_over_record_system():
    record = {
        "system": "ignored",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ],
    }
    assert to_messages(record, "sharegpt")[0] == {"role": "system", "content": "S"}


def test_qwen_and_messages():
    assert to_messages(QWEN[0], "qwen") == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "A model."},
    ]
    assert to_messages(MESSAGES[0], "messages")[1] == {"role": "user", "content": "Hello, there."}


@pytest.mark.parametrize(
    "record, fmt, problem",
    [
        ({"instruction": "x"}, "alpaca", "missing 'output'"),
        ({"instruction": "x", "output": ""}, "alpaca", "no assistant message"),
        ({"instruction": "x", "output": 3}, "alpaca", "'output' must be a string"),
        ({"instruction": "x", "output": "y", "history": [["only one"]]}, "alpaca", r"history\[0\]"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt", "unknown 'from' value 'bot'"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]},
            "sharegpt",
            r"conversations\[1\]: 'human' where an assistant or function call turn belongs",
        ),
        (
            {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
            "sharegpt",
            r"conversations\[0\]: 'gpt' where a user or observation turn belongs",
        ),
        (
            {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]},
            "sharegpt",
            r"odd number of turns \(1 after the system turn\)",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{'name': 'f'}"}]},
            "sharegpt",
            r"conversations\[1\]: function call is not valid JSON",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"args": 1}'}]},
            "sharegpt",
            r"conversations\[1\]: a function call needs a 'name'",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": "[{bad"},
            "sharegpt",
            "'tools' is not valid JSON",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
             "tools": '{"name": "f"}'},
            "sharegpt",
            "'tools' must be a list of function schemas",
        ),
        ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}, "qwen", "'human'"),
        ({"conversations": "x"}, "qwen", "must be a list"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "user", "content": "q"}]}, "messages", "no assistant message"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "messages", "unknown role 'bot'"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages", "content must be a string"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{'a': 1}"}}]}]},
            "messages",
            r"messages\[1\].tool_calls\[0\]: arguments are not valid JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
            "messages",
            r"messages\[1\].tool_calls\[0\] needs a 'function' with a 'name'",
        ),
        (
            {"messages": [{"role": "user", "content": "q", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
            "messages",
            r"messages\[0\]: a 'user' message has tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
            "'image_url' is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
            "messages",
            "system message may only come first",
        ),
        ("just a string", "alpaca", "not an object"),
    ],
)
def test_invalid_records(record, fmt, problem):
    with pytest.raises(ValueError, match=problem):
        to_messages(record, fmt)


def test_load_records_jsonl_skips_blank_lines(tmp_path):
    assert load_records(write(tmp_path / "d.jsonl", QWEN * 3)) == QWEN * 3


@pytest.mark.parametrize(
    "name, text, problem",
    [
        ("d.json", '[{"a": 1},\n {"a": }]', r"d\.json: invalid JSON at line 2, column 8"),
        ("d.jsonl", '{"a": 1}\n\n{"a": \n', r"d\.jsonl: line 3: invalid JSON"),
        ("d.json", '{"a": 1}', "expected a JSON list.*jsonl"),
        ("d.csv", "a,b", r"unsupported file type '\.csv'; use \.json or \.jsonl"),
        ("d.json", "", r"d\.json: the file is empty; a dataset file holds a JSON list of records"),
        ("d.jsonl", "", r"d\.jsonl: the file is empty"),
        ("d.json", " \n\n", r"d\.json: the file is empty"),
    ],
)
def test_load_records_errors(tmp_path, name, text, problem):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=problem):
        load_records(tmp_path / name)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.json: dataset file not found"):
        read_dataset([tmp_path / "nope.json"])


def test_read_dataset_detects_per_file(tmp_path):
    paths = [
        write(tmp_path / "a.json", ALPACA),
        write(tmp_path / "s.jsonl", SHAREGPT),
        write(tmp_path / "q.json", QWEN),
        write(tmp_path / "m.jsonl", MESSAGES),
    ]
    read = read_dataset(paths)
    assert (len(read.conversations), read.skipped) == (5, [])
    assert read.conversations[2][0]["content"] == "You can call tools."
    assert read.sources[0] == f"{paths[0]}: record 1" and read.sources[2] == f"{paths[1]}: record 1 (line 1)"


def test_bad_record_names_file_index_and_option(tmp_path):
    path = write(tmp_path / "a.json", ALPACA + [{"instruction": "no output"}] + ALPACA)
    with pytest.raises(DataError, match=r"a\.json: record 3: missing 'output'.*numbered from 1.*skip_invalid: true"):
        read_dataset([path])
    read = read_dataset([path], skip_invalid=True)
    assert (len(read.conversations), read.skipped) == (4, [f"{path}: record 3: missing 'output'"])


def test_jsonl_records_count_from_one_as_json_and_a_broken_line_is_skipped_when_asked(tmp_path):
    """The same numbering in both file types (JSONL adds the line); skip_invalid skips a line that is not JSON."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in ALPACA]
    path.write_text(lines[0] + "\n\n" + '{"instruction": "x", "output": \n' + lines[1] + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 3: invalid JSON"):
        read_dataset([path])
    read = read_dataset([path], skip_invalid=True)
    assert len(read.conversations) == 2
    assert read.skipped == [f"{path}: record 2 (line 3): invalid JSON at column 32: Expecting value"]
    assert read.sources == [f"{path}: record 1 (line 1)", f"{path}: record 3 (line 4)"]
    bad = tmp_path / "e.jsonl"
    bad.write_text(lines[0] + "\n" + json.dumps({"instruction": "no output"}) + "\n")
    with pytest.raises(DataError, match=r"e\.jsonl: record 2 \(line 2\): missing 'output'"):
        read_dataset([bad])


def test_forced_format_and_unknown_format(tmp_path):
    path = write(tmp_path / "q.json", QWEN)
    assert read_dataset([path], fmt="sharegpt").conversations == read_dataset([path], fmt="qwen").conversations
    with pytest.raises(DataError, match="unknown dataset_format 'csv'"):
        read_dataset([path], fmt="csv")


def test_no_usable_record(tmp_path):
    empty = write(tmp_path / "empty.json", [])
    bad = write(tmp_path / "bad.jsonl", [{"instruction": "x", "output": ""}])
    with pytest.raises(DataError, match=r"no usable record in .*empty\.json, .*bad\.jsonl \(1 invalid skipped\)"):
        read_dataset([empty, bad], skip_invalid=True)


@pytest.mark.parametrize(
    "data_dir, counts",
    [
        pytest.param(
            FIXTURE_COMPAT,
            {"alpaca_en_demo.json": 5, "identity.json": 4, "glaive_toolcall_en_demo.json": 4},
            id="fixtures",
        ),
        pytest.param(
            SHARED_COMPAT,
            {"alpaca_en_demo.json": 999, "identity.json": 91, "glaive_toolcall_en_demo.json": 300},
            id="shared",
            marks=NEEDS_SHARED,
        ),
    ],
)
@pytest.mark.parametrize(
    "name, fmt",
    [("alpaca_en_demo.json", "alpaca"), ("identity.json", "alpaca"), ("glaive_toolcall_en_demo.json", "sharegpt")],
)
def test_llamafactory_compat_files(data_dir, counts, name, fmt):
    path = data_dir / name
    assert detect_format(load_records(path), path) == fmt
    read = read_dataset([path])
    assert (len(read.conversations), read.skipped) == (counts[name], [])
    if fmt == "sharegpt":
        assert any(m["role"] == "tool" for c in read.conversations for m in c)


def test_llamafactory_fixture_conversations():
    """Our fixtures, message by message: input joined or left out, placeholders kept, tool calls as turns."""
    alpaca = read_dataset([FIXTURE_COMPAT / "alpaca_en_demo.json"]).conversations
    assert [c[0]["content"] for c in alpaca[:2]] == [
        "Give two tips for keeping houseplants healthy.",
        "Rewrite the sentence in the passive voice.\nThe committee approved the new budget.",
    ]
    identity = read_dataset([FIXTURE_COMPAT / "identity.json"]).conversations
    assert all("{{name}}" in c[1]["content"] and "{{author}}" in c[1]["content"] for c in identity)
    read = read_dataset([FIXTURE_COMPAT / "glaive_toolcall_en_demo.json"])
    glaive = read.conversations
    assert [[m["role"] for m in c] for c in glaive] == [
        ["user", "assistant", "tool", "assistant"],
        ["user", "assistant", "tool", "assistant"] * 2,
        ["user", "assistant"] * 2,
        ["user", "assistant"],
    ]
    assert glaive[0][1] == {"role": "assistant", "content": "",
                            "tool_calls": [{"name": "get_forecast", "arguments": {"city": "Lisbon", "days": 1}}]}
    assert [[t["name"] for t in tools] if tools else None for tools in read.tools] == [
        ["get_forecast"], ["convert_currency", "get_forecast"], ["set_timer"], None]


def test_max_samples_takes_the_first_records_before_skipping(tmp_path):
    """As LLaMA-Factory: the first N records of each dataset, a malformed one among them counted and skipped."""
    a = write(tmp_path / "a.json", [ALPACA[0], {"instruction": "no output"}, ALPACA[1], ALPACA[0]])
    b = write(tmp_path / "b.jsonl", QWEN * 3)
    read = read_dataset([a, b], skip_invalid=True, max_samples=2)
    assert len(read.conversations) == 3 and len(read.skipped) == 1
    assert read.sources == [f"{a}: record 1", f"{b}: record 1 (line 1)", f"{b}: record 2 (line 3)"]
