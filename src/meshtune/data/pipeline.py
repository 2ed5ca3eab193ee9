"""From config to tokenized train / eval datasets, through the shared tokenized cache."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from meshtune.config import TrainConfig
from meshtune.data.split import split_validation
from meshtune.data.tokenized import load_or_build


def cache_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.tokenized_path) if cfg.tokenized_path else Path(cfg.output_dir) / "tokenized"


def _load(cfg: TrainConfig, paths: list[str], tokenizer, show_progress: bool):
    return load_or_build([Path(p) for p in paths], tokenizer, fmt=cfg.dataset_format, template=cfg.template,
                         cutoff_len=cfg.cutoff_len, skip_invalid=cfg.skip_invalid, cache_dir=cache_dir(cfg),
                         show_progress=show_progress)


def describe(name: str, stats: dict) -> list[str]:
    """Lines about what tokenization dropped or cut, printed once by rank 0."""
    lines = [f"{name}: {stats.get('n_samples', 0):,} samples, {stats.get('n_tokens', 0):,} tokens "
             f"({stats.get('n_target_tokens', 0):,} trained)"]
    if stats.get("n_skipped_invalid"):
        lines.append(f"warning: {name}: skipped {stats['n_skipped_invalid']:,} malformed records (skip_invalid: true)")
    if stats.get("n_dropped_no_target"):
        lines.append(f"warning: {name}: dropped {stats['n_dropped_no_target']:,} samples with no assistant token "
                     f"left after truncation to cutoff_len")
    if stats.get("n_truncated"):
        lines.append(f"{name}: {stats['n_truncated']:,} samples truncated to cutoff_len")
    return lines


def prepare_datasets(cfg: TrainConfig, tokenizer, show_progress: bool, log: Callable[[str], None]):
    """(train, eval or None). Every process may call this: one builds the cache, the others wait and read it."""
    full = _load(cfg, cfg.dataset, tokenizer, show_progress)
    for line in describe("train data", full.stats):
        log(line)
    if cfg.eval_dataset:
        evaluation = _load(cfg, cfg.eval_dataset, tokenizer, show_progress)
        for line in describe("eval data", evaluation.stats):
            log(line)
        return full, evaluation
    if cfg.val_size > 0:
        train, evaluation = split_validation(full, cfg.val_size, cfg.seed)
        log(f"held out {len(evaluation):,} samples for evaluation (val_size={cfg.val_size})")
        return train, evaluation
    return full, None
