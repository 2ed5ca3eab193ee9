"""The precision resolver: what the run computes in and what it stores the weights in."""

from __future__ import annotations

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.plan.run_plan import Machine


def resolve_precision(cfg: TrainConfig, env: DistEnv, parallel: str, machine: Machine, why: dict[str, str]) -> dict:
    """bf16 compute where the device has it (`bf16: true` on GPUs only), fp16 on GPUs in its place, the frozen base
    in bf16 for LoRA under ddp and for Q-LoRA, and master_weights: bf16."""
    cuda = env.device.type == "cuda"
    bf16 = not cfg.fp16 and (machine.bf16_supported() if cfg.bf16 is None else cfg.bf16 and cuda)
    if cfg.bf16 and not cuda:
        why["precision"] = "bf16 is ignored on CPU"
    fp16 = cfg.fp16 and cuda  # fp16: true, for GPUs without bf16, in bf16's place
    if cfg.fp16 and not fp16:
        why["precision"] = "fp16 is ignored on CPU"
    # Q-LoRA's frozen base, NF4 apart, stays bf16 under FSDP2 too: its embeddings and head are a 72B model's largest
    # tensors left, and FSDP2 would only cast fp32 copies of them down to bf16 for every forward
    frozen_bf16 = bf16 and cfg.is_lora and (parallel == "ddp" or cfg.finetuning_type == "qlora")
    return dict(bf16=bf16, fp16=fp16, frozen_bf16=frozen_bf16, bf16_weights=cfg.master_weights == "bf16")
