"""The checks that read keys of several sections: one rule a function, which returns what is wrong (the message a
user sees) or None, and `RULES`, every rule by name in the order `TrainConfig` runs them; the first broken one is the
error. A check that reads one section's keys only is that section's validator."""

from __future__ import annotations

from typing import Any, Callable

from meshtune.config.parallel import pipeline_refusal
from meshtune.config.preference import DPO_ONLY, KTO_ONLY, PREFERENCE
from meshtune.config.section import MATH

Config = Any  # a TrainConfig: every section's keys (rules.py is imported by the module that defines it)
SFT_ONLY = ("train_on_prompt", "mask_history")  # which turns of a conversation train


def _turns_chosen_under(config: Config, stage: str, trains: str) -> str | None:
    """train_on_prompt or mask_history under a stage that trains no turns of its choosing."""
    given = " and ".join(key for key in SFT_ONLY if getattr(config, key))
    if config.stage == stage and given:
        return f"{given} choose which turns of a conversation train; stage: {stage} trains {trains}: drop {given}"
    return None


def pretraining_trains_every_token(config: Config) -> str | None:
    return _turns_chosen_under(config, "pt", "every token of raw text")


def pretraining_reads_raw_text(config: Config) -> str | None:
    if config.stage == "pt" and config.dataset_format != "auto":
        return (f"dataset_format: {config.dataset_format} reads conversations; stage: pt reads raw text (a 'text' "
                f"field, LLaMA-Factory's columns {{prompt: text}}, or .txt files): drop dataset_format")
    return None


def _preference_keys_given(config: Config) -> list[str]:
    return [key for key in type(config).keys_of_section(PREFERENCE.title)
            if getattr(config, key) != type(config).model_fields[key].default]


def preference_keys_need_their_stage(config: Config) -> str | None:
    given = _preference_keys_given(config)
    if config.stage not in ("dpo", "kto") and given:
        return (f"{', '.join(given)}: preference-training keys, read only by stage: dpo and kto; this run is stage: "
                f"{config.stage}: drop them or set stage: dpo or kto")
    return None


def preference_keys_of_the_other_stage(config: Config) -> str | None:
    if config.stage not in ("dpo", "kto"):
        return None
    other, other_stage = (KTO_ONLY, "kto") if config.stage == "dpo" else (DPO_ONLY, "dpo")
    foreign = [key for key in _preference_keys_given(config) if key in other]
    if foreign:
        return (f"{', '.join(foreign)}: read only by stage: {other_stage}; this run is stage: {config.stage}: drop "
                f"{'them' if len(foreign) > 1 else 'it'}")
    return None


def reference_adapters_need_the_reference(config: Config) -> str | None:
    if config.stage in ("dpo", "kto") and config.ref_model_adapters and not config.ref_model:
        return ("ref_model_adapters is an adapter merged into ref_model; set ref_model (the folder of its base model) "
                "too")
    return None


def kto_computes_the_reference_each_step(config: Config) -> str | None:
    if config.stage == "kto" and config.precompute_ref_log_probs is True:
        return ("precompute_ref_log_probs: true is for stage: dpo; stage: kto computes the reference's log-probs in "
                "each step (its KL term pairs each prompt with another sample's response, a different one every "
                "step): drop it")
    return None


def dpo_trains_the_responses(config: Config) -> str | None:
    return _turns_chosen_under(config, "dpo", "each pair's two responses after their prompt")


def dpo_pairs_are_not_packed(config: Config) -> str | None:
    if config.stage == "dpo" and config.packing:
        return ("packing: true with stage: dpo: a micro-batch's pairs are already end to end in one row, with no "
                "padding and no attention between sequences, wherever padding_free is on (the default on CUDA); "
                "packing's rows of up to cutoff_len tokens do not apply to pairs: drop packing (and neat_packing), "
                "and raise per_device_train_batch_size for more pairs a row")
    return None


def label_smoothing_is_the_sigmoid_loss(config: Config) -> str | None:
    if config.stage == "dpo" and config.dpo_label_smoothing and config.pref_loss != "sigmoid":
        return (f"dpo_label_smoothing: {config.dpo_label_smoothing:g} smooths the sigmoid (DPO) loss only; "
                f"pref_loss: {config.pref_loss} does not read it: drop it")
    return None


def _reference_free(config: Config) -> bool:
    return config.stage == "dpo" and config.pref_loss in ("orpo", "simpo")


def reference_free_loss_precomputes_nothing(config: Config) -> str | None:
    if _reference_free(config) and config.precompute_ref_log_probs is True:
        return (f"precompute_ref_log_probs: true precomputes the reference's log-probs, and pref_loss: "
                f"{config.pref_loss} compares no reference: drop precompute_ref_log_probs, or use pref_loss sigmoid, "
                f"hinge or ipo")
    return None


def reference_free_loss_has_no_reference(config: Config) -> str | None:
    if _reference_free(config) and (config.ref_model or config.ref_model_adapters):
        return (f"pref_loss: {config.pref_loss} compares no reference, so ref_model / ref_model_adapters would go "
                f"unused: drop them, or use pref_loss sigmoid, hinge or ipo")
    return None


def dpo_sums_whole_responses(config: Config) -> str | None:
    if config.stage == "dpo" and config.context_parallel > 1:
        return (f"context_parallel: {config.context_parallel} with stage: dpo is not supported: a response's log-prob "
                f"would be summed over positions split across processes; set context_parallel: 1 (tensor_parallel "
                f"splits a large model instead)")
    return None


def _kto_refusal(config: Config, broken: bool, why: str) -> str | None:
    return f"stage: kto cannot be combined with {why}" if config.stage == "kto" and broken else None


def kto_is_not_packed(config: Config) -> str | None:
    return _kto_refusal(config, config.packing, "packing: true (each sample's response is scored on its own, beside "
                                                "another sample's response to its prompt): drop packing")


def kto_sums_whole_responses(config: Config) -> str | None:
    return _kto_refusal(config, config.context_parallel > 1, "context_parallel above 1 (a response's log-prob would "
                        "be summed over positions split across processes): set context_parallel: 1")


def kto_trains_the_last_turn(config: Config) -> str | None:
    return _kto_refusal(config, config.train_on_prompt or config.mask_history, "train_on_prompt or mask_history: KTO "
                        "trains the last assistant turn, the response its tag judges; drop them")


def kto_reads_conversations(config: Config) -> str | None:
    return _kto_refusal(config, config.dataset_format not in ("auto", "sharegpt", "messages"), f"dataset_format: "
                        f"{config.dataset_format}: KTO reads sharegpt or messages records with a kto_tag, or TRL's "
                        f"prompt / completion / label; leave dataset_format auto")


def qlora_shards_stay_on_the_gpu(config: Config) -> str | None:
    if config.finetuning_type == "qlora" and config.cpu_offload:
        return ("cpu_offload: true with finetuning_type: qlora is not supported: the 4-bit shards stay on the GPU. "
                "Shard them over more GPUs instead (parallel: zero3 across nodes)")
    return None


def resume_may_change_math_keys_only(config: Config) -> str | None:
    math_keys = type(config).keys_of(MATH)
    unknown = [key for key in config.resume_allow_changed if key not in math_keys]
    if unknown:
        return (f"resume_allow_changed: {', '.join(unknown)} is not a key of the run's math; those are "
                f"{', '.join(math_keys)}")
    return None


def one_compute_precision(config: Config) -> str | None:
    if config.fp16 and (config.bf16 or config.master_weights == "bf16"):
        return ("fp16: true and " + ("bf16: true" if config.bf16 else "master_weights: bf16") + " ask for two compute "
                "precisions; keep fp16 on GPUs without bf16 (V100, T4), else bf16")
    return None


def bf16_master_weights_train_in_full(config: Config) -> str | None:
    if config.master_weights == "bf16" and config.finetuning_type != "full":
        return (f"master_weights: bf16 is for full fine-tuning; {config.finetuning_type}'s adapters are small and "
                f"train in fp32 (the frozen base is bf16 already): drop master_weights")
    return None


def replicas_reduce_in_the_shards_dtype(config: Config) -> str | None:
    mixed = config.hsdp_replica_reduce_dtype
    if mixed is not None and mixed != config.grad_reduce_dtype:
        return (f"hsdp_replica_reduce_dtype: {mixed} with grad_reduce_dtype: {config.grad_reduce_dtype} is not "
                f"supported: torch's FSDP2 all-reduces HSDP's gradients across the replicas in the dtype of the "
                f"reduce-scatter inside a node (MixedPrecisionPolicy.reduce_dtype, one for both). Set "
                f"grad_reduce_dtype: {mixed} for both, or drop hsdp_replica_reduce_dtype")
    return None


def one_communication_hook(config: Config) -> str | None:
    if config.powersgd_rank and config.grad_reduce_dtype == "bf16":
        return (f"powersgd_rank: {config.powersgd_rank} and grad_reduce_dtype: bf16 are two communication hooks, and "
                f"DDP takes one: keep one of them")
    return None


def powersgd_needs_ddp_buckets(config: Config) -> str | None:
    if config.powersgd_rank and config.grad_sync == "flat":
        return (f"powersgd_rank: {config.powersgd_rank} is a hook on DDP's buckets; grad_sync: flat has none: drop one "
                f"of them")
    return None


def _pipeline_refusal(config: Config, broken: bool, why: str) -> str | None:
    pp = config.pipeline_parallel
    return pipeline_refusal(pp, why) if pp > 1 and broken else None


def pipeline_carries_no_reference(config: Config) -> str | None:
    return _pipeline_refusal(config, config.stage in ("dpo", "kto"), f"stage: {config.stage} (its loss compares whole "
                             f"sequences' log-probs against a reference, which the stages' schedule does not carry): "
                             f"pipeline_parallel: 1")


def pipeline_is_not_packed(config: Config) -> str | None:
    return _pipeline_refusal(config, config.packing, "packing: true (packed rows' block-diagonal attention is not "
                             "carried between the stages): drop packing")


def pipeline_rows_are_padded(config: Config) -> str | None:
    return _pipeline_refusal(config, config.padding_free is True, "padding_free: true (every stage receives "
                             "micro-batches of one padded shape): leave padding_free unset")


def pipeline_has_one_loss_scale(config: Config) -> str | None:
    return _pipeline_refusal(config, config.fp16, "fp16: true (each stage would judge the loss scale's overflows by "
                             "its own gradients): use bf16 or fp32")


def pipeline_replicas_reduce_flat(config: Config) -> str | None:
    return _pipeline_refusal(config, config.powersgd_rank > 0, "powersgd_rank (a stage's replicas average their "
                             "gradients in one flat all-reduce, not DDP's buckets): drop powersgd_rank")


Rule = Callable[[Config], str | None]
RULES: tuple[tuple[str, Rule], ...] = tuple((rule.__name__, rule) for rule in (
    pretraining_trains_every_token,
    pretraining_reads_raw_text,
    preference_keys_need_their_stage,
    preference_keys_of_the_other_stage,
    reference_adapters_need_the_reference,
    kto_computes_the_reference_each_step,
    dpo_trains_the_responses,
    dpo_pairs_are_not_packed,
    label_smoothing_is_the_sigmoid_loss,
    reference_free_loss_precomputes_nothing,
    reference_free_loss_has_no_reference,
    dpo_sums_whole_responses,
    kto_is_not_packed,
    kto_sums_whole_responses,
    kto_trains_the_last_turn,
    kto_reads_conversations,
    qlora_shards_stay_on_the_gpu,
    resume_may_change_math_keys_only,
    one_compute_precision,
    bf16_master_weights_train_in_full,
    replicas_reduce_in_the_shards_dtype,
    one_communication_hook,
    powersgd_needs_ddp_buckets,
    pipeline_carries_no_reference,
    pipeline_is_not_packed,
    pipeline_rows_are_padded,
    pipeline_has_one_loss_scale,
    pipeline_replicas_reduce_flat,
))


def first_broken(config: Config) -> str | None:
    """The message of the first rule `config` breaks, in RULES' order, or None."""
    return next((message for _, rule in RULES if (message := rule(config))), None)
