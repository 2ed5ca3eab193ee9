"""Tokenize a dataset once, keep it on disk, and let every rank on every node map the same files.

Many processes start at once; exactly one tokenizes while the rest wait on a file lock, not on a collective,
so a long tokenization never trips a 30-minute NCCL timeout. The cache is published by renaming a finished
directory, so a crash mid-build can never leave a half cache that a later run reads.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from meshtune.checksums import dataset_checksum
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.formats import DatasetSpec, file_spec, read_dataset
from meshtune.data.truncation import kept_positions
from meshtune.errors import DataError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bump when the on-disk layout or the tokenization/masking rules change, so old caches are not reused.
FORMAT_VERSION = 4
_ARRAYS = ("input_ids", "labels", "offsets")
# per sample: which conversation it is, its length before cutoff_len; stage: kto also whether its response is
# desirable (data/unpaired.py)
_ORIGINS = ("record_index", "full_lengths", "desirable")


class TokenizedDataset:
    """Samples as flat arrays: sample i is `input_ids[offsets[i]:offsets[i+1]]` (labels likewise).

    Flat arrays load with mmap, so all ranks of a node share one copy in the page cache. `record_index[i]` is the
    conversation sample i was tokenized from (its place in `read_dataset`'s order, so `sources[record_index[i]]`)
    and `full_lengths[i]` its token count before cutoff_len cut it: `meshtune preview` names and measures samples
    by them. A dataset written without them (a benchmark's synthetic cache) has None. `desirable[i]`: unpaired
    preference data's tag of sample i (None for other data).
    """

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, stats: dict,
                 record_index: np.ndarray | None = None, full_lengths: np.ndarray | None = None,
                 desirable: np.ndarray | None = None) -> None:
        self.input_ids = input_ids
        self.labels = labels
        self.offsets = offsets
        self.stats = stats
        self.lengths = np.diff(offsets)
        self.record_index = record_index
        self.full_lengths = full_lengths
        self.desirable = desirable

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[start:end], self.labels[start:end]

    def save(self, directory: Path) -> None:
        """Write the arrays, then meta.json."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in _ARRAYS + _ORIGINS:
            if getattr(self, name) is not None:
                np.save(directory / f"{name}.npy", getattr(self, name))
        meta = {"format_version": FORMAT_VERSION, "stats": self.stats}
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> TokenizedDataset:
        """Memory-map a saved dataset (read-only)."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / "meta.json").read_text())
            arrays = [np.load(directory / f"{name}.npy", mmap_mode="r") for name in _ARRAYS]
            origins = [np.load(directory / f"{name}.npy", mmap_mode="r") if (directory / f"{name}.npy").is_file()
                       else None for name in _ORIGINS]
        except (OSError, ValueError) as e:
            raise DataError(f"{directory}: tokenized cache is unreadable ({e}); delete that directory") from None
        input_ids, labels, offsets = arrays
        consistent = len(input_ids) == len(labels) == offsets[-1] and all(
            len(origin) == len(offsets) - 1 for origin in origins if origin is not None)
        if meta.get("format_version") != FORMAT_VERSION or not consistent:
            raise DataError(f"{directory}: tokenized cache is inconsistent; delete that directory to rebuild it")
        return cls(input_ids, labels, offsets, meta["stats"], *origins)


EXAMPLES = 3  # records named in the report, of each kind


def build_tokenized(
    conversations: list[list[dict]],
    template: ChatTemplate,
    cutoff_len: int,
    show_progress: bool,
    *,
    sources: list[str] | None = None,
    skipped: list[str] | None = None,
    tools: list[list[dict] | None] | None = None,
) -> TokenizedDataset:
    """Encode each conversation (with the tools it offers, `tools[n]`), cut one longer than `cutoff_len` turn by
    turn as LLaMA-Factory does (data/truncation.py), and drop samples left with no target. `sources` (where each
    conversation came from) name the record in an error and, with `skipped` (malformed records passed over), go
    into the stats, a few of each by name, for the report."""
    ids_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray] = []
    record_index: list[int] = []
    full_lengths: list[int] = []
    n_truncated = 0
    dropped: list[str] = []
    for n, messages in enumerate(tqdm(conversations, desc="tokenizing", unit="rec", disable=not show_progress)):
        source = sources[n] if sources else f"conversation {n + 1}"
        try:
            encoded = template.encode_turns(messages, tools=tools[n] if tools else None)
        except DataError as e:
            raise DataError(f"{source}: {e}") from None
        ids_arr = np.asarray(encoded.input_ids, dtype=np.int32)
        labels_arr = np.asarray(encoded.labels, dtype=np.int32)
        cut = len(ids_arr) > cutoff_len
        if cut:  # each turn's prompt and response shortened as LLaMA-Factory does; mask_history: the last turn first
            kept = kept_positions(encoded.turns, encoded.suffix, cutoff_len, template.mask_history)
            ids_arr, labels_arr = ids_arr[kept], labels_arr[kept]
        if not (labels_arr != IGNORE_INDEX).any():  # dropped, not counted as truncated too
            dropped.append(source)
            continue
        n_truncated += cut
        record_index.append(n)
        full_lengths.append(len(encoded.input_ids))
        ids_parts.append(ids_arr)
        label_parts.append(labels_arr)
    if not ids_parts:
        raise DataError(
            f"none of the {len(conversations)} conversations has an assistant token within the first "
            f"cutoff_len={cutoff_len} tokens; raise cutoff_len"
        )
    offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in ids_parts], out=offsets[1:])
    labels_all = np.concatenate(label_parts)
    stats = {
        "n_records": len(conversations),
        "n_samples": len(ids_parts),
        "n_dropped_no_target": len(dropped),
        "n_truncated": n_truncated,
        **token_counts(offsets, labels_all, skipped or [], dropped),
    }
    return TokenizedDataset(np.concatenate(ids_parts), labels_all, offsets, stats,
                            np.asarray(record_index, dtype=np.int64), np.asarray(full_lengths, dtype=np.int64))


def cut_reasons(cutoff_len: int, mask_history: bool) -> dict[str, str]:
    """Why build_tokenized truncates or drops samples and read_dataset skips records, in the words `meshtune
    preview` puts after their count."""
    order = "the last turn first: mask_history" if mask_history else "turns in order"
    return {
        "truncated": f"longer than cutoff_len {cutoff_len:,} tokens after the chat template (cut as LLaMA-Factory "
                     f"cuts them: {order}, each turn's prompt and response shortened to share what is left)",
        "dropped": f"with no trained token left in the {cutoff_len:,} tokens kept (raise cutoff_len or shorten the "
                   f"prompts)",
        "skipped": "malformed, passed over (skip_invalid: true)",
    }


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """Everything about the tokenizer that can change token ids or rendered text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None:
        vocab = backend.to_str()
    else:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = {
        "class": type(tokenizer).__name__,
        "chat_template": tokenizer.chat_template,
        "special_tokens_map": tokenizer.special_tokens_map,
        "all_special_tokens": sorted(tokenizer.all_special_tokens),
    }
    return vocab + json.dumps(extra, sort_keys=True, default=str)


def token_counts(offsets: np.ndarray, labels: np.ndarray, skipped: list[str], dropped: list) -> dict[str, Any]:
    """The counts every builder's stats end with: tokens, target tokens, records skipped, and examples of both."""
    return {"n_tokens": int(offsets[-1]), "n_target_tokens": int((labels != IGNORE_INDEX).sum()),
            "n_skipped_invalid": len(skipped), "dropped_examples": dropped[:EXAMPLES],
            "skipped_examples": skipped[:EXAMPLES]}


def cache_key(
    datasets: list[DatasetSpec],
    tokenizer: PreTrainedTokenizerBase,
    template_name: str | None,
    cutoff_len: int,
    skip_invalid: bool,
    max_samples: int | None = None,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    default_system: str | None = None,
) -> str:
    """Hash of every input that determines the tokenized arrays; a change in any of them means a new cache.
    The datasets count by the checksum the nodes compare: their files' bytes and how they are read (format,
    columns, tags), not the dataset_info.json around them, so editing another entry there keeps the cache."""
    digest = hashlib.sha256()
    for part in (
        f"v{FORMAT_VERSION}",
        dataset_checksum(datasets),
        tokenizer_identity(tokenizer),
        template_name or "",  # None: the tokenizer's own, else ChatML
        # the format itself (a changed built-in one re-tokenizes), with default_system's prompt in it
        ChatTemplate(tokenizer, template_name, default_system=default_system).jinja or "",
        str(cutoff_len),
        str(bool(skip_invalid)),
        str(max_samples),
        *(["train_on_prompt"] if train_on_prompt else []),  # only when set: caches of runs without them stay valid
        *(["mask_history"] if mask_history else []),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load_or_build(
    datasets: list[DatasetSpec | Path],
    tokenizer: PreTrainedTokenizerBase,
    *,
    fmt: str | None = None,
    template: str | None,
    cutoff_len: int,
    skip_invalid: bool,
    cache_dir: Path,
    show_progress: bool,
    max_samples: int | None = None,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    default_system: str | None = None,
) -> TokenizedDataset:
    """Return the cached tokenized dataset, building it first if no process has yet. A plain path is one file
    read with `fmt` (None: detected from its records); `template` as ChatTemplate takes it (None: the tokenizer's
    own, else ChatML); `max_samples` keeps the first N records of each dataset; `train_on_prompt` and
    `mask_history` decide the labels, `default_system` the system prompt of a conversation without one
    (ChatTemplate).

    Safe to call from every rank of every node at once, with `cache_dir` local or on a shared filesystem
    that supports flock (NFSv4 does; Lustre needs the `flock` mount option).
    """
    cache_dir = Path(cache_dir)
    specs = [d if isinstance(d, DatasetSpec) else file_spec(d, fmt) for d in datasets]
    masking = {"train_on_prompt": train_on_prompt, "mask_history": mask_history, "default_system": default_system}
    key = cache_key(specs, tokenizer, template, cutoff_len, skip_invalid, max_samples, **masking)

    def build() -> TokenizedDataset:
        read = read_dataset(specs, skip_invalid=skip_invalid, max_samples=max_samples)
        return build_tokenized(read.conversations, ChatTemplate(tokenizer, template, **masking), cutoff_len,
                               show_progress, sources=read.sources, skipped=read.skipped, tools=read.tools)

    return cached(cache_dir / key, build, show_progress)


def cached(final: Path, build: Callable[[], TokenizedDataset], show_progress: bool) -> TokenizedDataset:
    """The dataset cached at `final`, built first by `build` if no process has yet: one process builds under a file
    lock while the others wait on it."""
    if (final / "meta.json").is_file():
        return TokenizedDataset.load(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f"{final.name}.lock"
    with open(lock_path, "a") as lock:  # closing the file releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if show_progress:
                logger.info(f"waiting for another process to tokenize the dataset (lock: {lock_path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "meta.json").is_file():  # the process we waited for may have built it
            _build_into(final, build)
    return TokenizedDataset.load(final)


def _build_into(final: Path, build: Callable[[], TokenizedDataset]) -> None:
    """Build under the lock into a private tmp dir, then publish it with one atomic rename."""
    for leftover in final.parent.glob(f"{final.name}.tmp-*"):  # only a crashed builder leaves these
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        dataset = build()
        dataset.save(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
