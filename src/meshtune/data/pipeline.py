"""From config to tokenized train / eval datasets, through the shared tokenized cache."""

from __future__ import annotations

import logging
from pathlib import Path

from meshtune.config import TrainConfig
from meshtune.errors import ConfigError
from meshtune.data.registry import resolve
from meshtune.data.chat_template import ChatTemplate
from meshtune.data.pairs import load_or_build_pairs
from meshtune.data.raw_text import load_or_build_raw_text
from meshtune.data.templates import LLAMAFACTORY_SAVES_ITS_FORMAT
from meshtune.data.sampler import GlobalBatchPlan
from meshtune.data.split import split_validation
from meshtune.data.tokenized import load_or_build
from meshtune.data.unpaired import load_or_build_unpaired, unpaired_template

logger = logging.getLogger(__name__)


def cache_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.tokenized_path) if cfg.tokenized_path else Path(cfg.output_dir) / "tokenized"


def _load(cfg: TrainConfig, entries: list[str], tokenizer, show_progress: bool, key: str = "dataset"):
    """Files and dataset_info.json names → one tokenized dataset; max_samples cuts each entry, train and eval
    alike, as LLaMA-Factory does. stage: pt reads them as raw text (data/raw_text.py)."""
    specs = resolve(entries, cfg.dataset_dir, cfg.named_format, key)
    check_ranking(specs, cfg.stage, key)
    if cfg.stage == "dpo":
        return load_or_build_pairs(specs, tokenizer, template=cfg.named_template, cutoff_len=cfg.cutoff_len,
                                   skip_invalid=cfg.skip_invalid, max_samples=cfg.max_samples,
                                   default_system=cfg.default_system, cache_dir=cache_dir(cfg),
                                   show_progress=show_progress)
    if cfg.stage == "pt":
        return load_or_build_raw_text(specs, tokenizer, cutoff_len=cfg.cutoff_len, skip_invalid=cfg.skip_invalid,
                                      max_samples=cfg.max_samples, cache_dir=cache_dir(cfg),
                                      show_progress=show_progress)
    if cfg.stage == "kto":
        return load_or_build_unpaired(specs, tokenizer, template=cfg.named_template, cutoff_len=cfg.cutoff_len,
                                      skip_invalid=cfg.skip_invalid, max_samples=cfg.max_samples,
                                      cache_dir=cache_dir(cfg), show_progress=show_progress,
                                      default_system=cfg.default_system)
    return load_or_build(specs, tokenizer, template=cfg.named_template, cutoff_len=cfg.cutoff_len,
                         skip_invalid=cfg.skip_invalid, max_samples=cfg.max_samples,
                         train_on_prompt=cfg.train_on_prompt, mask_history=cfg.mask_history,
                         default_system=cfg.default_system, cache_dir=cache_dir(cfg), show_progress=show_progress)


def check_ranking(specs, stage: str, key: str) -> None:
    """LLaMA-Factory's ranking: true entries hold preference pairs, which stage: dpo trains and only it; a registry
    entry without it holds conversations, which dpo cannot."""
    for spec in specs:
        if spec.ranking and stage != "dpo":
            raise ConfigError(f"{key} '{spec.name}' of {spec.registry} has ranking: true: preference pairs (chosen / "
                              f"rejected), which stage: dpo trains; stage: {stage} trains "
                              f"{'raw text' if stage == 'pt' else 'conversations'}: set stage: dpo or use another "
                              f"dataset")
        if stage == "dpo" and spec.registry is not None and not spec.ranking:
            raise ConfigError(f"{key} '{spec.name}' of {spec.registry} has no ranking: true, so it holds "
                              f"conversations, not the preference pairs stage: dpo trains; use a ranking: true entry "
                              f"(chosen / rejected columns), or stage: sft")


def describe(name: str, stats: dict) -> list[str]:
    """Lines about what tokenization dropped or cut, printed once by rank 0."""
    units = "preference pairs" if "n_pairs" in stats else "samples"
    lines = [f"{name}: {stats.get('n_samples', 0):,} {units}, {stats.get('n_tokens', 0):,} tokens "
             f"({stats.get('n_target_tokens', 0):,} trained)"]
    if stats.get("n_skipped_invalid"):
        lines.append(f"warning: {name}: skipped {stats['n_skipped_invalid']:,} malformed records (skip_invalid: true)"
                     f"{examples(stats.get('skipped_examples'), stats['n_skipped_invalid'])}")
    if stats.get("n_dropped_no_target"):
        lines.append(f"warning: {name}: dropped {stats['n_dropped_no_target']:,} samples with no assistant token "
                     f"left after truncation to cutoff_len"
                     f"{examples(stats.get('dropped_examples'), stats['n_dropped_no_target'])}")
    if stats.get("n_dropped_too_long"):
        lines.append(f"warning: {name}: dropped {stats['n_dropped_too_long']:,} pairs whose longer response does not "
                     f"fit cutoff_len with a prompt token"
                     f"{examples(stats.get('dropped_examples'), stats['n_dropped_too_long'])}")
    if stats.get("n_dropped_long_response"):
        lines.append(f"warning: {name}: dropped {stats['n_dropped_long_response']:,} samples whose response alone "
                     f"fills cutoff_len, leaving no prompt"
                     f"{examples(stats.get('dropped_examples'), stats['n_dropped_long_response'])}")
    if "n_desirable" in stats:
        lines.append(f"{name}: {stats['n_desirable']:,} desirable and {stats['n_undesirable']:,} undesirable "
                     f"responses")
    if stats.get("n_pairs") and stats.get("n_truncated"):
        lines.append(f"{name}: {stats['n_truncated']:,} pairs longer than cutoff_len kept their responses, their "
                     f"prompts cut from the left (TRL's truncation_mode keep_end)")
        return lines
    if stats.get("n_split_documents"):
        lines.append(f"{name}: {stats['n_split_documents']:,} of {stats['n_documents']:,} documents longer than "
                     f"cutoff_len split into pieces")
    if stats.get("n_truncated"):
        kept = " (each response kept whole, the prompt's start cut)" if "n_desirable" in stats else ""
        lines.append(f"{name}: {stats['n_truncated']:,} samples truncated to cutoff_len{kept}")
    return lines


def examples(named: list[str] | None, count: int) -> str:
    """': A; B and 2 more' for a report line."""
    if not named:
        return ""
    more = f" and {count - len(named):,} more" if count > len(named) else ""
    return ": " + "; ".join(named) + more


def prepare_datasets(cfg: TrainConfig, tokenizer, show_progress: bool, report: bool = True):
    """(train, eval or None). Every process may call this: one builds the cache, the others wait and read it.
    `report`: log the chat template and what the data holds (a launcher tokenizing for its workers leaves that to
    their rank 0)."""
    trains = ", trained on prompts too" if cfg.train_on_prompt else ""
    trains += ", only the last assistant turn trained" if cfg.mask_history else ""
    if cfg.stage == "pt":
        _report(["raw text (stage: pt): every token trained, an EOS after each document"], report)
    elif cfg.stage == "dpo":
        template = ChatTemplate(tokenizer, cfg.named_template, default_system=cfg.default_system)
        _report([f"chat template: {template.description}; preference pairs (stage: dpo): each response trained "
                 f"after its prompt", *saved_template_note(template)], report)
    elif cfg.stage == "kto":
        template = unpaired_template(tokenizer, cfg.named_template, cfg.default_system)
        _report([f"chat template: {template.description}; stage: kto trains each sample's response, its last "
                 f"assistant turn", *saved_template_note(template)], report)
    else:
        template = ChatTemplate(tokenizer, cfg.named_template, default_system=cfg.default_system)
        _report([f"chat template: {template.description}{trains}", *saved_template_note(template)], report)
    full = _load(cfg, cfg.dataset, tokenizer, show_progress)
    _report(describe("train data", full.stats), report)
    if cfg.eval_dataset:
        evaluation = _load(cfg, cfg.eval_dataset, tokenizer, show_progress, "eval_dataset")
        _report(describe("eval data", evaluation.stats), report)
        return full, evaluation
    if cfg.val_size > 0:
        train, evaluation = split_validation(full, cfg.val_size, cfg.seed)
        _report([f"held out {len(evaluation):,} samples for evaluation (val_size={cfg.val_size})"], report)
        return train, evaluation
    return full, None


def saved_template_note(template: ChatTemplate) -> list[str]:
    """The line saying where final/'s chat template differs from the one LLaMA-Factory saves under that name."""
    if template.own or template.name in LLAMAFACTORY_SAVES_ITS_FORMAT or not template.tokenizer.chat_template:
        return []
    return [f"template: {template.name}: LLaMA-Factory saves the model with the tokenizer's own chat template, "
            f"which renders other text than this one; meshtune saves the template it trained with in final/, so "
            f"apply_chat_template renders prompts as trained"]


def _report(lines: list[str], report: bool) -> None:
    """Data lines, as warnings where they tell of records skipped or dropped."""
    for line in lines if report else ():
        logger.log(logging.WARNING if line.startswith("warning: ") else logging.INFO, line)


def plan_steps(cfg: TrainConfig, train_data, dp_size: int, accumulation: int,
               padding_free: bool = False, report: bool = False) -> tuple[GlobalBatchPlan, int]:
    """The run's global batches and step count; an error when the data and num_train_epochs give no step.
    `accumulation` is the run plan's (the config's, or what keeps a resumed checkpoint's global batch). Padding-free
    micro-batches need no equal row counts, so they are balanced by tokens instead. `report`: log what
    dataloader_drop_last leaves out, where HF Trainer would train it."""
    plan = GlobalBatchPlan(train_data.lengths, cfg.seed, cfg.per_device_train_batch_size, accumulation, dp_size,
                           packing_capacity=cfg.cutoff_len if cfg.packing else None,
                           group_by_length=cfg.group_by_length and not cfg.packing,
                           balance_tokens=padding_free, drop_last=cfg.dataloader_drop_last)
    total_steps = plan.total_steps(cfg.num_train_epochs, cfg.max_steps)
    rows = "packed rows" if cfg.packing else "samples"
    if plan.steps_in_epoch(0) == 0 or total_steps == 0:
        batch = (f"a global batch of {plan.global_batch} (per_device_train_batch_size "
                 f"{cfg.per_device_train_batch_size} x gradient_accumulation_steps {accumulation} x {dp_size} "
                 f"processes)")
        why = (f"with dataloader_drop_last: true one optimizer step needs {batch}: add data, lower one of them or "
               f"drop dataloader_drop_last" if cfg.dataloader_drop_last else
               f"num_train_epochs={cfg.num_train_epochs} of {plan.steps_in_epoch(0)} steps (global batch "
               f"{plan.global_batch}) make no step: raise num_train_epochs or set max_steps")
        raise ConfigError(f"the training data has {len(plan.rows(0)):,} {rows}; {why}")
    left = len(plan.rows(0)) % plan.global_batch
    if report and cfg.dataloader_drop_last and left:
        logger.info(f"dataloader_drop_last: true: the last {left:,} {rows} of each epoch's order (fewer than the "
                    f"global batch of {plan.global_batch}) are not trained that epoch; HF Trainer drops only a last "
                    f"per-device batch of fewer than {cfg.per_device_train_batch_size} x {dp_size} processes and "
                    f"trains the others in a shorter last step, meshtune keeps every step at the global batch")
    return plan, total_steps
