"""Preference pairs for `stage: dpo`: a prompt with a chosen and a rejected response, as people have them.

Read from LLaMA-Factory's `ranking: true` entries (alpaca: instruction / input / chosen / rejected; sharegpt: the
conversation before the responses, then a chosen and a rejected turn), TRL's `prompt` / `chosen` / `rejected` (plain
text, or message lists; without `prompt`, the chosen and rejected conversations' common start is the prompt, as TRL
extracts it) and OpenAI-style `messages` with a chosen and a rejected reply. Each response is rendered after the
prompt with the run's chat template, so the prompt's tokens are exactly those SFT trains beside, and only the
response (its last assistant turn with its end-of-turn marker) is labelled.

Both sequences of pair i are samples 2i (chosen) and 2i + 1 (rejected) of the usual tokenized cache; `Pairs` shows
them as one unit, so the sampler, the ranks and the held-out split always keep a pair together. A sequence longer than
cutoff_len keeps its response and cuts the prompt from the left (TRL's truncation_mode keep_end); a pair whose
longer response does not fit with one prompt token is dropped, and the run says how many of each.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from meshtune.checksums import dataset_checksum
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.formats import (FILE_COLUMNS, DatasetSpec, FileRead, Unparseable, convert, converted, dataset_files,
                                   nothing_usable)
from meshtune.data.tokenized import FORMAT_VERSION, TokenizedDataset, cached, token_counts, tokenizer_identity
from meshtune.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAIR_FORMATS = ("alpaca", "sharegpt", "trl", "messages")
_RESPONSE = "\0response"  # where a response is put in a record copy for formats.convert to read it


@dataclass
class PairRecords:
    """Every usable pair: the prompt conversation, the chosen and the rejected assistant turn, the tools offered and
    where it came from; the records skipped; each file read."""

    prompts: list[list[dict]] = field(default_factory=list)
    chosen: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    tools: list[list[dict] | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    files: list[FileRead] = field(default_factory=list)


def detect_pair_format(records: list[Any], path: Path) -> str:
    """A file's pair format from its first record."""
    first = next((r for r in records if isinstance(r, dict)), None)
    if first is None:
        raise DataError(f"{path}: no JSON object records found; each record must be an object {{...}}")
    if "conversations" in first:
        return "sharegpt"
    if "instruction" in first:
        return "alpaca"
    if "messages" in first:
        return "messages"
    if "prompt" in first or "chosen" in first:
        return "trl"
    raise DataError(f"{path}: cannot tell the preference-pair format from the first record (keys: "
                    f"{', '.join(sorted(first))}); stage: dpo reads LLaMA-Factory's ranking data (alpaca: "
                    f"instruction / input / chosen / rejected; sharegpt: conversations / chosen / rejected), TRL's "
                    f"prompt / chosen / rejected, or messages / chosen / rejected")


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _reply(value: Any, key: str, spec: DatasetSpec | None, fmt: str) -> dict:
    """One response as an assistant turn: text, a sharegpt turn, an OpenAI message, or a list ending with one."""
    if isinstance(value, list):  # TRL's conversational form: a list holding the assistant message
        if not value:
            raise ValueError(f"'{key}' is empty")
        value = value[-1]
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise ValueError(f"'{key}' must be text or an assistant turn, got {type(value).__name__}")
    if fmt == "sharegpt":  # LLaMA-Factory's turn, by the entry's tags
        tags = spec.tags if spec is not None and spec.tags else {"role_tag": "from", "content_tag": "value",
                                                                  "assistant_tag": "gpt"}
        role, content = value.get(tags["role_tag"]), value.get(tags["content_tag"])
        if role not in (tags.get("assistant_tag"), "assistant", tags.get("function_tag")):
            raise ValueError(f"'{key}' must be an assistant ({tags.get('assistant_tag')}) turn, found {role!r}")
        return {"role": "assistant", "content": _text(content, key)}
    if value.get("role", "assistant") != "assistant":
        raise ValueError(f"'{key}' must be an assistant message, found role {value.get('role')!r}")
    return {"role": "assistant", "content": _text(value.get("content"), key)}


def _messages(value: Any, key: str) -> list[dict]:
    """TRL's prompt: text (one user turn) or a list of messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be text or a list of messages, got {type(value).__name__}")
    if not value:
        return []
    answer = {"role": "assistant", "content": "x"}  # formats.convert validates a conversation with an answer
    messages = convert({"messages": [*value, answer]}, "messages")[0][:-1]
    return messages if value[-1].get("role") != "assistant" else [*messages, convert({"messages": value},
                                                                                         "messages")[0][-1]]


def _prompt(record: dict, fmt: str, spec: DatasetSpec | None, chosen_key: str) -> tuple[list[dict], list | None]:
    """The prompt conversation and the tools it offers, read as formats.convert reads the SFT formats (with the
    chosen response standing in for the answer, then taken off)."""
    columns = dict(spec.columns) if spec is not None and spec.columns is not None else dict(FILE_COLUMNS.get(fmt, {}))
    if fmt == "alpaca":
        columns["response"] = _RESPONSE
        messages, tools = convert({**record, _RESPONSE: "x"}, fmt, DatasetSpec("", [], fmt, columns))
        return messages[:-1], tools
    if fmt == "sharegpt":
        key = columns["messages"]
        turns = record.get(key)
        if not isinstance(turns, list):
            raise ValueError(f"'{key}' must be a list of turns")
        tags = spec.tags if spec is not None and spec.tags else None
        role_key, content_key = (tags["role_tag"], tags["content_tag"]) if tags else ("from", "value")
        answer = {role_key: (tags or {}).get("assistant_tag") or "gpt", content_key: "x"}
        messages, tools = convert({**record, key: [*turns, answer]}, fmt, DatasetSpec("", [], fmt, columns, tags))
        return messages[:-1], tools
    if fmt == "messages":
        messages, tools = convert({**record, "messages": [*record.get("messages", []),
                                                          {"role": "assistant", "content": "x"}]}, fmt)
        return messages[:-1], tools
    if "prompt" in record:
        return _messages(record["prompt"], "prompt"), None
    return [], None  # TRL's implicit prompt: the common start of the chosen and rejected conversations


def convert_pair(record: Any, fmt: str, spec: DatasetSpec | None = None
                 ) -> tuple[list[dict], dict, dict, list[dict] | None]:
    """One record → (prompt conversation, chosen turn, rejected turn, tools). ValueError says what is wrong."""
    if isinstance(record, Unparseable):
        raise ValueError(record.problem)
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {type(record).__name__}, not an object")
    columns = spec.columns if spec is not None and spec.columns is not None else {}
    keys = {name: columns.get(name) or name for name in ("chosen", "rejected")}
    for name, key in keys.items():
        if key not in record:
            raise ValueError(f"no '{key}' field: a preference pair needs a chosen and a rejected response")
    prompt, tools = _prompt(record, fmt, spec, keys["chosen"])
    chosen_value, rejected_value = record[keys["chosen"]], record[keys["rejected"]]
    if fmt == "trl" and "prompt" not in record:
        if not (isinstance(chosen_value, list) and isinstance(rejected_value, list)):
            raise ValueError("no 'prompt' field, and chosen / rejected are not conversations whose common start is "
                             "the prompt; add 'prompt'")
        full_chosen = _messages(chosen_value, keys["chosen"])
        full_rejected = _messages(rejected_value, keys["rejected"])
        shared = 0
        while (shared < min(len(full_chosen), len(full_rejected)) - 1
               and full_chosen[shared] == full_rejected[shared]):
            shared += 1
        prompt = full_chosen[:shared]
        chosen_value, rejected_value = full_chosen[shared:], full_rejected[shared:]
    chosen = _reply(chosen_value, keys["chosen"], spec, fmt)
    rejected = _reply(rejected_value, keys["rejected"], spec, fmt)
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        raise ValueError("the prompt has no user turn with text")
    if prompt[-1]["role"] == "assistant":
        raise ValueError("the prompt ends with an assistant turn; the responses answer a user (or tool) turn")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply["content"].strip():
            raise ValueError(f"the {name} response ('{keys[name]}') is empty")
    if chosen["content"] == rejected["content"]:
        raise ValueError("the chosen and rejected responses are identical: the pair prefers nothing")
    return prompt, chosen, rejected, tools


def read_pairs(specs: list[DatasetSpec], skip_invalid: bool = False, max_samples: int | None = None) -> PairRecords:
    """Every pair of the datasets, in order; `max_samples`: the first N records of each dataset."""
    read = PairRecords()
    for spec, path, located, records in dataset_files(specs, skip_invalid, max_samples):
        fmt = spec.fmt or detect_pair_format([r for r, _ in records], path)  # dataset_format, else detected
        if fmt not in PAIR_FORMATS:
            raise DataError(f"{path}: dataset_format {fmt} holds no preference pairs; stage: dpo reads "
                            f"{', '.join(PAIR_FORMATS)} pairs (leave dataset_format auto)")
        convert_one, rules = partial(convert_pair, fmt=fmt, spec=spec), f"preference pairs, {spec.label(fmt)}"
        for prompt, chosen, rejected, tools in converted(read, path, located, records, fmt, convert_one, skip_invalid,
                                                         rules):
            read.prompts.append(prompt)
            read.chosen.append(chosen)
            read.rejected.append(rejected)
            read.tools.append(tools)
    if not read.prompts:
        raise nothing_usable(specs, read.skipped, "preference pair", "check the files")
    return read


def response_start(labels: np.ndarray) -> int:
    """Where the labelled response begins."""
    return int(np.argmax(labels != IGNORE_INDEX))


def build_pairs(read: PairRecords, template: ChatTemplate, cutoff_len: int, show_progress: bool) -> TokenizedDataset:
    """Each pair's chosen and rejected sequence, samples 2i and 2i + 1; the prompt cut from the left to fit."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    record_index: list[int] = []
    full_lengths: list[int] = []
    n_truncated, dropped = 0, []
    for n, prompt in enumerate(tqdm(read.prompts, desc="tokenizing", unit="pair", disable=not show_progress)):
        sequences = []
        for reply in (read.chosen[n], read.rejected[n]):
            try:
                encoded = template.encode_turns([*prompt, reply], tools=read.tools[n])
            except DataError as e:
                raise DataError(f"{read.sources[n]}: {e}") from None
            ids = np.asarray(encoded.input_ids, dtype=np.int32)
            labels = np.asarray(encoded.labels, dtype=np.int32)
            sequences.append((ids, labels, response_start(labels)))
        longest_response = max(len(ids) - start for ids, _, start in sequences)
        if longest_response + 1 > cutoff_len:  # no prompt token left to predict the response's first from
            dropped.append(read.sources[n])
            continue
        keep = cutoff_len - longest_response  # prompt tokens each sequence keeps at most, from its end
        cut = any(start > keep for _, _, start in sequences)
        n_truncated += cut
        for ids, labels, start in sequences:
            first = max(0, start - keep)
            parts.append((ids[first:], labels[first:]))
            record_index.append(n)
            full_lengths.append(len(ids))
    if not parts:
        raise DataError(f"none of the {len(read.prompts)} pairs fits cutoff_len={cutoff_len} tokens with its longer "
                        f"response and one prompt token; raise cutoff_len")
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids, _ in parts], out=offsets[1:])
    labels_all = np.concatenate([labels for _, labels in parts])
    stats = {
        "n_records": len(read.prompts) + len(read.skipped),
        "n_samples": len(parts) // 2,
        "n_pairs": len(parts) // 2,
        "n_dropped_no_target": 0,
        "n_dropped_too_long": len(dropped),
        "n_truncated": n_truncated,
        **token_counts(offsets, labels_all, read.skipped, dropped),
    }
    return TokenizedDataset(np.concatenate([ids for ids, _ in parts]), labels_all, offsets, stats,
                            np.asarray(record_index, dtype=np.int64), np.asarray(full_lengths, dtype=np.int64))


class Pairs:
    """A tokenized dataset of pairs seen as one unit a pair: `len` pairs, `lengths` both sequences' tokens (what a
    pair weighs in a micro-batch), `[i]` the pair's (chosen, rejected) sequences, each (input_ids, labels)."""

    def __init__(self, sequences: TokenizedDataset, cache_key: str | None = None):
        self.sequences = sequences
        self.cache_key = cache_key  # the tokenized cache's key: what a precomputed reference is keyed by
        self.stats = sequences.stats
        lengths = np.asarray(sequences.lengths)
        self.lengths = lengths[0::2] + lengths[1::2]
        self.record_index = None if sequences.record_index is None else np.asarray(sequences.record_index)[0::2]

    def __len__(self) -> int:
        return len(self.sequences) // 2

    def __getitem__(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        return self.sequences[2 * i], self.sequences[2 * i + 1]


def pairs_key(specs: list[DatasetSpec], tokenizer: PreTrainedTokenizerBase, template: ChatTemplate, cutoff_len: int,
              skip_invalid: bool, max_samples: int | None) -> str:
    """Hash of every input that decides the pairs' tokens; never that of an SFT or raw-text cache."""
    digest = hashlib.sha256()
    for part in (f"v{FORMAT_VERSION}", "preference pairs", dataset_checksum(specs), tokenizer_identity(tokenizer),
                 template.name or "", template.jinja or "", str(cutoff_len), str(bool(skip_invalid)),
                 str(max_samples)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load_or_build_pairs(specs: list[DatasetSpec], tokenizer: PreTrainedTokenizerBase, *, template: str | None,
                        cutoff_len: int, skip_invalid: bool, cache_dir: Path, show_progress: bool,
                        max_samples: int | None = None, default_system: str | None = None) -> Pairs:
    """The pairs from the shared tokenized cache, built by one process if none has yet."""
    chat = ChatTemplate(tokenizer, template, mask_history=True, default_system=default_system)
    key = pairs_key(specs, tokenizer, chat, cutoff_len, skip_invalid, max_samples)

    def build() -> TokenizedDataset:
        return build_pairs(read_pairs(specs, skip_invalid, max_samples), chat, cutoff_len, show_progress)

    return Pairs(cached(Path(cache_dir) / key, build, show_progress), key)
