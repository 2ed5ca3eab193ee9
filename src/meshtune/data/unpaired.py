"""Unpaired preference data for `stage: kto`: each sample a prompt, one response and whether the response is
desirable.

Records as people have them: LLaMA-Factory's sharegpt entries with a `kto_tag` column (kto_en_demo), OpenAI-style
`messages` with a `kto_tag` or `label` field, and TRL's `prompt` / `completion` / `label` (text, or lists of
messages). The response is the conversation's last assistant turn, earlier turns are its prompt; a text prompt is
one user turn, a text completion the assistant's. The conversation renders with the run's chat template exactly as
SFT renders it, only the response trained (its end-of-turn marker too).

Longer than `cutoff_len`, a sample keeps its response and loses the start of its prompt (TRL's `keep_end`
truncation); one whose response alone leaves no prompt token within cutoff_len is dropped. Both are counted for
the run's report. The samples are cached as SFT's are (data/tokenized.py), under a key of their own, with each
sample's tag beside it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.formats import (DatasetSpec, FileRead, Unparseable, convert, converted, dataset_files, detect_format,
                                   nothing_usable)
from meshtune.data.tokenized import TokenizedDataset, cache_key, cached, token_counts
from meshtune.errors import DataError

TAG_FIELDS = ("kto_tag", "label")  # a file given by path: the first of these a record has is its tag
TRL_FORMAT = "prompt/completion"  # TRL's unpaired records


@dataclass
class UnpairedRecords:
    """Every usable record as a conversation ending with the response judged, its tag and where it came from."""

    conversations: list[list[dict]] = field(default_factory=list)
    tools: list[list[dict] | None] = field(default_factory=list)
    desirable: list[bool] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # "path: record N"
    skipped: list[str] = field(default_factory=list)  # "path: record N: problem" (skip_invalid)
    files: list[FileRead] = field(default_factory=list)


def read_unpaired(specs: list[DatasetSpec], skip_invalid: bool = False,
                  max_samples: int | None = None) -> UnpairedRecords:
    """All records of the datasets; a bad one stops the run naming file, record and problem, or is skipped with
    `skip_invalid`. `max_samples`: the first N records of each dataset, as for SFT."""
    read = UnpairedRecords()
    for spec, path, located, records in dataset_files(specs, skip_invalid, max_samples):
        fmt = file_format(records, path, spec) if records else spec.fmt
        convert_one = partial(unpaired_record, fmt=fmt, spec=spec)
        for messages, tools, tag in converted(read, path, located, records, fmt, convert_one, skip_invalid,
                                              f"stage: kto, {spec.label(fmt)}"):
            read.conversations.append(messages)
            read.tools.append(tools)
            read.desirable.append(tag)
    if not read.conversations:
        raise nothing_usable(specs, read.skipped, "record", "check the files and their format")
    return read


def file_format(records: list[tuple[Any, str]], path: Path, spec: DatasetSpec) -> str:
    """The entry's formatting, TRL's prompt / completion records, or a conversation format detected."""
    if spec.fmt is not None:
        return spec.fmt
    first = next((r for r, _ in records if isinstance(r, dict)), None)
    if first is not None and "completion" in first:
        return TRL_FORMAT
    return detect_format([r for r, _ in records], path)


def unpaired_record(record: Any, fmt: str, spec: DatasetSpec) -> tuple[list[dict], list[dict] | None, bool]:
    """(conversation ending with the response, tools, desirable); ValueError with the problem."""
    if isinstance(record, Unparseable):
        raise ValueError(record.problem)
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {type(record).__name__}, not an object")
    if fmt == TRL_FORMAT:
        messages, tools, keys = trl_conversation(record), None, ("label",)
    else:
        messages, tools = convert(record, fmt, spec)
        named = (spec.columns or {}).get("kto_tag")  # a registry entry's kto_tag column
        keys = (named,) if named else TAG_FIELDS
    key = next((k for k in keys if k in record), None)
    if key is None:
        raise ValueError(f"no {' or '.join(repr(k) for k in keys)}: each record says whether its response is "
                         f"desirable (true) or not (false)")
    tag = record[key]
    if not isinstance(tag, bool):
        raise ValueError(f"'{key}' is {tag!r}, not a boolean: write true (a desirable response) or false")
    last = messages[-1]
    if last["role"] != "assistant":
        raise ValueError(f"the last turn is a {last['role']} turn; the response judged is the last assistant turn")
    if not (last["content"].strip() or last.get("tool_calls")):
        raise ValueError("the response (the last assistant turn) is empty")
    return messages, tools, tag


def trl_conversation(record: dict) -> list[dict]:
    """TRL's prompt and completion: text (one user turn, one assistant turn) or lists of {role, content}."""
    parts = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        if key not in record:
            raise ValueError(f"missing '{key}'")
        value = record[key]
        if isinstance(value, str):
            parts.append([{"role": role, "content": value}])
        elif isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                             isinstance(m.get("content"), str) for m in value):
            parts.append([{"role": m["role"], "content": m["content"]} for m in value])
        else:
            raise ValueError(f"'{key}' must be text or a list of {{role, content}} messages")
    prompt, completion = parts
    if not prompt:
        raise ValueError("'prompt' is empty")
    if [m["role"] for m in completion] != ["assistant"]:
        raise ValueError("'completion' must be one assistant message (the response judged)")
    return prompt + completion


def response_start(labels: np.ndarray) -> int:
    """Where the response begins: its first trained token (the labels mark the response only)."""
    return int(np.flatnonzero(labels != IGNORE_INDEX)[0])


def keep_response(ids: np.ndarray, labels: np.ndarray, cutoff_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A sample within cutoff_len: the response whole and the end of the prompt (the start cut, as TRL's
    keep_end); None when the response leaves no prompt token."""
    if len(ids) <= cutoff_len:
        return ids, labels
    if len(ids) - response_start(labels) >= cutoff_len:
        return None
    return ids[-cutoff_len:], labels[-cutoff_len:]


def build_unpaired(read: UnpairedRecords, template: ChatTemplate, cutoff_len: int,
                   show_progress: bool) -> TokenizedDataset:
    """Each record rendered and labelled as SFT renders its conversation with only the last assistant turn trained;
    cut or dropped by `keep_response`."""
    ids_parts, label_parts, record_index, full_lengths, desirable = [], [], [], [], []
    n_truncated, dropped = 0, []
    for n, messages in enumerate(tqdm(read.conversations, desc="tokenizing", unit="rec", disable=not show_progress)):
        try:
            encoded = template.encode_turns(messages, tools=read.tools[n])
        except DataError as e:
            raise DataError(f"{read.sources[n]}: {e}") from None
        ids = np.asarray(encoded.input_ids, dtype=np.int32)
        labels = np.asarray(encoded.labels, dtype=np.int32)
        kept = keep_response(ids, labels, cutoff_len)
        if kept is None:
            dropped.append(read.sources[n])
            continue
        n_truncated += len(kept[0]) < len(ids)
        ids_parts.append(kept[0])
        label_parts.append(kept[1])
        record_index.append(n)
        full_lengths.append(len(ids))
        desirable.append(read.desirable[n])
    if not ids_parts:
        raise DataError(f"every one of the {len(read.conversations)} responses is as long as cutoff_len={cutoff_len} "
                        f"tokens or longer, leaving no prompt; raise cutoff_len")
    offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in ids_parts], out=offsets[1:])
    labels_all = np.concatenate(label_parts)
    tags = np.asarray(desirable, dtype=np.bool_)
    stats = {
        "n_records": len(read.conversations),
        "n_samples": len(ids_parts),
        "n_desirable": int(tags.sum()),
        "n_undesirable": int((~tags).sum()),
        "n_dropped_long_response": len(dropped),
        "n_truncated": n_truncated,
        **token_counts(offsets, labels_all, read.skipped, dropped),
    }
    return TokenizedDataset(np.concatenate(ids_parts), labels_all, offsets, stats,
                            np.asarray(record_index, dtype=np.int64), np.asarray(full_lengths, dtype=np.int64),
                            desirable=tags)


def unpaired_template(tokenizer, template: str | None, default_system: str | None) -> ChatTemplate:
    """The run's chat template, only the last assistant turn (the response) trained."""
    return ChatTemplate(tokenizer, template, mask_history=True, default_system=default_system)


def load_or_build_unpaired(specs: list[DatasetSpec], tokenizer, *, template: str | None, cutoff_len: int,
                           skip_invalid: bool, cache_dir: Path, show_progress: bool, max_samples: int | None = None,
                           default_system: str | None = None) -> TokenizedDataset:
    """The cached unpaired dataset, built first by one process if none has yet; keyed apart from any SFT cache of
    the same files (the tag and the truncation differ)."""
    key = hashlib.sha256(("unpaired\0" + cache_key(specs, tokenizer, template, cutoff_len, skip_invalid, max_samples,
                                                   mask_history=True, default_system=default_system)).encode())

    def build() -> TokenizedDataset:
        read = read_unpaired(specs, skip_invalid=skip_invalid, max_samples=max_samples)
        return build_unpaired(read, unpaired_template(tokenizer, template, default_system), cutoff_len, show_progress)

    return cached(Path(cache_dir) / key.hexdigest(), build, show_progress)


def cut_reasons(cutoff_len: int) -> dict[str, str]:
    """Why build_unpaired cuts or drops samples and read_unpaired skips records, in `meshtune preview`'s words."""
    return {
        "truncated": f"longer than cutoff_len {cutoff_len:,} tokens after the chat template (the response kept "
                     f"whole, the prompt's start cut, as TRL's keep_end)",
        "dropped": f"with a response of cutoff_len {cutoff_len:,} tokens or more, which leaves no prompt (raise "
                   f"cutoff_len)",
        "skipped": "malformed, passed over (skip_invalid: true)",
    }
