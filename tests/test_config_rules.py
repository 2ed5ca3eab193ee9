"""The checks across the config's sections (config/rules.py): each rule fires on the keys it names, alone, with its
message, and is the error `build_config` reports; the keys' sections keep every check of their own in TrainConfig."""

from __future__ import annotations

import pytest

from meshtune.config import TrainConfig, build_config
from meshtune.config.rules import RULES
from meshtune.errors import ConfigError

BASE = {"model_name_or_path": "/models/x", "dataset": ["train.jsonl"]}
PP = {"pipeline_parallel": 2}

# rule: (the keys that break it on BASE, a part of its message)
BROKEN = {
    "pretraining_trains_every_token": ({"stage": "pt", "train_on_prompt": True},
                                       "train_on_prompt choose which turns of a conversation train; stage: pt trains "
                                       "every token of raw text: drop train_on_prompt"),
    "pretraining_reads_raw_text": ({"stage": "pt", "dataset_format": "alpaca"},
                                   "dataset_format: alpaca reads conversations; stage: pt reads raw text"),
    "preference_keys_need_their_stage": ({"pref_beta": 0.2}, "pref_beta: preference-training keys, read only by "
                                                             "stage: dpo and kto; this run is stage: sft"),
    "preference_keys_of_the_other_stage": ({"stage": "kto", "pref_loss": "hinge"},
                                           "pref_loss: read only by stage: dpo; this run is stage: kto: drop it"),
    "reference_adapters_need_the_reference": ({"stage": "dpo", "ref_model_adapters": "/adapters/a"},
                                              "ref_model_adapters is an adapter merged into ref_model; set ref_model"),
    "kto_computes_the_reference_each_step": ({"stage": "kto", "precompute_ref_log_probs": True},
                                             "precompute_ref_log_probs: true is for stage: dpo; stage: kto computes"),
    "dpo_trains_the_responses": ({"stage": "dpo", "mask_history": True},
                                 "mask_history choose which turns of a conversation train; stage: dpo trains"),
    "dpo_pairs_are_not_packed": ({"stage": "dpo", "packing": True}, "packing: true with stage: dpo: a micro-batch's "
                                                                    "pairs are already end to end in one row"),
    "label_smoothing_is_the_sigmoid_loss": ({"stage": "dpo", "dpo_label_smoothing": 0.1, "pref_loss": "hinge"},
                                            "dpo_label_smoothing: 0.1 smooths the sigmoid (DPO) loss only; pref_loss: "
                                            "hinge does not read it"),
    "reference_free_loss_precomputes_nothing": ({"stage": "dpo", "pref_loss": "orpo", "precompute_ref_log_probs": True},
                                                "precompute_ref_log_probs: true precomputes the reference's log-probs, "
                                                "and pref_loss: orpo compares no reference"),
    "reference_free_loss_has_no_reference": ({"stage": "dpo", "pref_loss": "simpo", "ref_model": "/models/ref"},
                                             "pref_loss: simpo compares no reference, so ref_model / "
                                             "ref_model_adapters would go unused"),
    "dpo_sums_whole_responses": ({"stage": "dpo", "context_parallel": 2},
                                 "context_parallel: 2 with stage: dpo is not supported"),
    "kto_is_not_packed": ({"stage": "kto", "packing": True}, "stage: kto cannot be combined with packing: true"),
    "kto_sums_whole_responses": ({"stage": "kto", "context_parallel": 2},
                                 "stage: kto cannot be combined with context_parallel above 1"),
    "kto_trains_the_last_turn": ({"stage": "kto", "train_on_prompt": True},
                                 "stage: kto cannot be combined with train_on_prompt or mask_history"),
    "kto_reads_conversations": ({"stage": "kto", "dataset_format": "alpaca"},
                                "stage: kto cannot be combined with dataset_format: alpaca: KTO reads sharegpt or "
                                "messages records"),
    "qlora_shards_stay_on_the_gpu": ({"finetuning_type": "qlora", "cpu_offload": True, "parallel": "zero3"},
                                     "cpu_offload: true with finetuning_type: qlora is not supported"),
    "resume_may_change_math_keys_only": ({"resume_allow_changed": ["output_dir"]},
                                         "resume_allow_changed: output_dir is not a key of the run's math"),
    "one_compute_precision": ({"fp16": True, "bf16": True},
                              "fp16: true and bf16: true ask for two compute precisions"),
    "bf16_master_weights_train_in_full": ({"master_weights": "bf16"},
                                          "master_weights: bf16 is for full fine-tuning; lora's adapters are small"),
    "replicas_reduce_in_the_shards_dtype": ({"hsdp_replica_reduce_dtype": "bf16"},
                                            "hsdp_replica_reduce_dtype: bf16 with grad_reduce_dtype: fp32 is not "
                                            "supported"),
    "one_communication_hook": ({"powersgd_rank": 2, "grad_reduce_dtype": "bf16"},
                               "powersgd_rank: 2 and grad_reduce_dtype: bf16 are two communication hooks"),
    "powersgd_needs_ddp_buckets": ({"powersgd_rank": 2, "grad_sync": "flat"},
                                   "powersgd_rank: 2 is a hook on DDP's buckets; grad_sync: flat has none"),
    "pipeline_carries_no_reference": ({**PP, "stage": "dpo"},
                                      "pipeline_parallel: 2 cannot be combined with stage: dpo (its loss compares"),
    "pipeline_is_not_packed": ({**PP, "packing": True}, "pipeline_parallel: 2 cannot be combined with packing: true"),
    "pipeline_rows_are_padded": ({**PP, "padding_free": True},
                                 "pipeline_parallel: 2 cannot be combined with padding_free: true"),
    "pipeline_has_one_loss_scale": ({**PP, "fp16": True}, "pipeline_parallel: 2 cannot be combined with fp16: true"),
    "pipeline_replicas_reduce_flat": ({**PP, "powersgd_rank": 2},
                                      "pipeline_parallel: 2 cannot be combined with powersgd_rank"),
}


def test_every_rule_has_a_config_that_breaks_it():
    names = [name for name, _ in RULES]
    assert len(set(names)) == len(names)
    assert set(BROKEN) == set(names)


@pytest.mark.parametrize("name", [name for name, _ in RULES])
def test_a_rule_fires_alone_on_its_keys_with_its_message(name):
    """The rule reads the keys it names (it passes the valid BASE and fires on BASE with them), and its message, word
    for word, is the one error of that config."""
    rule = dict(RULES)[name]
    keys, message = BROKEN[name]
    assert rule(TrainConfig.model_construct(**BASE)) is None
    said = rule(TrainConfig.model_construct(**{**BASE, **keys}))
    assert said is not None and message in said
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, **keys})
    assert str(err.value) == f"config: {said}"


def test_the_base_config_breaks_no_rule():
    config = build_config(BASE)
    assert [name for name, rule in RULES if rule(config)] == []


def test_every_section_check_runs_in_the_config():
    """TrainConfig inherits each section's validators by name: two sections naming one alike would keep only one."""
    sections = [base for base in TrainConfig.__mro__[1:] if base.__name__.endswith("Keys") and base.__name__ != "Keys"]
    for kind in ("field_validators", "model_validators"):
        own = [name for section in sections for name in getattr(section.__pydantic_decorators__, kind)]
        assert len(set(own)) == len(own), kind
        assert set(own) <= set(getattr(TrainConfig.__pydantic_decorators__, kind)), kind


def test_help_lists_every_section_once_model_and_method_first():
    """The sections' models are inherited in an order that keeps each section's keys together, as `--help` lists
    them."""
    titles = [field.json_schema_extra["section"] for field in TrainConfig.model_fields.values()]
    runs = [title for i, title in enumerate(titles) if i == 0 or titles[i - 1] != title]
    assert len(runs) == len(set(runs)) == 10 and runs[0] == "model and method"
    assert list(TrainConfig.model_fields)[:2] == ["model_name_or_path", "stage"]
