"""`meshtune preview`: what training will see, read where training reads it.

The datasets go through `prepare_datasets`, the call the training loop makes, so the samples shown are rows of the
tokenized cache a run trains on (built here when no run has built it, and then reused by the run). A token counts as
trained when the loss has a target at its place: its label in the cache, except a sample's first token, which
collate's shift of the labels leaves without one. The report is one dict; the text and `--json` render it.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, TextIO

import numpy as np

from meshtune.config import TrainConfig
from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate
from meshtune.data.formats import Conversations, read_dataset
from meshtune.data.pairs import Pairs, read_pairs
from meshtune.data.pipeline import cache_dir, examples, prepare_datasets
from meshtune.data.raw_text import Documents, read_documents
from meshtune.data.registry import resolve
from meshtune.data.sampler import pack_rows, permutation
from meshtune.data.split import Subset
from meshtune.data.tokenized import TokenizedDataset, cut_reasons
from meshtune.data.unpaired import cut_reasons as unpaired_cut_reasons
from meshtune.data.unpaired import read_unpaired, unpaired_template
from meshtune.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"  # around trained text
TARGET_MARK = "→"  # ⟦→x⟧: the loss trains x where the input has another token (written after the mark)
BOUNDARY = "¦"  # raw text: where a packed row passes from one document (or piece of one) to the next
GREEN, RESET = "\x1b[32m", "\x1b[0m"


def use_color(mode: str, stream: TextIO) -> bool:
    """`--color` (a command-line option, no config key): auto colours only a terminal, so a pipe or a file gets
    plain text."""
    return {"always": True, "never": False, "auto": stream.isatty()}[mode]


def preview(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, samples: int = 3, indices: list[int] | None = None,
            seed: int | None = None, show_progress: bool = False) -> dict:
    """The report: template, datasets with their statistics, and the samples chosen (`indices`: positions in the
    tokenized training data; else `samples` of them, the first ones or, with `seed`, drawn at random)."""
    template = (unpaired_template(tokenizer, cfg.named_template, cfg.default_system) if cfg.stage == "kto" else
                ChatTemplate(tokenizer, cfg.named_template, train_on_prompt=cfg.train_on_prompt,
                             mask_history=cfg.mask_history, default_system=cfg.default_system))
    cache = cache_dir(cfg)
    cached_before = set(cache.glob("*/meta.json"))
    train, evaluation = prepare_datasets(cfg, tokenizer, show_progress=show_progress, report=False)
    full = train.dataset if isinstance(train, Subset) else train  # val_size holds some of the samples out
    held_out = set(evaluation.indices.tolist()) if isinstance(evaluation, Subset) else set()
    reasons = (pair_cut_reasons(cfg.cutoff_len) if cfg.stage == "dpo" else unpaired_cut_reasons(cfg.cutoff_len)
               if cfg.stage == "kto" else cut_reasons(cfg.cutoff_len, cfg.mask_history))
    read = {"pt": read_documents, "dpo": read_pairs, "kto": read_unpaired}.get(cfg.stage, read_dataset)
    train_sources = read(resolve(cfg.dataset, cfg.dataset_dir, cfg.named_format), skip_invalid=cfg.skip_invalid,
                         max_samples=cfg.max_samples)
    sequences = sequences_of(full)  # a pair's chosen and rejected sequences: two samples of the cache
    flags = trained_flags(sequences)
    datasets = {"train": dataset_report(cfg, cfg.dataset, sequences, flags, train_sources, reasons)}
    if held_out:
        datasets["train"]["held_out"] = {"count": len(held_out),
                                         "reason": f"for evaluation (val_size {cfg.val_size:g}), never trained"}
    if cfg.eval_dataset:
        eval_sources = read(resolve(cfg.eval_dataset, cfg.dataset_dir, cfg.named_format, "eval_dataset"),
                            skip_invalid=cfg.skip_invalid, max_samples=cfg.max_samples)
        eval_sequences = sequences_of(evaluation)
        datasets["eval"] = dataset_report(cfg, cfg.eval_dataset, eval_sequences, trained_flags(eval_sequences),
                                          eval_sources, reasons)
    chosen = choose(len(full), samples, indices, seed)
    report = {
        "template": {"name": template.name, "description": template.description, "trains": trains(cfg)},
        "settings": {key: getattr(cfg, key) for key in ("cutoff_len", "train_on_prompt", "mask_history", "packing",
                                                        "skip_invalid", "max_samples", "val_size")},
        "cache": {"dir": str(cache), "built": bool(set(cache.glob("*/meta.json")) - cached_before)},
        "datasets": datasets,
        "samples": [sample_report(full, flags, position, tokenizer, train_sources.sources, position in held_out)
                    for position in chosen] if not isinstance(full, Pairs) else
                   [pair_report(full, flags, position, tokenizer, train_sources.sources, position in held_out)
                    for position in chosen],
    }
    if cfg.stage == "pt":
        report["template"] = {"name": None, "description": "none: raw text (stage: pt)", "trains": trains(cfg)}
        report["rows"] = [] if indices is not None else raw_text_rows(cfg, train, samples, tokenizer, train_sources)
    return report


def sequences_of(data):
    """The tokenized samples behind a dataset: a pair's two sequences for preference pairs."""
    return data.sequences if isinstance(data, Pairs) else data


def pair_cut_reasons(cutoff_len: int) -> dict[str, str]:
    """Why data/pairs.py cuts or drops pairs, in the words `meshtune preview` puts after their count."""
    return {
        "truncated": f"with a sequence longer than cutoff_len {cutoff_len:,} tokens: the prompt cut from the left, "
                     f"both responses kept whole (TRL's truncation_mode keep_end)",
        "dropped": f"whose longer response does not fit cutoff_len {cutoff_len:,} with one prompt token",
        "skipped": "malformed, passed over (skip_invalid: true)",
    }


def pair_report(data: Pairs, flags: np.ndarray, position: int, tokenizer: PreTrainedTokenizerBase,
                sources: list[str], held_out: bool) -> dict:
    """A pair: its chosen and its rejected sequence, each with what the loss trains."""
    chosen, rejected = (sample_report(data.sequences, flags, 2 * position + side, tokenizer, sources, held_out)
                        for side in (0, 1))
    return {"position": position, "source": chosen["source"], "held_out": held_out, "chosen": chosen,
            "rejected": rejected}


def raw_text_rows(cfg: TrainConfig, train, count: int, tokenizer: PreTrainedTokenizerBase, read: Documents
                  ) -> list[dict]:
    """The first `count` rows of the first epoch as training makes them (packed: several pieces a row), each piece
    with its document and its place among that document's pieces."""
    order = permutation(len(train), cfg.seed, 0)
    rows = pack_rows(order, train.lengths, cfg.cutoff_len) if cfg.packing else [[i] for i in order]
    full = train.dataset if isinstance(train, Subset) else train
    position = (lambda i: int(train.indices[i])) if isinstance(train, Subset) else int  # noqa: E731
    report = []
    for row in rows[:max(count, 0)]:
        parts = []
        for i in row:
            at = position(i)
            document = int(full.record_index[at])
            first = int(np.searchsorted(full.record_index, document, side="left"))
            last = int(np.searchsorted(full.record_index, document, side="right"))
            ids = np.asarray(full[at][0], dtype=np.int64)
            parts.append({"position": at, "source": read.sources[document], "piece": at - first + 1,
                          "pieces": last - first, "tokens": len(ids),
                          "text": tokenizer.decode(ids, skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)})
        report.append({"tokens": sum(part["tokens"] for part in parts), "pieces": parts})
    return report


def trains(cfg: TrainConfig) -> str:
    """Which turns the labels train, in words (ChatTemplate.encode decides it)."""
    if cfg.stage == "pt":
        return "every token of the raw text, the EOS ending each document included"
    if cfg.stage == "dpo":
        return ("each response of a pair, chosen and rejected (the assistant turn after the prompt, with its "
                "end-of-turn); not the prompt")
    if cfg.stage == "kto":
        return ("each sample's response, its last assistant turn (text or tool calls and end-of-turn), toward or away "
                "from it as its tag says; not the prompt")
    if cfg.train_on_prompt:
        return "every turn, prompts too (train_on_prompt: true)"
    answers = "the last assistant turn (mask_history: true)" if cfg.mask_history else "each assistant turn"
    return f"{answers}: its text or tool calls and its end-of-turn; not system, user or tool turns"


def choose(n: int, samples: int, indices: list[int] | None, seed: int | None) -> list[int]:
    """Positions to show: as given (checked), the first `samples`, or `samples` drawn with `seed`."""
    if indices is not None:
        outside = [i for i in indices if not 0 <= i < n]
        if outside:
            raise ConfigError(f"--index {','.join(map(str, outside))}: the tokenized training data has {n:,} samples, "
                              f"numbered 0 to {n - 1:,}")
        return list(indices)
    if samples < 0:
        raise ConfigError(f"--samples {samples}: give a count of 0 or more")
    if seed is None:
        return list(range(min(samples, n)))
    return sorted(random.Random(seed).sample(range(n), min(samples, n)))


def distribution(values: np.ndarray) -> dict:
    """min / median / p95 / max; median and p95 interpolated as numpy.percentile does."""
    values = np.asarray(values)
    return {"min": int(values.min()), "median": float(np.median(values)), "p95": float(np.percentile(values, 95)),
            "max": int(values.max())}


def trained_flags(data: TokenizedDataset) -> np.ndarray:
    """Over the dataset's flat token array: True where the loss has a target. A batch's targets are each sample's
    labels shifted by one (collate.shifted_targets), so a sample's first token is never one, whatever its label."""
    trained = np.asarray(data.labels) != IGNORE_INDEX
    trained[np.asarray(data.offsets[:-1])] = False
    return trained


def dataset_report(cfg: TrainConfig, entries: list[str], data: TokenizedDataset, flags: np.ndarray,
                   read: Conversations | Documents, reasons: dict) -> dict:
    """Files, counts and token statistics of one tokenized dataset (`flags`: its trained_flags), and what
    cutoff_len and skip_invalid cut."""
    stats = data.stats
    trained = np.add.reduceat(flags, np.asarray(data.offsets[:-1]))  # per sample; no sample is empty
    if "n_pairs" in stats:  # preference pairs: two sequences a pair
        return {"entries": entries_report(entries, cfg, read), "records": stats["n_records"], "pairs": len(data) // 2,
                "samples": len(data), "tokens": int(data.lengths.sum()), "trained_tokens": int(trained.sum()),
                "tokens_per_sample": distribution(data.lengths),
                "tokens_before_cutoff": distribution(data.full_lengths), "trained_per_sample": distribution(trained),
                "truncated": {"count": stats["n_truncated"], "reason": reasons["truncated"]},
                "dropped": {"count": stats["n_dropped_too_long"], "reason": reasons["dropped"],
                            "examples": stats["dropped_examples"]},
                "skipped": {"count": stats["n_skipped_invalid"], "reason": reasons["skipped"],
                            "examples": stats["skipped_examples"]}}
    if "n_split_documents" in stats:  # raw text: documents split into pieces, none truncated or dropped
        return {"entries": entries_report(entries, cfg, read), "records": stats["n_records"], "samples": len(data),
                "documents": stats["n_documents"], "tokens": int(data.lengths.sum()),
                "trained_tokens": int(trained.sum()), "tokens_per_sample": distribution(data.lengths),
                "tokens_before_cutoff": distribution(data.full_lengths), "trained_per_sample": distribution(trained),
                "split": {"count": stats["n_split_documents"],
                          "reason": f"longer than cutoff_len {cfg.cutoff_len:,} tokens, split into pieces that "
                                    f"overlap by one token (none dropped)"},
                "skipped": {"count": stats["n_skipped_invalid"], "reason": reasons["skipped"],
                            "examples": stats["skipped_examples"]}}
    return {
        "entries": entries_report(entries, cfg, read),
        "records": stats["n_records"],
        "samples": len(data),
        "tokens": int(data.lengths.sum()),
        "trained_tokens": int(trained.sum()),
        "tokens_per_sample": distribution(data.lengths),
        "tokens_before_cutoff": None if data.full_lengths is None else distribution(data.full_lengths),
        "trained_per_sample": distribution(trained),
        "truncated": {"count": stats["n_truncated"], "reason": reasons["truncated"]},
        "dropped": {"count": stats.get("n_dropped_no_target", stats.get("n_dropped_long_response")),
                    "reason": reasons["dropped"], "examples": stats["dropped_examples"]},
        "skipped": {"count": stats["n_skipped_invalid"], "reason": reasons["skipped"],
                    "examples": stats["skipped_examples"]},
        **({"tags": {"desirable": int(np.sum(data.desirable)), "undesirable": int(np.sum(~data.desirable))}}
           if data.desirable is not None else {}),
    }


def entries_report(entries: list[str], cfg: TrainConfig, read: Conversations | Documents) -> list[dict]:
    """Each dataset entry with its files: the format read and the records in each (None: not read, max_samples
    was reached before it)."""
    files = {str(f.path): f for f in read.files}
    report = []
    for spec in resolve(entries, cfg.dataset_dir, cfg.named_format):
        rows = []
        for path in spec.files:
            seen = files.get(str(path))
            rows.append({"path": str(path), "format": seen.fmt if seen else None,
                         "records": seen.records if seen else None, "read": seen.read if seen else 0})
        report.append({"name": spec.name, "registry": str(spec.registry) if spec.registry else None, "files": rows})
    return report


def sample_report(data: TokenizedDataset, flags: np.ndarray, position: int, tokenizer: PreTrainedTokenizerBase,
                  sources: list[str], held_out: bool) -> dict:
    """One sample as the cache holds it (ids, labels) with what the loss trains, its source and its text."""
    input_ids, labels = (np.asarray(a, dtype=np.int64) for a in data[position])
    trained = flags[data.offsets[position]:data.offsets[position + 1]]
    record = None if data.record_index is None else int(data.record_index[position])
    full = None if data.full_lengths is None else int(data.full_lengths[position])
    return {
        "position": position,
        "source": None if record is None else sources[record],
        "held_out": held_out,
        "tokens": len(input_ids),
        "trained_tokens": int(trained.sum()),
        "tokens_before_cutoff": full,
        **({"desirable": bool(data.desirable[position])} if data.desirable is not None else {}),
        "segments": segments(input_ids, labels, trained, tokenizer),
        "input_ids": input_ids.tolist(),
        "labels": labels.tolist(),
        "trained": trained.astype(int).tolist(),
    }


def segments(input_ids: np.ndarray, labels: np.ndarray, trained: np.ndarray,
             tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """The sample as runs of text: `context` (no target), `trained` (the token is its own target) and `target` (a
    target that is not the token at its place: the eos formats without end-of-turn text train where the next turn
    begins). Special tokens are written out."""
    runs: list[tuple[str, list[int]]] = []
    for token, label, is_trained in zip(input_ids.tolist(), labels.tolist(), trained.tolist()):
        if is_trained and label != token:
            runs.append(("target", [label]))
            kind = "context"
        else:
            kind = "trained" if is_trained else "context"
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(token)
        else:
            runs.append((kind, [token]))
    return [{"kind": kind, "text": tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)}
            for kind, ids in runs]


def render_text(report: dict, color: bool) -> str:
    """The report for people: settings and datasets, then each sample with its trained text marked."""
    lines = [f"template: {report['template']['description']}; trains {report['template']['trains']}"]
    settings = report["settings"]
    lines.append("settings: " + ", ".join(f"{key} {json.dumps(value)}" for key, value in settings.items()))
    cache = report["cache"]
    lines.append(f"tokenized cache: {cache['dir']} ({'built now; training reuses it' if cache['built'] else 'read'})")
    for name, dataset in report["datasets"].items():
        lines += [""] + dataset_lines(name, dataset)
    total = report["datasets"]["train"]["samples"]
    if report.get("rows"):
        lines += ["", f"rows of the first epoch as training packs them; {BOUNDARY} marks where one document, or "
                      f"piece of one, ends and the next begins (no attention crosses it):"]
        for n, row in enumerate(report["rows"]):
            count = len(row["pieces"])
            lines += ["", f"--- row {n}: {row['tokens']:,} tokens, {count} piece{'s' if count > 1 else ''} ---"]
            lines.append(f" {BOUNDARY} ".join(f"[{piece_label(p)}] {p['text']}" for p in row["pieces"]))
        return "\n".join(lines)
    for sample in report["samples"]:
        if "chosen" in sample:  # a preference pair
            total = report["datasets"]["train"]["pairs"]
            source = f" ({sample['source']})" if sample["source"] else ""
            held = "; held out for evaluation, never trained" if sample["held_out"] else ""
            lines += ["", f"--- pair {sample['position']} of {total:,}{source}{held} ---"]
            for side in ("chosen", "rejected"):
                sequence = sample[side]
                cut = (f", cut from {sequence['tokens_before_cutoff']:,} by cutoff_len"
                       if (sequence["tokens_before_cutoff"] or 0) > sequence["tokens"] else "")
                lines += [f"{side} ({sequence['tokens']:,} tokens, {sequence['trained_tokens']:,} trained{cut}):",
                          marked_text(sequence["segments"], color)]
            continue
        lines += ["", sample_header(sample, total), marked_text(sample["segments"], color)]
    return "\n".join(lines)


def number(value: float) -> str:
    return f"{value:,.1f}".removesuffix(".0")


def spread(d: dict) -> str:
    return f"min {number(d['min'])}, median {number(d['median'])}, p95 {number(d['p95'])}, max {number(d['max'])}"


def dataset_lines(name: str, d: dict) -> list[str]:
    lines = [f"{name} data:"]
    for entry in d["entries"]:
        indent = "  "
        if entry["registry"]:
            lines.append(f"  {entry['name']} (in {entry['registry']}):")
            indent = "    "
        for f in entry["files"]:
            if f["records"] is None:
                lines.append(f"{indent}{f['path']}: not read (max_samples reached)")
                continue
            read = f", {f['read']:,} read (max_samples)" if f["read"] < f["records"] else ""
            lines.append(f"{indent}{f['path']}: {f['format'] or 'no format (empty)'}, {f['records']:,} records{read}")
    documents = (f"{d['documents']:,} documents -> " if "documents" in d else
                 f"{d['pairs']:,} pairs -> " if "pairs" in d else "")
    lines.append(f"  {d['records']:,} records -> {documents}{d['samples']:,} samples, {d['tokens']:,} tokens, "
                 f"{d['trained_tokens']:,} trained")
    lines.append(f"  tokens per sample:   {spread(d['tokens_per_sample'])}")
    if d["tokens_before_cutoff"]:
        lines.append(f"  before cutoff_len:   {spread(d['tokens_before_cutoff'])}")
    lines.append(f"  trained per sample:  {spread(d['trained_per_sample'])}")
    if "tags" in d:
        lines.append(f"  responses: {d['tags']['desirable']:,} desirable, {d['tags']['undesirable']:,} undesirable")
    kinds = ((("split", "documents"),) if "split" in d else (("truncated", "pairs"), ("dropped", "pairs"))
             if "pairs" in d else (("truncated", "samples"), ("dropped", "samples")))
    for kind, what in (*kinds, ("skipped", "records")):
        count, cut = d[kind]["count"], d[kind]
        if count or kind != "skipped":  # records are skipped only with skip_invalid
            lines.append(f"  {kind}: {count:,} {what} {cut['reason']}{examples(cut.get('examples'), count)}")
    if "held_out" in d:
        lines.append(f"  held out: {d['held_out']['count']:,} samples {d['held_out']['reason']}")
    return lines


def piece_label(piece: dict) -> str:
    """Where a raw-text row's piece comes from: its document and, when the document was split, which piece."""
    of = f", piece {piece['piece']} of {piece['pieces']}" if piece["pieces"] > 1 else ""
    return f"sample {piece['position']}: {piece['source']}{of}"


def sample_header(sample: dict, total: int) -> str:
    parts = [f"{sample['tokens']:,} tokens, {sample['trained_tokens']:,} trained"]
    if "desirable" in sample:
        parts.insert(0, "desirable" if sample["desirable"] else "undesirable")
    before = sample["tokens_before_cutoff"]
    if before is not None and before > sample["tokens"]:
        parts.append(f"cut from {before:,} tokens by cutoff_len")
    if sample["held_out"]:
        parts.append("held out for evaluation, never trained")
    source = f" ({sample['source']})" if sample["source"] else ""
    return f"--- sample {sample['position']} of {total:,}{source}: {'; '.join(parts)} ---"  # as --index takes it


def marked_text(segments: list[dict], color: bool) -> str:
    """Trained text between ⟦ ⟧ (⟦→x⟧: x trained in place of the token there), green on a terminal."""
    out = []
    for segment in segments:
        if segment["kind"] == "context":
            out.append(segment["text"])
            continue
        text = TRAINED_OPEN + (TARGET_MARK if segment["kind"] == "target" else "") + segment["text"] + TRAINED_CLOSE
        # colour each line on its own, so a pager that resets it at line ends still shows it
        out.append("\n".join(f"{GREEN}{line}{RESET}" if line else line for line in text.split("\n")) if color
                   else text)
    return "".join(out)
