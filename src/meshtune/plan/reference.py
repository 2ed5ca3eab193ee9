"""stage: dpo and kto: what the policy is compared against, and whether dpo's reference log-probs are computed once
before training."""

from __future__ import annotations

from meshtune.config import TrainConfig


def resolve_reference(cfg: TrainConfig, why: dict[str, str]) -> dict:
    """`precompute_ref_log_probs` made concrete, and the reference's reason."""
    precompute = cfg.stage == "dpo" and precompute_reference(cfg, why)
    if cfg.stage in ("dpo", "kto"):
        why["reference"] = reference_reason(cfg, precompute)
    return dict(precompute_ref_log_probs=precompute)


def precompute_reference(cfg: TrainConfig, why: dict[str, str]) -> bool:
    """stage: dpo's `precompute_ref_log_probs`: as set, or under auto where it saves memory (a frozen copy is never
    held while training) or forwards (pairs read more than once)."""
    if cfg.pref_loss in ("orpo", "simpo"):
        return False  # no reference (the config refuses true)
    if isinstance(cfg.precompute_ref_log_probs, bool):
        return cfg.precompute_ref_log_probs
    if cfg.ref_model or not cfg.is_lora:
        why["precompute_ref_log_probs"] = ("auto: on: the reference is a frozen copy, placed for one pass before "
                                           "training and freed, so training holds no second model")
        return True
    if cfg.max_steps <= 0 and cfg.num_train_epochs > 1:
        why["precompute_ref_log_probs"] = (f"auto: on: num_train_epochs {cfg.num_train_epochs:g} read each pair more "
                                           f"than once; one reference forward a pair instead of one an epoch")
        return True
    why["precompute_ref_log_probs"] = ("auto: off: the reference is the model itself with its adapters off (no "
                                       "memory of its own) and " + ("max_steps decides how often a pair is read"
                                       if cfg.max_steps > 0 else "each pair is read once") + ": a pass before "
                                       "training would spend the forwards the steps spend")
    return False


def reference_reason(cfg: TrainConfig, precomputed: bool = False) -> str:
    """What a dpo or kto run compares its policy against."""
    if cfg.stage == "dpo" and cfg.pref_loss in ("orpo", "simpo"):
        return f"none: pref_loss {cfg.pref_loss} compares no reference"
    if cfg.ref_model:
        adapters = f" with the adapter {cfg.ref_model_adapters} merged" if cfg.ref_model_adapters else ""
        what = f"ref_model {cfg.ref_model}{adapters}: a frozen copy"
    elif cfg.is_lora:
        what = "the model itself with its LoRA adapters turned off"
    else:
        what = "a frozen copy of model_name_or_path"
    if precomputed:  # the run amends it with where the values are
        return f"precomputed before the first step (precompute_ref_log_probs) from {what}; each step reads them"
    return what + (" (no second copy)" if cfg.is_lora and not cfg.ref_model else
                   ", sharded as the policy is" + ("" if cfg.ref_model else " (no optimizer, no gradients)"))
