"""Which objective a run trains, chosen once from its `stage` before the first step: the step, the evaluator and
the memory fit then call that objective and never ask the stage again."""

from __future__ import annotations

import logging

import torch

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.mesh import ParallelDims
from meshtune.model.reference import build_reference
from meshtune.model.vocab_parallel_loss import vocab_shard
from meshtune.plan import RunPlan
from meshtune.train.objectives import Objective
from meshtune.train.objectives.kto import KTOLoss
from meshtune.train.objectives.kto_loss import KTOSettings
from meshtune.train.objectives.pair_loss import PairLoss
from meshtune.train.objectives.preference import PreferenceSettings
from meshtune.train.objectives.token_loss import TokenLoss

logger = logging.getLogger(__name__)


def build_objective(cfg: TrainConfig, plan: RunPlan, env: DistEnv, dims: ParallelDims, model: torch.nn.Module,
                    pad_id: int, row_length_multiple: int) -> Objective:
    """What the stage optimises: token cross-entropy (sft, pt), the preference loss of pairs (dpo) or KTO's loss of
    unpaired samples (kto), the last two with their reference built here (model/reference.py), after the policy;
    none for dpo with precompute_ref_log_probs, whose batches bring the reference's log-probs."""
    if plan.precompute_ref_log_probs:
        logger.info(f"pref_loss {cfg.pref_loss}, beta {cfg.pref_beta:g}; reference: its log-probs precomputed")
        return PairLoss(model, env, pad_id, preference_settings(cfg), None, autocast_bf16=plan.autocast_bf16,
                        autocast_fp16=plan.fp16, precomputed=True, fused=plan.fused_loss, vocab=vocab_shard(model),
                        pad_to_multiple=row_length_multiple, padding_free=plan.padding_free)
    if cfg.stage in ("dpo", "kto"):
        reference = build_reference(cfg, plan, env, dims, model)
        described = reference.description if reference else f"none ({cfg.pref_loss} has none)"
        if cfg.stage == "kto":
            logger.info(f"kto, beta {cfg.pref_beta:g}; reference: {described}")
            settings = KTOSettings(cfg.pref_beta, cfg.kto_chosen_weight, cfg.kto_rejected_weight)
            return KTOLoss(model, env, pad_id, autocast_bf16=plan.autocast_bf16, settings=settings,
                           reference=reference, cutoff_len=cfg.cutoff_len, autocast_fp16=plan.fp16,
                           padding_free=plan.padding_free, vocab=vocab_shard(model),
                           pad_to_multiple=row_length_multiple, owns_loss=dims.owns_loss)
        logger.info(f"pref_loss {cfg.pref_loss}, beta {cfg.pref_beta:g}; reference: {described}")
        return PairLoss(model, env, pad_id, preference_settings(cfg), reference, autocast_bf16=plan.autocast_bf16,
                        autocast_fp16=plan.fp16, fused=plan.fused_loss, vocab=vocab_shard(model),
                        pad_to_multiple=row_length_multiple, padding_free=plan.padding_free)
    return TokenLoss(model, env, pad_id, autocast_bf16=plan.autocast_bf16, fused_loss=plan.fused_loss,
                     autocast_fp16=plan.fp16, vocab=vocab_shard(model), pad_to_multiple=row_length_multiple,
                     padding_free=plan.padding_free)


def preference_settings(cfg: TrainConfig) -> PreferenceSettings:
    return PreferenceSettings(cfg.pref_loss, cfg.pref_beta, cfg.dpo_label_smoothing, cfg.simpo_gamma, cfg.pref_ftx)
