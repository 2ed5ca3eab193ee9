"""Preference training's keys (stage: dpo and kto): the loss, its weights and the reference. Which stage reads each
is checked with the stage (config/rules.py)."""

from __future__ import annotations

from typing import Literal

from meshtune.config.section import JOB, MATH, Keys, Section

PREFERENCE = Section("preference training (stage: dpo and kto)", MATH)
PREF_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")  # train/objectives/preference.py computes them
DPO_ONLY = ("pref_loss", "pref_ftx", "dpo_label_smoothing", "simpo_gamma")  # the PREFERENCE keys only dpo reads
KTO_ONLY = ("kto_chosen_weight", "kto_rejected_weight")  # and those only kto reads


class PreferenceKeys(Keys):
    pref_beta: float = PREFERENCE(0.1, "beta (LLaMA-Factory's key; TRL's beta): how far the policy may move from the "
                                       "reference, larger keeps it closer (dpo's sigmoid, hinge, ipo; kto); the "
                                       "scale of the log-prob margin for orpo and simpo", gt=0.0)
    pref_loss: Literal[PREF_LOSSES] = PREFERENCE(
        "sigmoid", "stage: dpo: sigmoid (DPO) | hinge (SLiC) | ipo | orpo (odds ratio, no reference) | simpo "
                   "(length-normalised margin, no reference) (TRL's loss_type)")
    pref_ftx: float = PREFERENCE(0.0, "stage: dpo: weight of an SFT term beside the preference loss: the chosen "
                                      "response's mean token negative log-likelihood (LLaMA-Factory's key)", ge=0.0)
    dpo_label_smoothing: float = PREFERENCE(0.0, "stage: dpo: conservative DPO: the probability that a pair's "
                                                 "preference is wrong, sigmoid only (TRL's label_smoothing)", ge=0.0,
                                            le=0.5)
    simpo_gamma: float = PREFERENCE(0.5, "stage: dpo: simpo's target reward margin", ge=0.0)
    ref_model: str | None = PREFERENCE(None, "a local model folder as the frozen reference (LLaMA-Factory's key). "
                                             "Default: lora and qlora, the model itself with its adapters turned off; "
                                             "full, a frozen copy of model_name_or_path sharded as the policy is; "
                                             "orpo and simpo have none")
    ref_model_adapters: str | None = PREFERENCE(None, "a PEFT adapter folder merged into ref_model for the reference "
                                                      "(LLaMA-Factory's key)")
    precompute_ref_log_probs: bool | Literal["auto"] = PREFERENCE(
        "auto", "stage: dpo: every pair's reference log-probs (chosen and rejected, the held-out pairs too) computed "
               "once before the first step, spread over every process of every node, and kept beside the tokenized "
               "data (tokenized_path), keyed by the data and the reference, so every node and every resume reads "
               "the same values; the step then runs no reference forward, and full fine-tuning holds no frozen "
               "copy while it trains (TRL's key). Costs one forward pass over the pairs before training (none on a "
               "later run with the same data and reference) and 8 bytes a pair on disk; sigmoid, hinge and ipo "
               "only (orpo and simpo have no reference). The losses are those of the reference in the step, so a "
               "run may resume with it turned on or off. auto: on where the reference is a frozen copy (full "
               "fine-tuning, or ref_model: training then holds no second model) or the run reads its pairs more "
               "than once (num_train_epochs above 1: one reference forward a pair instead of one an epoch); off "
               "for one pass with the reference the model itself with its adapters off (LoRA, Q-LoRA), where the "
               "pass would spend the forwards the steps spend", scope=JOB)
    kto_chosen_weight: float = PREFERENCE(1.0, "stage: kto: the weight of a desirable sample's loss "
                                               "(LLaMA-Factory's key; TRL's desirable_weight)", ge=0.0)
    kto_rejected_weight: float = PREFERENCE(1.0, "stage: kto: the weight of an undesirable sample's loss "
                                                 "(LLaMA-Factory's key; TRL's undesirable_weight)", ge=0.0)
