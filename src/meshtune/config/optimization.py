"""Optimisation: the batch, AdamW, the schedule and its warmup, the weights' precision, clipping, non-finite steps and
the seed."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from meshtune.config.section import JOB, MATH, Keys, Section, fits_fp32

OPTIMIZATION = Section("optimisation", MATH)


class OptimizationKeys(Keys):
    per_device_train_batch_size: int = OPTIMIZATION(1, "samples (or packed rows) per process per micro-step", gt=0)
    gradient_accumulation_steps: int = OPTIMIZATION(1, "micro-steps per optimizer step; global batch = "
                                                       "per_device_train_batch_size x this x processes", gt=0)
    learning_rate: float = OPTIMIZATION(1e-4, "peak learning rate (AdamW)", gt=0.0)
    weight_decay: float = OPTIMIZATION(0.0, "AdamW weight decay (never on biases and norms)", ge=0.0)
    adam_beta1: float = OPTIMIZATION(0.9, "AdamW beta1", gt=0.0, lt=1.0)
    adam_beta2: float = OPTIMIZATION(0.999, "AdamW beta2", gt=0.0, lt=1.0)
    adam_epsilon: float = OPTIMIZATION(1e-8, "AdamW epsilon", gt=0.0)
    num_train_epochs: float = OPTIMIZATION(3.0, "epochs, used when max_steps is -1", gt=0.0)
    max_steps: int = OPTIMIZATION(-1, "optimizer steps; -1 = from num_train_epochs", ge=-1)
    lr_scheduler_type: Literal["cosine", "linear", "constant", "constant_with_warmup", "deepspeed_warmup_lr",
                               "deepspeed_warmup_decay_lr", "deepspeed_warmup_cosine_lr"] = OPTIMIZATION(
        "cosine", "HF's schedule of that name, warmup from lr 0 included: cosine | linear (decay to 0 after the "
                  "warmup) | constant (no warmup, as in HF) | constant_with_warmup | DeepSpeed's WarmupLR, "
                  "WarmupDecayLR, WarmupCosineLR as DeepSpeed computes them (what a DeepSpeed JSON's scheduler "
                  "becomes): deepspeed_warmup_lr | deepspeed_warmup_decay_lr | deepspeed_warmup_cosine_lr")
    warmup_type: Literal["log", "linear"] | None = OPTIMIZATION(
        None, "the deepspeed_* schedules' warmup (DeepSpeed's warmup_type): log (DeepSpeed's default) | linear. HF's "
              "schedules warm up linearly")
    cos_min_ratio: float | None = OPTIMIZATION(
        None, "deepspeed_warmup_cosine_lr: the share of learning_rate it decays to (DeepSpeed's cos_min_ratio); "
              "default DeepSpeed's 0.0001", ge=0.0, le=1.0)
    warmup_ratio: float = OPTIMIZATION(0.0, "warmup as a fraction of all steps, rounded up", ge=0.0, lt=1.0)
    warmup_steps: float = OPTIMIZATION(0, "warmup steps; overrides warmup_ratio when > 0. A fraction below 1 is a "
                                          "share of all steps, as in transformers 5", ge=0)
    master_weights: Literal["fp32", "bf16"] = OPTIMIZATION(
        "fp32", "full fine-tuning: the weights the optimizer updates. fp32 (16 bytes a parameter with AdamW: fp32 "
                "weights, gradients and two moments; bf16 compute) | bf16 (8 bytes: bf16 weights, gradients and "
                "moments, as HF Trainer trains a bf16 model, but each update computed in fp32 and rounded to bf16 "
                "stochastically so small updates survive on average; half the memory. On CUDA one Triton kernel "
                "updates every parameter. Runs are reproducible for one layout, and layouts agree within bf16 rounding "
                "rather than exactly)")
    max_grad_norm: float = OPTIMIZATION(1.0, "gradient clipping; 0 turns it off (the norm is still logged)", ge=0.0)
    on_nonfinite: Literal["stop", "skip"] = OPTIMIZATION(
        "stop", "a step whose loss or gradient norm is not finite (NaN or inf, from a bad sample, an overflow or a "
                "broken node): stop (the job ends naming the step, the ranks, their nodes and the samples of the "
                "batch; no checkpoint nor final/ of that step or a later one is written; the check reads flags kept on "
                "the device where the loop waits anyway, so steps do not slow down) | skip (the step makes no update: "
                "no optimizer step, and the learning rate schedule waits, as Megatron-LM and HF Trainer skip a step "
                "whose gradients overflowed; metrics.jsonl lists it; the ranks agree on each step before its update, "
                "one small all-gather and one wait for the device per step)", scope=JOB)
    max_nonfinite_skips: int = OPTIMIZATION(5, "on_nonfinite skip: the run stops at the non-finite step after this "
                                               "many were skipped (counted over the whole run, resumes "
                                               "included)", ge=0, scope=JOB)
    grad_reduce_dtype: Literal["fp32", "bf16"] = OPTIMIZATION(
        "fp32", "the dtype gradients cross the processes in: fp32 (exact sums) | bf16 (half the bytes, as DeepSpeed's "
                "default under bf16; sums over many processes lose precision: try it when the network is the "
                "bottleneck). The optimizer always steps fp32 gradients")
    train_batch_size: int | None = OPTIMIZATION(None, "the global batch you expect (per_device_train_batch_size x "
                                                      "gradient_accumulation_steps x data-parallel processes), as "
                                                      "DeepSpeed's train_batch_size: the job stops at start naming the "
                                                      "three when it differs; default: not checked", gt=0, scope=JOB)
    seed: int = OPTIMIZATION(42, "seeds the data order, the init of new weights and every random stream")

    _fit_fp32 = field_validator("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm")(
        staticmethod(fits_fp32))

    @field_validator("warmup_steps")
    @classmethod
    def _whole_steps_stay_whole(cls, value: float) -> float:
        """A count of steps is kept an int (the run's identity hashes `10`, not `10.0`); a fraction is a share."""
        return int(value) if value == int(value) else value

    @model_validator(mode="after")
    def _check_schedule(self) -> "OptimizationKeys":
        """The DeepSpeed schedules' own keys only with those schedules."""
        deepspeed_schedule = self.lr_scheduler_type.startswith("deepspeed_")
        if self.warmup_type is not None and not deepspeed_schedule:
            raise ValueError(f"warmup_type: {self.warmup_type} shapes the warmup of DeepSpeed's schedules "
                             f"(lr_scheduler_type deepspeed_warmup_lr, deepspeed_warmup_decay_lr, "
                             f"deepspeed_warmup_cosine_lr); lr_scheduler_type {self.lr_scheduler_type} is HF's, "
                             f"which warms up linearly: drop warmup_type")
        if self.cos_min_ratio is not None and self.lr_scheduler_type != "deepspeed_warmup_cosine_lr":
            raise ValueError(f"cos_min_ratio: {self.cos_min_ratio:g} is where deepspeed_warmup_cosine_lr ends; "
                             f"lr_scheduler_type {self.lr_scheduler_type} does not read it: drop it")
        return self
