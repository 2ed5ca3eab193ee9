"""Raw text for continued pre-training (`stage: pt`): documents -> samples in which every token trains.

A document is one record's text (its `text` field, or the prompt column a dataset_info.json entry names, as
LLaMA-Factory's `columns: {prompt: text}`), or one line of a .txt file, as LLaMA-Factory's text loader reads it. Each
document is tokenized as the tokenizer encodes plain text (its BOS where it adds one) and ends with the EOS token, so
the model learns where documents end. A document longer than cutoff_len is split, never dropped, into pieces of
cutoff_len tokens that overlap by one: the last token of a piece is the first of the next, so every token after the
document's first is a target exactly once. Pieces are samples of the usual tokenized cache (labels = input ids), so
packing puts several in a row with no attention across them, as it does conversations.
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
from meshtune.data.formats import (DatasetSpec, FileRead, Unparseable, converted, dataset_files, located_records,
                                   nothing_usable)
from meshtune.data.tokenized import EXAMPLES, FORMAT_VERSION, TokenizedDataset, cached, tokenizer_identity
from meshtune.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Documents:
    """What raw-text datasets hold: every document with where it came from, the records skipped, each file read."""

    texts: list[str]
    sources: list[str]  # "path: record N" or "path: line N", one per document
    skipped: list[str] = field(default_factory=list)  # "path: record N: problem" (skip_invalid)
    files: list[FileRead] = field(default_factory=list)


def located_documents(path: Path, column: str, keep_unparseable: bool) -> list[tuple[Any, str]]:
    """A file's documents with where each is: a .txt file's non-empty lines, or the records of a .json / .jsonl file
    (the text still inside each record: `document_text` takes it out and names what is wrong)."""
    if path.suffix.lower() != ".txt":
        return located_records(path, keep_unparseable)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; check the dataset paths in your config")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e}); re-save the file as UTF-8") from None
    return [({column: line}, f"line {n}") for n, line in enumerate(lines, start=1) if line.strip()]


def document_text(record: Any, column: str) -> str:
    """A record's document; ValueError saying what is wrong."""
    if isinstance(record, Unparseable):
        raise ValueError(record.problem)
    if not isinstance(record, dict):
        raise ValueError(f"expected an object with a '{column}' field, found {type(record).__name__}")
    if column not in record:
        raise ValueError(f"no '{column}' field (raw text for stage: pt is read from it); it has "
                         f"{', '.join(repr(k) for k in list(record)[:5]) or 'no fields'}")
    text = record[column]
    if not isinstance(text, str):
        raise ValueError(f"'{column}' must be a string, found {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"'{column}' is empty")
    return text


def _text_column(spec: DatasetSpec) -> str:
    return (spec.columns or {}).get("prompt") or "text"


def _located(spec: DatasetSpec, path: Path, keep_unparseable: bool) -> list[tuple[Any, str]]:
    return located_documents(path, _text_column(spec), keep_unparseable)


def read_documents(specs: list[DatasetSpec], skip_invalid: bool = False, max_samples: int | None = None) -> Documents:
    """Every document of the datasets, in order; `max_samples`: the first N records of each dataset."""
    read = Documents([], [])
    for spec, path, located, records in dataset_files(specs, skip_invalid, max_samples, locate=_located):
        convert_one = partial(document_text, column=_text_column(spec))
        read.texts += converted(read, path, located, records, "text", convert_one, skip_invalid,
                                "raw text for stage: pt")
    if not read.texts:
        raise nothing_usable(specs, read.skipped, "document", "check the files")
    return read


def document_ids(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The document's tokens as the tokenizer encodes plain text, then EOS."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token to end each document with; "
                        f"set eos_token in its tokenizer_config.json")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"]) + [tokenizer.eos_token_id]


def pieces(length: int, cutoff_len: int) -> list[slice]:
    """A document of `length` tokens as pieces of at most `cutoff_len`, each starting on the last token of the one
    before: every token after the first is the target of exactly one piece."""
    if length <= cutoff_len:
        return [slice(0, length)]
    step = cutoff_len - 1
    return [slice(start, min(start + cutoff_len, length)) for start in range(0, length - 1, step)]


def build_raw_text(documents: Documents, tokenizer: PreTrainedTokenizerBase, cutoff_len: int,
                   show_progress: bool) -> TokenizedDataset:
    """Each document's pieces as samples, every token labelled (collate's shift makes each the next one's target)."""
    parts: list[np.ndarray] = []
    record_index: list[int] = []
    full_lengths: list[int] = []
    n_split = 0
    for n, text in enumerate(tqdm(documents.texts, desc="tokenizing", unit="doc", disable=not show_progress)):
        ids = np.asarray(document_ids(text, tokenizer), dtype=np.int32)
        cuts = pieces(len(ids), cutoff_len)
        n_split += len(cuts) > 1
        for cut in cuts:
            parts.append(ids[cut])
            record_index.append(n)
            full_lengths.append(len(ids))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    input_ids = np.concatenate(parts)
    stats = {
        "n_records": len(documents.texts) + len(documents.skipped),
        "n_documents": len(documents.texts),
        "n_samples": len(parts),
        "n_split_documents": n_split,
        "n_dropped_no_target": 0,
        "n_truncated": 0,
        "n_tokens": int(offsets[-1]),
        "n_target_tokens": int(offsets[-1] - len(parts)),  # every token but each piece's first
        "n_skipped_invalid": len(documents.skipped),
        "dropped_examples": [],
        "skipped_examples": documents.skipped[:EXAMPLES],
    }
    return TokenizedDataset(input_ids, input_ids.copy(), offsets, stats, np.asarray(record_index, dtype=np.int64),
                            np.asarray(full_lengths, dtype=np.int64))


def raw_text_key(specs: list[DatasetSpec], tokenizer: PreTrainedTokenizerBase, cutoff_len: int, skip_invalid: bool,
                 max_samples: int | None) -> str:
    """Hash of every input that decides the raw-text samples."""
    digest = hashlib.sha256()
    for part in (f"v{FORMAT_VERSION}", "raw text", dataset_checksum(specs), tokenizer_identity(tokenizer),
                 str(cutoff_len), str(bool(skip_invalid)), str(max_samples)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load_or_build_raw_text(specs: list[DatasetSpec], tokenizer: PreTrainedTokenizerBase, *, cutoff_len: int,
                           skip_invalid: bool, cache_dir: Path, show_progress: bool,
                           max_samples: int | None = None) -> TokenizedDataset:
    """The raw-text samples from the shared tokenized cache, built by one process if none has yet."""
    key = raw_text_key(specs, tokenizer, cutoff_len, skip_invalid, max_samples)

    def build() -> TokenizedDataset:
        return build_raw_text(read_documents(specs, skip_invalid, max_samples), tokenizer, cutoff_len, show_progress)

    return cached(Path(cache_dir) / key, build, show_progress)
