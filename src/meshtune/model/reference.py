"""The frozen reference a preference loss (stage: dpo and kto) compares the policy against: its logits for a
micro-batch, never a gradient.

- LoRA and Q-LoRA without `ref_model`: the policy itself with its adapters turned off (peft's `disable_adapter`), so
  the reference is the base the adapters train on and costs no second copy.
- Full fine-tuning, or `ref_model` given: a frozen copy read from the model folder (with `ref_model_adapters` merged
  into it, as LLaMA-Factory loads it), its weights read once per job as the policy's are and sharded as the policy is
  (FSDP2 on the same mesh under zero2 / zero3 / hsdp; a whole copy on each process under ddp; under tensor_parallel
  split over the tp dimension first, its logits split by vocabulary as the policy's); no optimizer and no gradients,
  and under FSDP2 it reshards after forward, since it never runs backward.
- dpo's orpo and simpo: none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.errors import ModelError
from meshtune.mesh import ParallelDims
from meshtune.model.attention import use_varlen
from meshtune.model.loading import load_model, model_skeleton
from meshtune.model.loss_head import LossHead, install_loss_head, logps_for, output_head
from meshtune.model.model_dir import check_model_dir
from meshtune.model.parallel import unwrap, wrap_model
from meshtune.model.rank0_weights import check_same_model, full_state, receive_replicated, receive_shards
from meshtune.model.vocab_parallel_loss import VocabShard, vocab_shard
from meshtune.plan import RunPlan

logger = logging.getLogger(__name__)


class Reference(Protocol):
    description: str
    vocab: VocabShard | None  # under tensor parallel, the share of the vocabulary its logits cover

    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's logits for the model inputs of a micro-batch, without a graph."""

    def row_logps(self, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                  ignore_index: int) -> torch.Tensor | None:
        """Each row's summed log-prob of `targets` through the fused head (model/loss_head.py), the arithmetic of
        the policy's under fused_loss; None where the reference's head is not one."""


def head_row_logps(model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                   ignore_index: int) -> torch.Tensor | None:
    if not isinstance(output_head(model), LossHead):
        return None
    with logps_for(model, targets, ignore_index, inputs.get("cu_seq_lens_q")):  # padding-free: its samples
        return model(**inputs, use_cache=False).logits


class AdaptersOff:
    """The policy with its LoRA adapters disabled for the forward."""

    description = "the model with its LoRA adapters turned off"

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy  # as wrapped: FSDP2 gathers its shards in forward; DDP's inner module runs no reducer
        self.vocab = vocab_shard(policy)

    @torch.no_grad()
    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        model = unwrap(self.policy)
        with model.disable_adapter():
            return model(**inputs, use_cache=False).logits

    @torch.no_grad()
    def row_logps(self, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                  ignore_index: int) -> torch.Tensor | None:
        model = unwrap(self.policy)
        with model.disable_adapter():
            return head_row_logps(model, inputs, targets, ignore_index)


@contextmanager
def trainable_flags_kept(model: torch.nn.Module) -> Iterator[None]:
    """Many forwards of the policy with its adapters off (a pass before training) leave it as they found it.

    peft's `disable_adapter` turns `requires_grad` off, and on again, on the parameters each module holds at that
    moment. Under FSDP2 a unit left unsharded after forward gets them back on its unsharded parameters only, and its
    sharded ones, which the optimizer collects and FSDP2's next all-gather copies the flag from, stay off. So every
    unit is resharded and each parameter's flag set back as it was."""
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        for name, p in model.named_parameters():
            p.requires_grad_(flags[name])


class FrozenCopy:
    """A frozen model of its own, placed as the policy is."""

    def __init__(self, model: torch.nn.Module, description: str):
        self.model, self.description = model, description
        self.vocab = vocab_shard(model)  # split by tensor parallel as the policy is

    @torch.no_grad()
    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs, use_cache=False).logits

    @torch.no_grad()
    def row_logps(self, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                  ignore_index: int) -> torch.Tensor | None:
        return head_row_logps(unwrap(self.model), inputs, targets, ignore_index)


def build_reference(cfg: TrainConfig, plan: RunPlan, env: DistEnv, dims: ParallelDims,
                    policy: torch.nn.Module) -> Reference | None:
    """The run's reference, for stage: dpo and kto alike (see the module's docstring); None where dpo's pref_loss has
    none. A frozen copy is sharded over the policy's mesh (`dims`, the run's: built once)."""
    if cfg.stage == "dpo" and cfg.pref_loss in ("orpo", "simpo"):
        return None
    if cfg.is_lora and not cfg.ref_model:
        return AdaptersOff(policy)
    folder = cfg.ref_model or cfg.model_name_or_path
    model = frozen_copy(check_model_dir(folder), cfg.ref_model_adapters, plan, env, dims)
    adapters = f" with {cfg.ref_model_adapters} merged" if cfg.ref_model_adapters else ""
    return FrozenCopy(model, f"a frozen copy of {folder}{adapters}, placed as the policy ({plan.parallel})")


def frozen_copy(model_dir: Path, adapters: str | None, plan: RunPlan, env: DistEnv,
                dims: ParallelDims) -> torch.nn.Module:
    """The model of `model_dir` (+ `adapters` merged), frozen, on this process as the plan places the policy."""
    reads_files = env.is_main or not plan.weights_from_rank0
    dtype = plan.load_dtype
    model = load_model(model_dir, dtype) if reads_files else model_skeleton(model_dir, dtype)
    if adapters and reads_files:
        model = merged_adapter(model, Path(adapters))
    model.requires_grad_(False)
    model.eval()
    model.config.use_cache = False
    if plan.fused_loss:  # its log-probs summed as the policy's are (model/loss_head.py), before any wrapping
        install_loss_head(model)
    if plan.padding_free:  # it reads the policy's padding-free rows
        use_varlen(model)
    if plan.weights_from_rank0:
        check_same_model(model, env)
    if plan.parallel == "ddp":
        if plan.weights_from_rank0:
            receive_replicated(model, env)
        else:
            model.to(env.device)
        return model
    state = full_state(model, env) if plan.weights_from_rank0 else None
    model = wrap_model(model, parallel=plan.parallel, env=env, bf16=plan.bf16, dims=dims,
                       prefetch=plan.fsdp_prefetch, blocks_per_unit=plan.blocks_per_unit or 1,
                       cpu_offload=plan.cpu_offload, reshard_after_forward=True)
    if state is not None:
        receive_shards(model, state, env, plan.cpu_offload)
    return model


def merged_adapter(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`folder`'s PEFT adapter folded into the model's weights."""
    if not (folder / "adapter_config.json").is_file():
        raise ModelError(f"ref_model_adapters: {folder} has no adapter_config.json; give a PEFT adapter folder (an "
                         f"earlier run's final/, or `meshtune export` of a checkpoint)")
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
