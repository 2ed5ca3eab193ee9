"""The model and the method: the base model, the stage, full / LoRA / Q-LoRA and their keys, recomputation and
precision."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from meshtune.config.section import JOB, MATH, Keys, Section, fits_fp32, split_commas

MODEL = Section("model and method", MATH)
OTHER_STAGES = {"rm": "reward-model training (rm)", "ppo": "PPO", "grpo": "GRPO"}
STAGES_TRAINED = ("supervised fine-tuning (sft), continued pre-training on raw text (pt), DPO-family preference "
                  "training on pairs (dpo) and KTO on unpaired preference data (kto)")


class ModelKeys(Keys):
    model_name_or_path: str = MODEL(description="local Hugging Face model directory (config.json, safetensors, "
                                                "tokenizer); meshtune never downloads")
    stage: Literal["sft", "pt", "dpo", "kto"] = MODEL(
        "sft", "what the run trains (LLaMA-Factory's key): sft (supervised fine-tuning on conversations: the "
               "assistant's replies are trained) | pt (continued pre-training on raw text: LLaMA-Factory's columns "
               "{prompt: text}, a JSONL or JSON of records with a 'text' field, or .txt files read a document a line; "
               "every token trained, an EOS after each document, a document longer than cutoff_len split into pieces "
               "that overlap by one token, packed by default with no attention across documents) | dpo (preference "
               "pairs: a prompt with a chosen and a rejected response, LLaMA-Factory's ranking: true data or TRL's "
               "prompt / chosen / rejected; the loss pref_loss) | kto (KTO, as TRL's KTOTrainer: unpaired responses, "
               "each marked desirable or not: LLaMA-Factory's kto_tag column, or TRL's prompt / completion / label; "
               "the last assistant turn is the response trained). dpo and kto compare the policy with a frozen "
               "reference (ref_model)")
    finetuning_type: Literal["full", "lora", "qlora"] = MODEL(
        "lora", "full (every weight trains) | lora (small adapters on a frozen base) | qlora (LoRA on a base whose "
                "transformer-block weights are stored in 4-bit NF4: about a quarter of the memory, for models that do "
                "not fit otherwise; read block by block, and sharded under zero2 / zero3 / hsdp; needs torchao)")
    lora_rank: int = MODEL(8, "LoRA rank r: larger adapters learn more and cost more memory", gt=0)
    lora_alpha: float | None = MODEL(None, "LoRA scaling alpha (the update is scaled by alpha / r); default 2 x "
                                           "lora_rank", gt=0)
    lora_dropout: float = MODEL(0.0, "dropout on the LoRA path; leave 0 for losses that do not depend on the number of "
                                     "processes", ge=0.0, lt=1.0)
    lora_dropout_masks: Literal["auto", "torch", "counter"] = MODEL(
        "auto", "lora_dropout's masks: torch (torch.nn.Dropout, as peft) | counter (each a hash of a seed the block "
                "draws at each forward and the element's position: the same keep probability, another random stream; "
                "a recomputed compiled block then rebuilds them inside its backward graph instead of running its "
                "forward graph again, which torch 2.11 cannot do with torch's dropout on CUDA) | auto (counter where "
                "compiled blocks are recomputed, torch elsewhere)")
    lora_target: list[str] = MODEL(["all"], "'all' (every linear layer but the output head) or module names, e.g. "
                                            "q_proj,v_proj")
    adapter_name_or_path: str | None = MODEL(None, "a PEFT LoRA adapter directory to continue training "
                                                   "(adapter_config.json + adapter_model.safetensors, e.g. an earlier "
                                                   "run's final/; a checkpoint-N becomes one with `meshtune export`): "
                                                   "the run starts from its weights, with its r, alpha, dropout and "
                                                   "target modules in place of lora_rank, lora_alpha, lora_dropout and "
                                                   "lora_target, as LLaMA-Factory continues an adapter; lora and qlora")
    additional_target: list[str] = MODEL([], "lora: modules trained in full beside the adapters (LLaMA-Factory's "
                                             "additional_target, PEFT's modules_to_save), e.g. embed_tokens,lm_head: a "
                                             "trainable fp32 copy of each, saved in the adapter; default none")
    gradient_checkpointing: bool | None = MODEL(None, "recompute activations in backward instead of storing them: less "
                                                      "memory, more compute. Default: on GPUs, the run's largest step "
                                                      "is measured before training and only the blocks it must are "
                                                      "recomputed to fit memory_budget (none where the step fits; "
                                                      "where even every block recomputed does not fit, the run stops "
                                                      "at start with the measured need); on CPU none. true: recompute "
                                                      "gradient_checkpointing_ratio of the blocks | "
                                                      "false: never", scope=JOB)
    gradient_checkpointing_ratio: float | Literal["auto"] = MODEL(
        "auto", "the fraction of transformer blocks recomputed, spread evenly (1 = all, as HF; 0.5 = every other "
                "block: faster, more memory; a value here turns recomputation on unless gradient_checkpointing is "
                "false) | auto: on GPUs, the fewest blocks whose step fits memory_budget, chosen from two measured "
                "steps of the run's largest micro-batch before training (logged); on CPU, with gradient_checkpointing "
                "true, every block", scope=JOB)
    memory_budget: float | None = MODEL(None, "with gradient_checkpointing_ratio auto: the GPU memory a step may take, "
                                              "in GiB (above 1) or as a fraction of the card (or of gpu_memory_limit) "
                                              "(1 or less), counted as torch allocates it "
                                              "(torch.cuda.max_memory_allocated, the speed table's peak GiB). Default "
                                              "0.9 of the card; a step over it that fits with every block "
                                              "recomputed still trains where the card keeps 0.5 GiB (1 GiB with "
                                              "NCCL) free beside the allocator's cache", gt=0.0, scope=JOB)
    bf16: bool | None = MODEL(None, "bf16 compute on GPUs (fp32 master weights); default: on where the GPU supports "
                                    "it; CPU runs fp32")
    fp16: bool = MODEL(False, "fp16 compute on GPUs without bf16 (V100, T4), as HF's fp16: autocast to fp16 with a "
                              "dynamic loss scale (torch's GradScaler, its sharded one under zero2 / zero3 / hsdp: a "
                              "step whose gradients overflow is skipped and the scale halves), fp32 master weights; "
                              "FSDP2 then gathers fp32 parameters. CPU runs fp32")

    _lora_alpha_fits_fp32 = field_validator("lora_alpha")(staticmethod(fits_fp32))

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_meshtune_trains(cls, value: Any) -> Any:
        """The stages of LLaMA-Factory and TRL meshtune has no trainer for, refused by name."""
        if isinstance(value, str) and value.lower() in OTHER_STAGES:
            raise ValueError(f"{value}: {OTHER_STAGES[value.lower()]} is another trainer's; meshtune trains "
                             f"{STAGES_TRAINED}")
        return value

    @field_validator("gradient_checkpointing_ratio", mode="before")
    @classmethod
    def _ratio(cls, value: Any) -> Any:
        """One message for a wrong value, not one per member of `float | "auto"`."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            ratio = float(value)
        except (TypeError, ValueError):
            ratio = None
        if isinstance(value, bool) or ratio is None or not 0 < ratio <= 1:
            raise ValueError("must be auto or a fraction of the blocks, above 0 and at most 1 (1 = every block)")
        return ratio

    @field_validator("adapter_name_or_path", mode="before")
    @classmethod
    def _one_adapter(cls, value: Any) -> Any:
        """LLaMA-Factory takes a comma-separated list and merges all but the last into the base; one is continued
        here, and the others are merged by the user first."""
        parts = value.split(",") if isinstance(value, str) else value
        if not isinstance(parts, list):
            return value
        parts = [str(part).strip() for part in parts if str(part).strip()]
        if len(parts) > 1:
            raise ValueError(f"{len(parts)} adapters ({', '.join(parts)}): meshtune continues one. Merge the others "
                             f"into the base first (`meshtune export ADAPTER --merge --base-model BASE --output "
                             f"MERGED`, one after the other), then set model_name_or_path: MERGED and "
                             f"adapter_name_or_path: {parts[-1]}")
        return parts[0] if parts else None

    @field_validator("additional_target", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        """`additional_target: null` (LLaMA-Factory's default) and an empty override mean none."""
        return [] if value is None else value

    _method_lists = field_validator("lora_target", "additional_target", mode="before")(staticmethod(split_commas))

    @model_validator(mode="after")
    def _check_method(self) -> "ModelKeys":
        """What the method's keys ask that it does not do."""
        if self.adapter_name_or_path and not self.is_lora:
            raise ValueError(f"adapter_name_or_path: {self.adapter_name_or_path} is a LoRA adapter, which "
                             f"finetuning_type: {self.finetuning_type} does not train; continue it with "
                             f"finetuning_type: lora (or qlora), or merge it into the base first (`meshtune export "
                             f"ADAPTER --merge --output MERGED`) and fine-tune MERGED in full")
        if self.additional_target and self.finetuning_type != "lora":
            raise ValueError(f"additional_target: {','.join(self.additional_target)} trains modules in full beside "
                             f"LoRA's adapters; " + ("under full fine-tuning every module trains already: drop it"
                             if self.finetuning_type == "full" else "Q-LoRA keeps the base frozen in 4-bit, and its "
                             "embeddings and head are not copied to train in full: drop it, or use "
                             "finetuning_type: lora"))
        if self.memory_budget is not None and self.gradient_checkpointing is False:
            raise ValueError(f"memory_budget: {self.memory_budget:g} is met by recomputing blocks, which "
                             f"gradient_checkpointing: false forbids; drop one of them")
        if self.memory_budget is not None and self.gradient_checkpointing_ratio != "auto":
            raise ValueError(f"memory_budget: {self.memory_budget:g} is read only by gradient_checkpointing_ratio: "
                             f"auto, not {self.gradient_checkpointing_ratio:g}; leave the ratio out (auto is its "
                             f"default) or drop memory_budget")
        return self

    @property
    def is_lora(self) -> bool:
        """LoRA adapters train and the base is frozen (lora and qlora)."""
        return self.finetuning_type in ("lora", "qlora")

    @property
    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def named_recompute_ratio(self) -> float | None:
        """gradient_checkpointing_ratio, or None (auto): the run plan's, measured before training on GPUs."""
        return None if self.gradient_checkpointing_ratio == "auto" else float(self.gradient_checkpointing_ratio)
