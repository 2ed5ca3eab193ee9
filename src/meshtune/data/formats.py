"""Read the dataset files users already have (LLaMA-Factory alpaca / sharegpt, Qwen finetune.py, OpenAI messages)
and turn every record into one conversation: a list of `{"role", "content"}` dicts (an assistant turn that calls
tools has `tool_calls` instead of content), with the tools the record offers.

Everything downstream (chat template, label masking, cache) sees only conversations, so a new record format
is one converter here and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from meshtune.errors import DataError

FORMATS = ("alpaca", "sharegpt", "qwen", "messages")
ROLES = ("system", "user", "assistant", "tool")
EXTENSIONS = (".json", ".jsonl")

# LLaMA-Factory's defaults (its DatasetAttr): the columns and sharegpt tags of an entry that names none.
# An entry that gives `columns` (or `tags`) sets every one it leaves out to None, as LLaMA-Factory does.
LF_COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
               "tools": None},
    "sharegpt": {"messages": "conversations", "system": None, "tools": None},
}
LF_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
           "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
# What each sharegpt tag means here: an observation is tool output, a function call an assistant turn with tool_calls.
TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "tool",
             "function_tag": "function_call", "system_tag": "system"}

# A file given by path (no registry entry) also uses a record's `system`, alpaca `history` and `tools`, and its
# sharegpt conversations may say user / assistant for human / gpt.
FILE_COLUMNS = {
    "alpaca": {**LF_COLUMNS["alpaca"], "history": "history", "system": "system", "tools": "tools"},
    "sharegpt": {**LF_COLUMNS["sharegpt"], "system": "system", "tools": "tools"},
    "qwen": {"messages": "conversations", "system": "system", "tools": None},
    "messages": {"tools": "tools"},
}
SHAREGPT_ROLES = {**{LF_TAGS[tag]: role for tag, role in TAG_ROLES.items()}, "user": "user", "assistant": "assistant"}
QWEN_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

T = TypeVar("T")

_FORMAT_HELP = (
    "supported: messages (OpenAI 'messages' list), sharegpt ('conversations' with from human/gpt), "
    "qwen ('conversations' with from user/assistant), alpaca ('instruction'/'input'/'output')"
)


@dataclass
class DatasetSpec:
    """One dataset entry, resolved: the files to read and how their records become conversations.

    `columns` / `tags` None: the format's defaults for a file given by path; a registry entry spells out its
    columns (and, for sharegpt, its tags).
    """

    name: str  # the entry as the config gives it
    files: list[Path]
    fmt: str | None = None  # one of FORMATS, or None: detected per file (dataset_format auto)
    columns: dict[str, str | None] | None = None
    tags: dict[str, str | None] | None = None
    registry: Path | None = None  # the dataset_info.json that defined it
    ranking: bool = False  # LLaMA-Factory's ranking: true: preference pairs, a chosen and a rejected response
    unpaired: bool = False  # stage: kto: each record also says whether its response is desirable (data/unpaired.py)

    def label(self, fmt: str) -> str:
        """How record errors name the reading rules in force."""
        if self.registry is None:
            return f"format {fmt}"
        return f"dataset '{self.name}' of {self.registry}, formatting {fmt}"

    def identity(self) -> str:
        """Everything but the files' bytes that decides the conversations (checksums.dataset_checksum)."""
        # a flag only where set, so the caches of sft and pt runs keep their identity
        return json.dumps({"fmt": self.fmt, "columns": self.columns, "tags": self.tags,
                           **({"ranking": True} if self.ranking else {}),
                           **({"unpaired": True} if self.unpaired else {})}, sort_keys=True)


def file_spec(path: Path, fmt: str | None = None) -> DatasetSpec:
    """A dataset file given by path, read with `dataset_format`."""
    return DatasetSpec(str(path), [Path(path)], fmt)


class Unparseable:
    """A JSONL line that is not JSON, kept in place of its record when `skip_invalid` skips bad records."""

    def __init__(self, problem: str):
        self.problem = problem


def load_records(path: Path) -> list[Any]:
    """Parse a .json list or a .jsonl file. Items that are not objects are kept and reported per record later,
    so that `skip_invalid` can skip them like any other bad record."""
    return [record for record, _ in located_records(path, keep_unparseable=False)]


def located_records(path: Path, keep_unparseable: bool) -> list[tuple[Any, str]]:
    """Each record with where it is, for messages: `record N` (numbered from 1) and, in JSONL, its line.
    `keep_unparseable`: a JSONL line that is not JSON becomes an `Unparseable` record instead of an error."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; check the dataset paths in your config")
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use {' or '.join(EXTENSIONS)}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e}); re-save the file as UTF-8") from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty; a dataset file holds a JSON list of records (.json) or one JSON "
                        f"record a line (.jsonl)")
    if suffix == ".jsonl":
        return _parse_jsonl(text, path, keep_unparseable)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(records, list):
        raise DataError(
            f"{path}: expected a JSON list of records at the top level, found {type(records).__name__}; "
            "wrap the records in [...] or write one object per line in a .jsonl file"
        )
    return [(record, f"record {n}") for n, record in enumerate(records, start=1)]


def _parse_jsonl(text: str, path: Path, keep_unparseable: bool) -> list[tuple[Any, str]]:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"record {len(records) + 1} (line {lineno})"
        try:
            records.append((json.loads(line), where))
        except json.JSONDecodeError as e:
            problem = f"invalid JSON at column {e.colno}: {e.msg}"
            if not keep_unparseable:
                raise DataError(f"{path}: line {lineno}: {problem}") from None
            records.append((Unparseable(problem), where))
    return records


def detect_format(records: list[Any], path: Path) -> str:
    """Guess the format from the first object record: files are homogeneous in practice, and looking at one
    record keeps the guess cheap and easy to explain when it is wrong."""
    first = next((r for r in records if isinstance(r, dict)), None)  # an Unparseable line is not one
    if first is None:
        raise DataError(f"{path}: no JSON object records found; each record must be an object {{...}}")
    if "messages" in first:
        return "messages"
    turns = first.get("conversations")
    if isinstance(turns, list):
        tags = {t.get("from") for t in turns if isinstance(t, dict)}
        if tags & {"human", "gpt"}:
            return "sharegpt"
        if tags & {"user", "assistant"}:
            return "qwen"
    if "instruction" in first:
        return "alpaca"
    raise DataError(
        f"{path}: cannot tell the dataset format from the first record (keys: {', '.join(sorted(first))}); "
        f"{_FORMAT_HELP}. Set `dataset_format:` in the config to one of {', '.join(FORMATS)}"
    )


def convert(record: Any, fmt: str, spec: DatasetSpec | None = None) -> tuple[list[dict], list[dict] | None]:
    """One record of format `fmt` → (validated conversation, the tools it offers or None), read by the spec's
    columns and tags (a file's defaults without a spec).

    Raises ValueError with a short problem text; the caller knows the file and record number and adds them.
    """
    if isinstance(record, Unparseable):
        raise ValueError(record.problem)
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {type(record).__name__}, not an object")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    columns = spec.columns if spec is not None and spec.columns is not None else FILE_COLUMNS.get(fmt, {})
    if fmt == "alpaca":
        messages = _from_alpaca(record, columns)
    elif fmt == "messages":
        messages = _from_openai(record)
    else:
        messages = _from_conversations(record, columns, *_turn_rules(fmt, spec))
    tools = _tools(record, columns.get("tools"))
    _validate(messages)
    return messages, tools


def _from_alpaca(record: dict, columns: dict) -> list[dict]:
    """As LLaMA-Factory: prompt and query joined by a newline (each only when non-empty), `history` pairs become
    earlier turns, `system` a system message."""
    prompt, query, response = columns.get("prompt"), columns.get("query"), columns.get("response")
    for key in (prompt, response):
        if key and key not in record:
            raise ValueError(f"missing '{key}'")
    for key in (prompt, query, response, columns.get("system")):
        if key and record.get(key) is not None and not isinstance(record[key], str):
            raise ValueError(f"'{key}' must be a string, got {type(record[key]).__name__}")
    messages = []
    if columns.get("system") and record.get(columns["system"]):
        messages.append({"role": "system", "content": record[columns["system"]]})
    history = (record.get(columns["history"]) if columns.get("history") else None) or []
    if not isinstance(history, list):
        raise ValueError(f"'{columns['history']}' must be a list of [query, response] pairs")
    for n, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(f"{columns['history']}[{n}] must be a [query, response] pair")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    text = "\n".join(record[key] for key in (prompt, query) if key and record.get(key))
    messages.append({"role": "user", "content": text})
    if response:  # an entry whose columns leave out the response has nothing to train on: _validate says so
        messages.append({"role": "assistant", "content": record[response]})
    return messages


def _turn_rules(fmt: str, spec: DatasetSpec | None) -> tuple[str, str, dict[str, str], str | None, bool]:
    """(role key, content key, tag → role, system tag, whether turns must alternate) of `conversations` records.

    sharegpt follows LLaMA-Factory: user or observation turns, then assistant or function call turns, in pairs;
    Qwen's finetune.py data has no such rule."""
    if fmt == "qwen":
        return "from", "value", QWEN_ROLES, "system", False
    if spec is None or spec.tags is None:
        return LF_TAGS["role_tag"], LF_TAGS["content_tag"], SHAREGPT_ROLES, LF_TAGS["system_tag"], True
    tags = spec.tags
    roles = {tags[tag]: role for tag, role in TAG_ROLES.items() if tags.get(tag) is not None}
    return tags["role_tag"], tags["content_tag"], roles, tags.get("system_tag"), True


def _from_conversations(record: dict, columns: dict, role_key: str, content_key: str, roles: dict[str, str],
                        system_tag: str | None, alternate: bool) -> list[dict]:
    """sharegpt (LLaMA-Factory) and Qwen finetune.py: a list of {from, value} turns (other keys by the entry's
    tags). A leading system turn is the system message; otherwise the record's system column is, as in
    LLaMA-Factory."""
    key = columns["messages"]
    turns = record.get(key)
    if not isinstance(turns, list):
        raise ValueError(f"'{key}' must be a list of {{{role_key}, {content_key}}} objects")
    for n, turn in enumerate(turns):
        if not (isinstance(turn, dict) and role_key in turn and content_key in turn):
            raise ValueError(f"{key}[{n}] must be an object with '{role_key}' and '{content_key}'")
        if not isinstance(turn[role_key], str) or turn[role_key] not in roles:
            raise ValueError(f"{key}[{n}]: unknown '{role_key}' value {turn[role_key]!r}; use one of "
                             f"{', '.join(roles)}")
    first = 1 if system_tag and turns and turns[0][role_key] == system_tag else 0
    system = turns[0][content_key] if first else record.get(columns["system"]) if columns.get("system") else None
    messages = [{"role": "system", "content": system}] if system else []
    for n in range(first, len(turns)):
        tag = turns[n][role_key]
        expected = (("user", "tool"), ("assistant", "function_call"))[(n - first) % 2]
        if alternate and roles[tag] not in expected:
            wanted = "a user or observation" if expected[0] == "user" else "an assistant or function call"
            raise ValueError(f"{key}[{n}]: {tag!r} where {wanted} turn belongs; sharegpt turns alternate user "
                             f"(or observation) and assistant (or function call) after an optional leading system turn")
        messages.append(_turn(roles[tag], turns[n][content_key], f"{key}[{n}]"))
    if alternate and (len(turns) - first) % 2:
        raise ValueError(f"'{key}' has an odd number of turns ({len(turns) - first}"
                         f"{' after the system turn' if first else ''}); a sharegpt conversation ends with an "
                         f"assistant or function call turn")
    return messages


def _turn(role: str, content: Any, where: str) -> dict:
    """A function call becomes an assistant turn with `tool_calls`, so the chat template writes the call its way."""
    if role != "function_call":
        return {"role": role, "content": content}
    return {"role": "assistant", "content": "", "tool_calls": _tool_calls(content, where)}


def _tool_calls(text: Any, where: str) -> list[dict]:
    """LLaMA-Factory's function call value: JSON text of {"name", "arguments"} or of a list of them."""
    shape = 'write {"name": ..., "arguments": {...}} or a list of them'
    if not isinstance(text, str):
        raise ValueError(f"{where}: a function call must be JSON text, got {type(text).__name__}; {shape}")
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: function call is not valid JSON ({e.msg} at column {e.colno}); {shape}") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c
                            for c in calls):
        raise ValueError(f"{where}: a function call needs a 'name' (a string) and 'arguments'; {shape}")
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def _tools(record: dict, column: str | None) -> list[dict] | None:
    """The function schemas a record offers, from JSON text (as LLaMA-Factory's files hold them) or a list;
    none ("", "[]", absent) is None."""
    value = record.get(column) if column else None
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"'{column}' is not valid JSON ({e.msg} at column {e.colno}); it must be a list of "
                             "function schemas, as JSON text or as a list") from None
    if not (isinstance(value, list) and all(isinstance(tool, dict) for tool in value)):
        raise ValueError(f"'{column}' must be a list of function schemas (objects), got {type(value).__name__}")
    return value or None


def _from_openai(record: dict) -> list[dict]:
    """OpenAI chat `messages`; content is a string or a list of text parts (concatenated as written). An assistant
    message that calls tools has `tool_calls` (its content may be null); its calls are trained as the template
    writes them."""
    raw = record.get("messages")
    if not isinstance(raw, list):
        raise ValueError("'messages' must be a list of {role, content} objects")
    messages = []
    for n, msg in enumerate(raw):
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        if not (isinstance(msg, dict) and "role" in msg and ("content" in msg or calls)):
            raise ValueError(f"messages[{n}] must be an object with 'role' and 'content' (or an assistant's "
                             f"'tool_calls')")
        content = msg.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, n)
        if not calls:
            messages.append({"role": msg["role"], "content": content})
            continue
        if msg["role"] != "assistant":
            raise ValueError(f"messages[{n}]: a {msg['role']!r} message has tool_calls; only an assistant's may")
        messages.append({"role": "assistant", "content": "" if content is None else content,
                         "tool_calls": _openai_calls(calls, f"messages[{n}].tool_calls")})
    return messages


def _openai_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI's `[{"type": "function", "function": {"name", "arguments": JSON text}}]` as the calls chat templates
    write: {"name", "arguments"}, the arguments parsed (a template writes them as JSON itself)."""
    shape = 'write [{"type": "function", "function": {"name": ..., "arguments": "{...}"}}]'
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of calls; {shape}")
    parsed = []
    for n, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and "arguments" in function):
            raise ValueError(f"{where}[{n}] needs a 'function' with a 'name' (a string) and 'arguments'; {shape}")
        arguments = function["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}[{n}]: arguments are not valid JSON ({e.msg} at column {e.colno}); "
                                 f"{shape}") from None
        parsed.append({"name": function["name"], "arguments": arguments})
    return parsed


def _join_text_parts(parts: list, n: int) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{n}]: content part of type {kind!r} is not supported; only text parts are")
        texts.append(part["text"])
    return "".join(texts)


def _validate(messages: list[dict]) -> None:
    """Reject what would train on nothing or render ambiguously under a chat template."""
    if not messages:
        raise ValueError("conversation is empty")
    for n, msg in enumerate(messages):
        if msg["role"] not in ROLES:
            raise ValueError(f"message {n}: unknown role {msg['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(msg["content"], str):
            kind = type(msg["content"]).__name__
            raise ValueError(f"message {n} ({msg['role']}): content must be a string, got {kind}")
        if msg["role"] == "system" and n > 0:
            raise ValueError(f"message {n}: a system message may only come first")
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        raise ValueError("no assistant message with content, so nothing to train on")


@dataclass
class FileRead:
    """One data file as it was read."""

    path: Path
    fmt: str | None  # the format its records were read in: dataset_format's or the one detected (None: no record)
    records: int  # records in the file
    read: int  # of them read: max_samples keeps the first N of each dataset


@dataclass
class Conversations:
    """What the datasets hold: every usable conversation with the tools it offers and where it came from, the
    records skipped, and each file read."""

    conversations: list[list[dict]]
    tools: list[list[dict] | None]  # the function schemas each conversation offers, or None
    sources: list[str]  # "path: record N" (numbered from 1; with the line in JSONL), one per conversation
    skipped: list[str]  # "path: record N: problem" of each malformed record skipped (skip_invalid)
    files: list[FileRead] = field(default_factory=list)  # in reading order; none past max_samples


def read_dataset(datasets: list[DatasetSpec | Path], fmt: str | None = None, skip_invalid: bool = False,
                 max_samples: int | None = None) -> Conversations:
    """Read all datasets into conversations; a plain path is one file read with `fmt` (None: detected from its
    records).

    `max_samples`: only the first N records of each dataset are read, counted before any is skipped, as
    LLaMA-Factory selects them. A bad record stops the run by default (silently training on less data than
    intended is worse); records are numbered from 1 in file order, and JSONL records name their line too.
    """
    specs = [d if isinstance(d, DatasetSpec) else file_spec(d, fmt) for d in datasets]
    if not specs:
        raise DataError("no dataset files given; list at least one .json or .jsonl file")
    for spec in specs:
        if spec.fmt is not None and spec.fmt not in FORMATS:
            raise DataError(f"unknown dataset_format '{spec.fmt}'; use auto or one of {', '.join(FORMATS)}")
    read = Conversations([], [], [], [])
    for spec, path, located, records in dataset_files(specs, skip_invalid, max_samples):
        file_fmt = (spec.fmt or detect_format([r for r, _ in records], path)) if records else spec.fmt
        convert_one = partial(convert, fmt=file_fmt, spec=spec)
        for messages, tools in converted(read, path, located, records, file_fmt, convert_one, skip_invalid,
                                         spec.label(file_fmt)):
            read.conversations.append(messages)
            read.tools.append(tools)
    if not read.conversations:
        raise nothing_usable(specs, read.skipped, "record", "check the files and their format")
    return read


Located = list[tuple[Any, str]]  # a file's records, each with where it is (located_records)


def dataset_files(specs: list[DatasetSpec], skip_invalid: bool, max_samples: int | None,
                  locate: Callable[[DatasetSpec, Path, bool], Located] | None = None
                  ) -> Iterator[tuple[DatasetSpec, Path, Located, Located]]:
    """Each file of the datasets in order, with all its records and those to read: `max_samples` keeps the first N
    records of each dataset, counted before any is skipped, and a file past them is not opened. `locate(spec, path,
    keep_unparseable)` finds a file's records (default: located_records); an unparseable record is kept for
    `skip_invalid` to skip."""
    for spec in specs:
        left = max_samples
        for path in spec.files:
            if left == 0:
                break
            path = Path(path)
            located = (locate(spec, path, skip_invalid) if locate is not None
                       else located_records(path, keep_unparseable=skip_invalid))
            records = located[:left]
            left = None if left is None else left - len(records)
            yield spec, path, located, records


class Bookkeeping(Protocol):
    """What a reader collects beside its samples: where each came from, the records skipped, each file read."""

    sources: list[str]
    skipped: list[str]
    files: list[FileRead]


def converted(read: Bookkeeping, path: Path, located: Located, records: Located, fmt: str | None,
              convert_one: Callable[[Any], T], skip_invalid: bool, rules: str) -> list[T]:
    """Each record of a file converted, its source (`path: record N`) noted in `read.sources`, and the file in
    `read.files`.

    A record `convert_one` rejects (ValueError) stops the read naming the file, the record, the problem and the
    `rules` it was read by; with `skip_invalid` it is noted in `read.skipped` and left out."""
    out = []
    for record, where in records:
        try:
            out.append(convert_one(record))
        except ValueError as e:
            if not skip_invalid:
                raise DataError(f"{path}: {where}: {e} ({rules}; records are numbered from 1). Fix the record, or set "
                                f"`skip_invalid: true` to skip such records") from None
            read.skipped.append(f"{path}: {where}: {e}")
            continue
        read.sources.append(f"{path}: {where}")
    read.files.append(FileRead(path, fmt, len(located), len(records)))
    return out


def nothing_usable(specs: list[DatasetSpec], skipped: list[str], what: str, hint: str) -> DataError:
    """The error of datasets that left nothing to train on."""
    names = ", ".join(str(path) for spec in specs for path in spec.files)
    return DataError(f"no usable {what} in {names} ({len(skipped)} invalid skipped); {hint}")

