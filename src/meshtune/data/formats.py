"""Read the dataset files users already have (LLaMA-Factory alpaca / sharegpt, Qwen finetune.py, OpenAI messages)
and turn every record into one conversation: a list of `{"role", "content"}` dicts.

Everything downstream (chat template, label masking, cache) sees only conversations, so a new record format
is one converter here and nothing else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from meshtune.errors import DataError

FORMATS = ("alpaca", "sharegpt", "qwen", "messages")
ROLES = ("system", "user", "assistant", "tool")
EXTENSIONS = (".json", ".jsonl")

# LLaMA-Factory's sharegpt tags; function calls are trained like any assistant turn, observations are tool output.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
}
QWEN_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

_FORMAT_HELP = (
    "supported: messages (OpenAI 'messages' list), sharegpt ('conversations' with from human/gpt), "
    "qwen ('conversations' with from user/assistant), alpaca ('instruction'/'input'/'output')"
)


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


def to_messages(record: Any, fmt: str) -> list[dict]:
    """Convert one record of format `fmt` into a validated conversation.

    Raises ValueError with a short problem text; the caller knows the file and record index and adds them.
    """
    if isinstance(record, Unparseable):
        raise ValueError(record.problem)
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {type(record).__name__}, not an object")
    converters: dict[str, Callable[[dict], list[dict]]] = {
        "alpaca": _from_alpaca,
        "sharegpt": lambda r: _from_conversations(r, SHAREGPT_ROLES),
        "qwen": lambda r: _from_conversations(r, QWEN_ROLES),
        "messages": _from_openai,
    }
    if fmt not in converters:
        raise ValueError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    messages = converters[fmt](record)
    _validate(messages)
    return messages


def _from_alpaca(record: dict) -> list[dict]:
    """As LLaMA-Factory: instruction and input joined by a newline, `history` pairs become earlier turns."""
    for key in ("instruction", "output"):
        if key not in record:
            raise ValueError(f"missing '{key}'")
    for key in ("instruction", "input", "output", "system"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise ValueError(f"'{key}' must be a string, got {type(record[key]).__name__}")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": record["system"]})
    history = record.get("history") or []
    if not isinstance(history, list):
        raise ValueError("'history' must be a list of [query, response] pairs")
    for n, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(f"history[{n}] must be a [query, response] pair")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = "\n".join(part for part in (record["instruction"], record.get("input")) if part)
    messages += [{"role": "user", "content": query}, {"role": "assistant", "content": record["output"]}]
    return messages


def _from_conversations(record: dict, roles: dict[str, str]) -> list[dict]:
    """sharegpt (LLaMA-Factory) and Qwen finetune.py: `conversations` of {from, value}. A record-level `system`
    is used unless the conversation starts with its own, as LLaMA-Factory does; `tools` is accepted and unused."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise ValueError("'conversations' must be a list of {from, value} objects")
    messages = []
    for n, turn in enumerate(turns):
        if not (isinstance(turn, dict) and "from" in turn and "value" in turn):
            raise ValueError(f"conversations[{n}] must be an object with 'from' and 'value'")
        if not isinstance(turn["from"], str) or turn["from"] not in roles:
            known = ", ".join(roles)
            raise ValueError(f"conversations[{n}]: unknown 'from' value {turn['from']!r}; use one of {known}")
        messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    starts_with_system = bool(messages) and messages[0]["role"] == "system"
    if record.get("system") and not starts_with_system:
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def _from_openai(record: dict) -> list[dict]:
    """OpenAI chat `messages`; content is a string or a list of text parts (concatenated as written)."""
    raw = record.get("messages")
    if not isinstance(raw, list):
        raise ValueError("'messages' must be a list of {role, content} objects")
    messages = []
    for n, msg in enumerate(raw):
        if not (isinstance(msg, dict) and "role" in msg and "content" in msg):
            raise ValueError(f"messages[{n}] must be an object with 'role' and 'content'")
        content = msg["content"]
        if isinstance(content, list):
            content = _join_text_parts(content, n)
        messages.append({"role": msg["role"], "content": content})
    return messages


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
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError("no assistant message with content, so nothing to train on")


@dataclass
class Conversations:
    """What the dataset files hold: every usable conversation with where it came from, and the records skipped."""

    conversations: list[list[dict]]
    sources: list[str]  # "path: record N" (numbered from 1; with the line in JSONL), one per conversation
    skipped: list[str]  # "path: record N: problem" of each malformed record skipped (skip_invalid)


def read_dataset(paths: list[Path], fmt: str = "auto", skip_invalid: bool = False) -> Conversations:
    """Read all files into conversations.

    A bad record stops the run by default (silently training on less data than intended is worse); records are
    numbered from 1 in file order, and JSONL records name their line too.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"unknown dataset_format '{fmt}'; use auto or one of {', '.join(FORMATS)}")
    if not paths:
        raise DataError("no dataset files given; list at least one .json or .jsonl file")
    read = Conversations([], [], [])
    for path in paths:
        records = located_records(path, keep_unparseable=skip_invalid)
        if not records:
            continue
        file_fmt = detect_format([r for r, _ in records], path) if fmt == "auto" else fmt
        for record, where in records:
            try:
                read.conversations.append(to_messages(record, file_fmt))
                read.sources.append(f"{path}: {where}")
            except ValueError as e:
                if not skip_invalid:
                    raise DataError(
                        f"{path}: {where}: {e} (format {file_fmt}; records are numbered from 1). "
                        "Fix the record, or set `skip_invalid: true` to skip such records"
                    ) from None
                read.skipped.append(f"{path}: {where}: {e}")
    if not read.conversations:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"no usable record in {names} ({len(read.skipped)} invalid skipped); check the files and "
                        f"their format")
    return read


def dataset_checksum(paths: list[Path]) -> str:
    """sha256 of the files' bytes in order, so every node can check it trains on the same data."""
    digest = hashlib.sha256()
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: dataset file not found; check the dataset paths in your config")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
