"""The training config: one YAML file plus `key=value` overrides, validated before any process group exists.

Key names follow Hugging Face TrainingArguments and LLaMA-Factory where one exists, so users can bring their
configs. Every error names the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshtune.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1:4` as the base-60 integer 64; here it stays the text an elastic `nnodes: 1:4` means."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if not (tag.endswith(":int") or tag.endswith(":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern in (("tag:yaml.org,2002:int", r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o?[0-7_]+)$"),
                       ("tag:yaml.org,2002:float",
                        r"^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"
                        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")):
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), list("-+0123456789."))


def _no_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A key given twice in one mapping is an error: YAML would silently keep the last one."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' is given twice (lines {seen[key]} and {key_node.start_mark.line + 1}); "
                            f"keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class Section:
    """One group of keys: its title in `meshtune train --help`, and the scope its keys have unless one says otherwise.

    Scopes: `math` keys define what is computed (`TrainConfig.hash()`: the run's identity, kept in every checkpoint's
    manifest); `job` keys must be the same on every node without changing the math (they decide collectives, such as
    when to evaluate or save); `node` keys may differ from node to node (where this node writes, its address, its
    housekeeping). The startup agreement check compares the math and job keys of every node.
    """

    def __init__(self, title: str, scope: str):
        self.title, self.scope = title, scope

    def __call__(self, default: Any = ..., description: str = "", scope: str | None = None, **constraints) -> Any:
        return Field(default, description=description, **constraints,
                     json_schema_extra={"section": self.title, "scope": scope or self.scope})


MATH, JOB, NODE = "math", "job", "node"
TEXT_FORMAT = "text"  # how stage: pt reads its datasets (data/raw_text.py)
UNPAIRED_FORMAT = "unpaired"  # how stage: kto reads its datasets (data/unpaired.py)
OTHER_STAGES = {"rm": "reward-model training (rm)", "ppo": "PPO", "grpo": "GRPO"}
STAGES_TRAINED = ("supervised fine-tuning (sft), continued pre-training on raw text (pt), DPO-family preference "
                  "training on pairs (dpo) and KTO on unpaired preference data (kto)")
PREF_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")  # train/objectives/preference.py computes them
DPO_ONLY = ("pref_loss", "pref_ftx", "dpo_label_smoothing", "simpo_gamma")  # the PREFERENCE keys only dpo reads
KTO_ONLY = ("kto_chosen_weight", "kto_rejected_weight")  # and those only kto reads
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 value (torch.finfo(torch.float32).max)
TRACKERS = ("tensorboard", "wandb", "mlflow")  # report_to's trackers (train/sinks.py)
# the other trackers HF's and LLaMA-Factory's report_to know
OTHER_TRACKERS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "neptune", "swanlab",
                  "trackio")
MODEL = Section("model and method", MATH)
DATA = Section("data", MATH)
PREFERENCE = Section("preference training (stage: dpo and kto)", MATH)
OPTIMIZATION = Section("optimisation", MATH)
SPEED = Section("speed: each lever is on where it pays and can be turned off to compare or debug; "
                "the math stays the same", JOB)
PARALLELISM = Section("parallelism", JOB)
LAUNCH = Section("nodes and launch (each node may set these for itself; the launcher checks them)", NODE)
OUTPUT = Section("outputs, evaluation and checkpoints", JOB)
WATCH = Section("stragglers and hangs", JOB)
CROSS_NODE = Section("reduction across nodes: fewer bytes between the nodes (bench/shaped_link.py measures each)", JOB)


# the chat templates data/templates.py renders (its FORMATS, one each; tests/test_templates.py ties the two), by the
# names LLaMA-Factory gives them, ChatML first
TEMPLATE_NAMES = ("chatml", "qwen", "qwen3", "qwen3_nothink", "llama3", "llama2", "mistral", "gemma", "gemma3", "phi",
                  "phi4", "deepseek", "deepseek3", "glm4", "yi", "baichuan2", "intern2", "cohere", "default", "empty",
                  "alpaca")


class TrainConfig(BaseModel):
    """All keys of `meshtune train`. The field descriptions are the `--help` text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
                                              "0.9 of the card", gt=0.0, scope=JOB)
    bf16: bool | None = MODEL(None, "bf16 compute on GPUs (fp32 master weights); default: on where the GPU supports "
                                    "it; CPU runs fp32")
    fp16: bool = MODEL(False, "fp16 compute on GPUs without bf16 (V100, T4), as HF's fp16: autocast to fp16 with a "
                              "dynamic loss scale (torch's GradScaler, its sharded one under zero2 / zero3 / hsdp: a "
                              "step whose gradients overflow is skipped and the scale halves), fp32 master weights; "
                              "FSDP2 then gathers fp32 parameters. CPU runs fp32")

    dataset: list[str] = DATA(description="training data: file(s), JSON list or JSONL, or names in "
                                          "dataset_dir/dataset_info.json (LLaMA-Factory's registry); comma-separated "
                                          "or a list")
    eval_dataset: list[str] | None = DATA(None, "held-out data file(s) or dataset_info.json names; otherwise val_size "
                                                "splits the training data")
    dataset_dir: str = DATA("data", "folder of LLaMA-Factory's dataset_info.json: a dataset entry that is no file is "
                                    "looked up there by name (its file_name, formatting, columns and tags)")
    max_samples: int | None = DATA(None, "use only the first N records of each dataset (as LLaMA-Factory); "
                                         "default: all", gt=0)
    dataset_format: Literal["auto", "alpaca", "sharegpt", "qwen", "messages"] = DATA(
        "auto", "auto (detected per file) | alpaca | sharegpt | qwen | messages")
    template: Literal[("auto", "tokenizer", *TEMPLATE_NAMES)] = DATA(
        "auto", "auto (the tokenizer's chat template, else ChatML) | tokenizer (its own, required) | chatml | "
                f"LLaMA-Factory's names: {', '.join(TEMPLATE_NAMES[1:])} (rendered as LLaMA-Factory renders them: the "
                "tokenizer's own template only where it renders the same text; final/ saves the one trained)")
    default_system: str | None = DATA(None, "the system prompt of a conversation that has none (LLaMA-Factory's key): "
                                            "replaces the template's own default; Qwen's finetune.py flags set "
                                            "'You are a helpful assistant.', as finetune.py renders")
    train_on_prompt: bool = DATA(False, "also train on the prompt: system, user and tool turns and the assistant "
                                        "header (LLaMA-Factory's key); default: assistant turns only")
    mask_history: bool = DATA(False, "train only the last assistant turn of each conversation, earlier ones are "
                                     "context; a conversation longer than cutoff_len gives its last turn the tokens "
                                     "first (LLaMA-Factory's key)")
    cutoff_len: int = DATA(2048, "the most tokens a sample keeps. A longer one is cut as LLaMA-Factory cuts it: turn "
                                 "by turn while tokens remain, each turn's prompt and response shortened to share "
                                 "what is left (each keeps its first tokens), so a long prompt is cut and its "
                                 "response still trained", gt=1)
    val_size: float = DATA(0.0, "held-out part of the training data: a fraction (<1) or a count", ge=0.0)
    skip_invalid: bool = DATA(False, "skip malformed records (counted) instead of stopping at the first")
    tokenized_path: str | None = DATA(None, "where the tokenized cache lives (default: output_dir/tokenized); put it "
                                            "on storage all nodes share to tokenize once", scope=NODE)
    packing: bool = DATA(False, "pack samples into rows of up to cutoff_len (no attention across samples): fewer, "
                                "fuller rows; default true for stage: pt")
    group_by_length: bool = DATA(False, "without packing: micro-batches of similar lengths inside each global batch "
                                        "(less padding)")
    dataloader_drop_last: bool = DATA(False, "drop each epoch's last partial global batch: every step then trains "
                                             "exactly the global batch, and the rows left over are not trained that "
                                             "epoch. Default: as HF Trainer, an epoch's last step trains the rows left "
                                             "over, so every sample is seen each epoch")

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

    padding_free: bool | None = SPEED(None, "the samples of a micro-batch end to end in one row, attended by torch's "
                                            "variable-length flash attention: no padding, no attention across samples; "
                                            "micro-batches then hold equal token counts rather than equal sample "
                                            "counts (stage: dpo: a micro-batch's pairs, both responses of each, in "
                                            "one row). Default: on with CUDA; elsewhere off (it works there too, one "
                                            "attention call per sample)")
    fused_loss: bool = SPEED(True, "the output head and cross-entropy in row chunks over target positions only: the "
                                   "full-vocabulary logits are never stored (stage: dpo: each response's summed "
                                   "log-prob the same way; off for kto). Turn off to compare with the plain "
                                   "F.cross_entropy path")
    torch_compile: bool | None = SPEED(None, "torch.compile every transformer block and the fused loss. Default: on "
                                             "with CUDA (the first steps then include compilation); turn off to debug")
    optim: Literal["auto", "adamw_torch", "adamw_torch_fused"] = SPEED(
        "auto", "auto (fused AdamW on CUDA) | adamw_torch | adamw_torch_fused")
    grad_sync: Literal["ddp", "flat"] = SPEED("ddp", "parallel ddp on several processes: ddp (DistributedDataParallel: "
                                                     "gradients all-reduced in buckets during backward) | flat (no "
                                                     "wrapper: one all-reduce of all gradients after backward; can be "
                                                     "faster for small trainable sets such as LoRA)")
    ddp_bucket_cap_mb: float | None = SPEED(None, "parallel ddp: MB of gradients DDP all-reduces at once, as HF's "
                                                  "TrainingArguments; larger buckets mean fewer collectives, each "
                                                  "starting later in backward. Default: torch's 25", gt=0)
    fsdp_blocks_per_unit: int | None = SPEED(None, "zero2 / zero3 / hsdp: consecutive transformer blocks sharded as "
                                                   "one FSDP2 unit. More blocks a unit: fewer, larger collectives and "
                                                   "fewer host hooks each step, at the memory of gathering them at "
                                                   "once. Default: as many as keep a unit within about 1B parameters, "
                                                   "at most 4; lower it if zero3 runs out of memory", ge=1)
    fsdp_prefetch: int = SPEED(0, "zero2 / zero3 / hsdp: blocks whose parameters are gathered explicitly ahead of use "
                                  "in forward and backward (0 = FSDP2's own implicit prefetching, usually "
                                  "as fast)", ge=0)
    expandable_segments: bool = SPEED(True, "CUDA: the caching allocator grows its segments instead of allocating new "
                                            "ones (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): no fragmentation "
                                            "retries when large units are gathered and freed. A "
                                            "PYTORCH_CUDA_ALLOC_CONF you set yourself is left as it is", scope=NODE)
    gc_interval: int | None = SPEED(None, "Python's garbage collection every N optimizer steps, on all ranks at the "
                                          "same step and never in between, so no rank stalls the others at a "
                                          "collective while it collects. 0 = Python's automatic collection. Default: "
                                          "50 with several processes, 0 with one", ge=0, scope=NODE)
    activation_memory_budget: float = SPEED(1.0, "torch_compile: the share of a compiled block's activations its "
                                                 "backward may keep (torch's partitioner budget). Below 1 the compiler "
                                                 "recomputes the operators that free the most memory for the least "
                                                 "time inside the block's own backward (matmul outputs last), instead "
                                                 "of recomputing whole blocks: a finer trade than "
                                                 "gradient_checkpointing_ratio for the blocks that are not "
                                                 "recomputed", gt=0.0, le=1.0)
    compile_combo_kernels: bool = SPEED(False, "torch_compile on CUDA: inductor's combo kernels, which launch "
                                               "independent small kernels of a block as one (the adapters' bf16 casts "
                                               "in forward, their fp32 gradients in backward): fewer launches where "
                                               "the host, not the GPU, sets the pace (LoRA with every block "
                                               "recomputed). The math is unchanged; Triton only, so CPU runs ignore it")
    cpu_affinity: Literal["auto", "none", "node", "exclusive"] = SPEED(
        "auto", "CUDA workers pinned to host CPUs: node (the CPUs of their GPU's NUMA node) | exclusive (a disjoint "
                "share of those CPUs for each process of the node, whole physical cores, so no two processes' host "
                "work competes for a core) | none. auto: node where the system tells the GPU's NUMA node, else nothing "
                "(exclusive is yours to try: on one-socket machines it only keeps processes off each "
                "other's cores)", scope=NODE)
    profile_steps: str | None = SPEED(None, "profile optimizer steps FIRST-LAST (e.g. 10-12) with torch.profiler: a "
                                            "Chrome trace per rank and rank 0's costliest operators in "
                                            "output_dir/profile/", scope=NODE)

    parallel: Literal["auto", "ddp", "zero2", "zero3", "hsdp"] = PARALLELISM(
        "auto", "auto | ddp | zero2 (FSDP2, parameters kept after forward) | zero3 (FSDP2, resharded after forward) | "
                "hsdp (shard inside a node, replicate across nodes). auto: ddp for LoRA, one process and CPU; Q-LoRA "
                "on several GPUs: ddp, or zero3 where the whole 4-bit model would take over half a GPU (hsdp across "
                "nodes where a node's GPUs hold it); full fine-tuning on one node: zero2, or zero3 where zero2's whole "
                "bf16 weights plus its share of the fp32 state would take over half a GPU; on several nodes: hsdp "
                "sharded over each node's GPUs, so only the gradients' all-reduce crosses the network (zero3 over all "
                "when a node cannot hold the model's state). LoRA under zero2 runs as ddp (ZeRO-2 never shards "
                "weights; the plan says so)")
    load_weights_on: Literal["rank0", "every_rank"] = PARALLELISM(
        "rank0", "rank0: only global rank 0 reads the model files; the other processes build the model without weights "
                 "and receive rank 0's (under zero2 / zero3 / hsdp only their shard), so a node's memory holds one "
                 "copy, not one per process | every_rank: each process reads the files itself")
    cpu_offload: bool = PARALLELISM(False, "zero2 / zero3 / hsdp: FSDP2's CPUOffloadPolicy: parameters, gradients and "
                                           "optimizer state live in CPU memory and the optimizer steps on the CPU "
                                           "(DeepSpeed's offload_optimizer / offload_param): trains models whose state "
                                           "does not fit in GPU memory, several times slower")
    hsdp_shard_size: int | None = PARALLELISM(None, "hsdp: processes that shard one replica; default: the processes of "
                                                    "one node (under tensor_parallel: counted in tensor-parallel "
                                                    "groups)", gt=0)
    tensor_parallel: int = PARALLELISM(1, "processes that split each attention and MLP layer of a block between them "
                                          "(DTensor tensor parallel, Qwen2 / Qwen3 / Llama / Mistral): inside one "
                                          "node, a divisor of its processes and of the attention and key-value heads; "
                                          "the data-parallel mode (parallel) then runs over the processes / "
                                          "tensor_parallel groups. For full fine-tuning of models whose blocks crowd "
                                          "a GPU under zero3 alone; 1: off", gt=0)
    context_parallel: int = PARALLELISM(1, "processes that split every row's positions between them (torch's ring "
                                           "attention, CUDA GPUs), for samples whose activations do not fit one GPU: "
                                           "each holds 1/context_parallel of them; rows padded to a multiple of 64 x "
                                           "context_parallel. A divisor of the processes, consecutive ranks; the "
                                           "data-parallel mode shards over them too. Not with packing, padding_free "
                                           "or tensor_parallel; 1: off", gt=0)

    pipeline_parallel: int = PARALLELISM(1, "pipeline stages the model's blocks are split into (torch.distributed."
                                            "pipelining): each stage holds consecutive blocks (the embedding on the "
                                            "first, the final norm and head on the last, the blocks balanced by their "
                                            "cost and the head's) and only activations and their gradients pass "
                                            "between stages. Outermost in the mesh: with one stage a node, only "
                                            "activations cross the nodes. A divisor of the processes; each stage's "
                                            "processes are data-parallel (ddp, zero2 or zero3); every optimizer step's "
                                            "micro-batches (gradient_accumulation_steps) are the schedule's. Full, "
                                            "LoRA and Q-LoRA (each process quantizing only its stages' blocks), "
                                            "stage: sft and pt; 1: off", gt=0)
    pipeline_schedule: Literal["auto", "gpipe", "1f1b", "interleaved_1f1b", "zbv"] = PARALLELISM(
        "auto", "pipeline_parallel's schedule (torch's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B / "
                "ScheduleZBVZeroBubble): gpipe runs every micro-batch's forward, then every backward; 1f1b alternates "
                "them once the pipeline is full, so a stage holds the activations of at most pipeline_parallel "
                "micro-batches, not all of them; interleaved_1f1b gives each process pipeline_virtual_stages "
                "stages (r, r + pipeline_parallel, ...), a smaller bubble for more sends; zbv two stages a process in "
                "a V (r and 2 x pipeline_parallel - 1 - r), backward split into its input's and its weights' "
                "gradients to fill the bubble. auto: 1f1b where the step has at least pipeline_parallel "
                "micro-batches, else gpipe")
    pipeline_virtual_stages: int | None = PARALLELISM(
        None, "stages each process holds under pipeline_schedule: interleaved_1f1b (2 or more; unset: 2); zbv holds "
              "2, gpipe and 1f1b 1", gt=0)

    zero3_reshard_to_node: bool = CROSS_NODE(
        False, "parallel zero3 on several nodes: after forward each unit's weights are resharded to the processes of "
               "one node, not to all (FSDP2's reshard_after_forward = processes a node, ZeRO++'s hierarchical "
               "partitioning), so backward's all-gathers stay inside the node and only forward's cross the network: "
               "a third fewer bytes between nodes a micro-step. The math is unchanged (the same losses bit for bit); "
               "each process holds 1/(processes a node) of a unit's weights between its forward and backward, not "
               "1/(all processes)")
    powersgd_rank: int = CROSS_NODE(
        0, "parallel ddp on several processes: gradients cross as PowerSGD's rank-r factors (torch's powerSGD_hook, "
           "error feedback and warm start on; the first optimizer step all-reduced whole), a matrix of m x n in "
           "(m + n) x r numbers; tensors it would not shrink 2x cross whole. Approximate: the update differs from "
           "the exact one, and the error-feedback state is not checkpointed, so a resume restarts it. Measured on "
           "the demo task (`meshtune demo`: LoRA r 8, 2 processes, 180 steps), rank 1 learns slower: eval loss "
           "0.200 / 0.130 / 0.099 at steps 60 / 120 / 180 against the exact run's 0.113 / 0.0091 / 0.0076; rank 4 "
           "compresses none of its 8 x 128 adapters (under 2x) and matches the exact run. Over the first steps the "
           "losses stay within 2% of the exact ones (tested). Measure yours before relying on it. 0: off (exact "
           "all-reduce)", ge=0, scope=MATH)
    link_gbps: float | None = CROSS_NODE(
        None, "the line rate between the nodes, Gb/s a node (100 for 100 GbE). With parallel: auto, full fine-tuning "
              "and several nodes of GPUs, the plan then picks among hsdp, zero2, zero3 and pipeline parallel across "
              "the nodes (a stage a node) the mode whose predicted step exposes the least time on the link, taking "
              "the all-reduce's bus bandwidth as 90% of this rate and a GPU's compute as 40% of its measured bf16 "
              "matmul rate; run_plan.json gives the choice, the reason and every mode's predicted per-GPU efficiency. "
              "`meshtune doctor --bandwidth` measures the link's busbw (GB/s): its x 8 / 0.9 is this rate. It changes "
              "no math. Default: unset, the rules of docs/multi-node/choosing-parallel.md", gt=0.0)
    hsdp_replica_reduce_dtype: Literal["fp32", "bf16"] | None = CROSS_NODE(
        None, "parallel hsdp: the dtype of the gradients' all-reduce across the replicas (the nodes), apart from the "
              "reduce-scatter inside a node. Only grad_reduce_dtype's value is accepted: torch's FSDP2 "
              "(MixedPrecisionPolicy.reduce_dtype) reduces both in one dtype, the all-reduce running on the "
              "reduce-scatter's output. Default: grad_reduce_dtype")

    nproc_per_node: int | None = LAUNCH(None, "processes on this machine; default: env NPROC_PER_NODE, else visible "
                                              "GPUs (1 on CPU)", gt=0)
    nnodes: str | None = LAUNCH(None, "nodes in the job, or an elastic range MIN:MAX; default: env NNODES / the "
                                      "scheduler, else 1")
    node_rank: int | None = LAUNCH(None, "this node's rank (0 = the node at master_addr); default: env NODE_RANK / the "
                                         "scheduler", ge=0)
    master_addr: str | None = LAUNCH(None, "address of node 0, the rendezvous host; default: env MASTER_ADDR / the "
                                           "scheduler, else 127.0.0.1")
    master_port: int | None = LAUNCH(None, "rendezvous port on master_addr; required for several nodes (the same free "
                                           "port on every node)", gt=0, lt=65536)
    local_addr: str | None = LAUNCH(None, "the address other nodes reach this node at (torchrun --local-addr); "
                                          "default: hostname lookup. Set it when the hostname resolves to the "
                                          "wrong network")
    max_restarts: int = LAUNCH(3, "times torchrun restarts all workers after a failure (they resume from the newest "
                                  "checkpoint)", ge=0)
    rdzv_backend: Literal["c10d", "etcd-v2"] = LAUNCH(
        "c10d", "c10d: node 0's launcher hosts the rendezvous store on MASTER_ADDR:MASTER_PORT, nothing else to run; "
                "when node 0 dies the other nodes wait for it to be relaunched and rejoin | etcd-v2: an etcd server at "
                "rdzv_endpoint holds the rendezvous (v2 API: start etcd with --enable-v2), so it outlives any node; "
                "needs python-etcd (pip install 'meshtune[etcd]')")
    rdzv_endpoint: str | None = LAUNCH(None, "rdzv_backend etcd-v2: the etcd server as host:port, the same on every "
                                             "node (MASTER_ADDR and MASTER_PORT are then not needed)")
    rdzv_timeout: int = LAUNCH(300, "seconds to wait for all nodes to join before failing with a diagnosis", gt=0)
    preflight: bool | Literal["bandwidth"] = LAUNCH(
        True, "on several nodes, the launcher's first step: the checks of `meshtune doctor` (node ranks, launch "
              "settings, config, versions, model and data checksums, shared output_dir, clocks, network interface) "
              "across the nodes, waiting up to rdzv_timeout for them; one line when all pass, the table when one needs "
              "a look, and no torchrun when one fails | bandwidth: the same, plus the bandwidth test between the nodes "
              "and its verdict for this config (about 10-60 s more) | false: none. Skipped by a node 0 relaunched into "
              "its running job and by a node joining one. Set it alike on every node", scope=JOB)
    ddp_timeout: int = LAUNCH(600, "seconds a collective may wait before the job fails", gt=0)
    gpu_memory_limit: float | None = LAUNCH(None, "GiB each process may allocate on its GPU "
                                                  "(torch.cuda.set_per_process_memory_fraction): beyond it an "
                                                  "allocation fails as out of memory, as on a smaller card. Rehearse a "
                                                  "run meant for 24 GB GPUs (gpu_memory_limit: 24) on larger ones, or "
                                                  "leave room on a shared card; parallel: auto plans for it. "
                                                  "Ignored on CPU", gt=0)

    output_dir: str = OUTPUT("output", "where metrics.jsonl, config.yaml, run_plan.json, loss.png, checkpoints and "
                                       "final/ go; shared storage across nodes (checked at start)", scope=NODE)
    logging_steps: int = OUTPUT(10, "log (and write metrics.jsonl) every N optimizer steps; the ranks compare their "
                                    "step times then (a collective), so it is the same on every node", gt=0)
    report_to: list[str] = OUTPUT([], "experiment trackers that also get every metrics record, the config and run "
                                      "plan, and checkpoint events (global rank 0 writes; metrics.jsonl stays the "
                                      "record): tensorboard (output_dir/tensorboard/) | wandb (W&B; WANDB_MODE=offline "
                                      "keeps it in output_dir/wandb/) | mlflow (a store in output_dir/mlruns/, or "
                                      "MLFLOW_TRACKING_URI) | a list of them | all (every one installed) | none. A "
                                      "resumed run continues the same tracker runs. Each needs its package: pip "
                                      "install 'meshtune[tensorboard]' (or wandb, mlflow; trackers for all three)",
                                  scope=NODE)
    per_device_eval_batch_size: int = OUTPUT(8, "samples per process per evaluation step", gt=0)
    eval_strategy: Literal["steps", "epoch", "no"] = OUTPUT(
        "steps", "with val_size or eval_dataset, when to evaluate: steps (every eval_steps, and at the end) | epoch "
                 "(at the end of every epoch, and at the end) | no (only at the end)")
    eval_steps: int | None = OUTPUT(None, "evaluate every N steps (default: only at the end); needs val_size or "
                                          "eval_dataset", gt=0)
    save_final: bool = OUTPUT(True, "write the trained model (or LoRA adapter) to output_dir/final at the end; false "
                                    "for throughput runs and smoke tests, where only the metrics matter")
    plot_loss: bool = OUTPUT(True, "draw output_dir/loss.png (train and eval loss by step) at the end of the run; "
                                   "false leaves it out, and with it matplotlib's import (about a second of CPU) from "
                                   "every run: smoke tests, sweeps of short runs")
    save_strategy: Literal["steps", "epoch", "no"] = OUTPUT(
        "steps", "when to write sharded checkpoints: steps (every save_steps) | epoch (at the end of every epoch and "
                 "at the last step; save_steps is not read) | no (none: only final/)")
    save_steps: int = OUTPUT(0, "save_strategy steps: write a sharded checkpoint every N optimizer steps and at the "
                                "last one (0 = only final/)", ge=0)
    save_total_limit: int | None = OUTPUT(None, "complete checkpoints to keep (the newest is never deleted); "
                                                "default: all", gt=0)
    async_save: bool = OUTPUT(False, "write checkpoints in the background while training continues (one at a time); "
                                     "turn on when saving stalls training")
    stop_grace_period: int = OUTPUT(60, "seconds a SIGTERM (what SLURM, Kubernetes and other schedulers send before "
                                        "preempting) leaves the job: every process finishes the step in progress and "
                                        "the next, a checkpoint is written if the last save's duration fits in what is "
                                        "left, and the job exits with 143 (128 + SIGTERM, retryable) to resume from "
                                        "there when relaunched. 0: stop after the step without saving. Give the "
                                        "scheduler at least this long between its SIGTERM and SIGKILL", ge=0)
    resume_allow_changed: list[str] = OUTPUT([], "keys of the run's math that may differ from the checkpoint being "
                                                 "resumed, e.g. max_steps to train further or learning_rate; by "
                                                 "default resuming a checkpoint written with other values is an error "
                                                 "naming the keys (checkpoints keep their config)")
    resume_from_checkpoint: str = OUTPUT("auto", "auto (newest complete, verified checkpoint in output_dir) | none | a "
                                                 "checkpoint path", scope=NODE)
    allow_local_checkpoints: bool = OUTPUT(False, "start even if output_dir is not shared by all nodes; the run then "
                                                  "writes no periodic checkpoint and does not resume")
    checkpoint_dir: str | None = OUTPUT(None, "where checkpoints and final/ go when not output_dir: a shared path, or "
                                              "an object store's URL (s3://bucket/prefix, gs://, az://; pip install "
                                              "'meshtune[s3]', gcs or azure). With a URL, everything a resume needs is "
                                              "in the store and output_dir (metrics, logs, the tokenized cache) may "
                                              "be each node's local disk; credentials and endpoint come from the "
                                              "store's client (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")
    log_level_all_ranks: Literal["debug", "info", "warning", "error"] | None = OUTPUT(
        None, "every rank logs from this level up, each line tagged [rank N], as HF's log_level_replica (env "
              "MESHTUNE_LOG_LEVEL_ALL_RANKS sets it too). Default: global rank 0 logs (at --log-level), the other "
              "ranks only the warnings they alone can see", scope=NODE)

    straggler_threshold: float = WATCH(0.15, "a rank whose own work per step (step time less its waits for the others) "
                                             "exceeds the median rank's by this fraction for straggler_intervals "
                                             "logging intervals in a row is named in a warning with its node and host; "
                                             "metrics.jsonl records the slowest rank of every interval whatever the "
                                             "value. 0: no warning", ge=0)
    straggler_intervals: int = WATCH(3, "logging intervals in a row a rank must stay over straggler_threshold before "
                                        "the warning", gt=0)
    hang_timeout: int | None = WATCH(None, "seconds without a completed optimizer step (evaluations and checkpoint "
                                           "writes not counted) after which every rank writes its stacks and torch's "
                                           "flight recorder of its last collectives to output_dir/hang-<time>/, "
                                           "summary.txt names the ranks that are stuck elsewhere or silent, and the "
                                           "workers exit for torchrun to restart them from the newest checkpoint. "
                                           "Default: 5 x the median step once 5 steps are done, at least 60 s, at most "
                                           "80% of ddp_timeout; until then rank 0 logs every minute that a step is "
                                           "still running, where, and what the GPU allocator holds. 0: off, notices "
                                           "included", ge=0)

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_text(cls, value: Any) -> Any:
        """`nnodes: 2` and `nnodes: 1:4` (elastic) both arrive as text."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("preflight", mode="before")
    @classmethod
    def _preflight(cls, value: Any) -> Any:
        """One message for a wrong value, not one per member of `bool | "bandwidth"`."""
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "bandwidth"):
            return {"true": True, "false": False}.get(value.strip().lower(), "bandwidth")
        if isinstance(value, bool) or value == "bandwidth":
            return value
        raise ValueError("must be true, false or bandwidth")

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

    @field_validator("save_strategy", "eval_strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> Any:
        """YAML 1.1 reads `no` as false; HF's names are compared without case."""
        if value is False:
            return "no"
        return value.lower() if isinstance(value, str) else value

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume_not_given(cls, value: Any) -> Any:
        """`resume_from_checkpoint: null` (as LLaMA-Factory's and HF's configs write it) means not given: auto."""
        return "auto" if value is None else value

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> Any:
        """HF's and LLaMA-Factory's values: none, all, a name, a list (or comma-separated names)."""
        names = [] if value is None else value.split(",") if isinstance(value, str) else value
        if not isinstance(names, list):
            return value
        names = list(dict.fromkeys(str(name).strip().lower() for name in names if str(name).strip()))
        if "none" in names and len(names) > 1:
            raise ValueError("none and trackers at once; give none, or the trackers")
        for name in names:
            if name in OTHER_TRACKERS:
                raise ValueError(f"meshtune does not write to {name}; it writes to {', '.join(TRACKERS)} (report_to "
                                 f"names them, or all), and always to output_dir/metrics.jsonl")
            if name not in (*TRACKERS, "all", "none"):
                raise ValueError(f"unknown tracker '{name}'; report_to takes none, all, {', '.join(TRACKERS)} or a "
                                 f"list of them")
        return [] if names == ["none"] else ["all"] if "all" in names else names

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value)
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
        if not match or int(match.group(1)) < 1 or int(match.group(2) or match.group(1)) < int(match.group(1)):
            raise ValueError(f"'{text}' is not FIRST-LAST with 1 <= FIRST <= LAST (optimizer steps, e.g. 10-12)")
        return text

    @field_validator("dataset", "eval_dataset", "lora_target", "additional_target", "resume_allow_changed",
                     mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        """LLaMA-Factory writes lists as comma-separated strings: `lora_target: q_proj,v_proj`."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_meshtune_trains(cls, value: Any) -> Any:
        """The stages of LLaMA-Factory and TRL meshtune has no trainer for, refused by name."""
        if isinstance(value, str) and value.lower() in OTHER_STAGES:
            raise ValueError(f"{value}: {OTHER_STAGES[value.lower()]} is another trainer's; meshtune trains "
                             f"{STAGES_TRAINED}")
        return value

    @field_validator("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm", "lora_alpha")
    @classmethod
    def _fits_fp32(cls, value: float | None) -> float | None:
        """These reach fp32 tensors (the optimizer's step, the clipping factor, the LoRA scale): a value beyond
        fp32's range would fail or turn inf only at the first step, after a restart of the workers."""
        if value is not None and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            raise ValueError(f"{value!r} is beyond the range of a 32-bit float (at most {FP32_MAX:.4g}), in which "
                             f"the training computes it; give a finite value below that")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _whole_steps_stay_whole(cls, value: float) -> float:
        """A count of steps is kept an int (the run's identity hashes `10`, not `10.0`); a fraction is a share."""
        return int(value) if value == int(value) else value

    @model_validator(mode="before")
    @classmethod
    def _pretraining_packs(cls, values: Any) -> Any:
        """stage: pt packs unless told not to, as LLaMA-Factory's pre-training does: its pieces are short documents
        and the tails of long ones."""
        if isinstance(values, dict) and values.get("stage") == "pt" and values.get("packing") is None:
            return {**values, "packing": True}
        return values

    @model_validator(mode="after")
    def _check_supported(self) -> "TrainConfig":
        if self.stage == "pt":
            sft_only = [key for key in ("train_on_prompt", "mask_history") if getattr(self, key)]
            if sft_only:
                raise ValueError(f"{' and '.join(sft_only)} choose which turns of a conversation train; stage: pt "
                                 f"trains every token of raw text: drop {' and '.join(sft_only)}")
            if self.dataset_format != "auto":
                raise ValueError(f"dataset_format: {self.dataset_format} reads conversations; stage: pt reads raw text "
                                 f"(a 'text' field, LLaMA-Factory's columns {{prompt: text}}, or .txt files): drop "
                                 f"dataset_format")
        self._check_preference()
        if self.stage == "kto":
            self._check_kto()
        if self.finetuning_type == "qlora" and self.cpu_offload:
            raise ValueError("cpu_offload: true with finetuning_type: qlora is not supported: the 4-bit shards stay on "
                             "the GPU. Shard them over more GPUs instead (parallel: zero3 across nodes)")
        if self.cpu_offload and self.parallel not in ("zero2", "zero3", "hsdp"):
            raise ValueError(f"cpu_offload: true needs a sharded mode (parallel: zero2, zero3 or hsdp), not parallel: "
                             f"{self.parallel}: the offload is FSDP2's; set parallel: zero3 (the least GPU memory)")
        if not self.dataset:
            raise ValueError("dataset: no file given; set dataset: path/to/train.jsonl")
        if self.adapter_name_or_path and not self.is_lora:
            raise ValueError(f"adapter_name_or_path: {self.adapter_name_or_path} is a LoRA adapter, which "
                             f"finetuning_type: {self.finetuning_type} does not train; continue it with "
                             f"finetuning_type: lora (or qlora), or merge it into the base first (`meshtune export "
                             f"ADAPTER --merge --output MERGED`) and fine-tune MERGED in full")
        unknown = [key for key in self.resume_allow_changed if key not in self.keys_of(MATH)]
        if unknown:
            raise ValueError(f"resume_allow_changed: {', '.join(unknown)} is not a key of the run's math; those are "
                             f"{', '.join(self.keys_of(MATH))}")
        if self.additional_target and self.finetuning_type != "lora":
            raise ValueError(f"additional_target: {','.join(self.additional_target)} trains modules in full beside "
                             f"LoRA's adapters; " + ("under full fine-tuning every module trains already: drop it"
                             if self.finetuning_type == "full" else "Q-LoRA keeps the base frozen in 4-bit, and its "
                             "embeddings and head are not copied to train in full: drop it, or use "
                             "finetuning_type: lora"))
        if self.fp16 and (self.bf16 or self.master_weights == "bf16"):
            raise ValueError("fp16: true and " + ("bf16: true" if self.bf16 else "master_weights: bf16") + " ask for "
                             "two compute precisions; keep fp16 on GPUs without bf16 (V100, T4), else bf16")
        if self.master_weights == "bf16" and self.finetuning_type != "full":
            raise ValueError(f"master_weights: bf16 is for full fine-tuning; {self.finetuning_type}'s adapters are "
                             f"small and train in fp32 (the frozen base is bf16 already): drop master_weights")
        if self.memory_budget is not None and self.gradient_checkpointing is False:
            raise ValueError(f"memory_budget: {self.memory_budget:g} is met by recomputing blocks, which "
                             f"gradient_checkpointing: false forbids; drop one of them")
        if self.memory_budget is not None and self.gradient_checkpointing_ratio != "auto":
            raise ValueError(f"memory_budget: {self.memory_budget:g} is read only by gradient_checkpointing_ratio: "
                             f"auto, not {self.gradient_checkpointing_ratio:g}; leave the ratio out (auto is its "
                             f"default) or drop memory_budget")
        deepspeed_schedule = self.lr_scheduler_type.startswith("deepspeed_")
        if self.warmup_type is not None and not deepspeed_schedule:
            raise ValueError(f"warmup_type: {self.warmup_type} shapes the warmup of DeepSpeed's schedules "
                             f"(lr_scheduler_type deepspeed_warmup_lr, deepspeed_warmup_decay_lr, "
                             f"deepspeed_warmup_cosine_lr); lr_scheduler_type {self.lr_scheduler_type} is HF's, "
                             f"which warms up linearly: drop warmup_type")
        if self.cos_min_ratio is not None and self.lr_scheduler_type != "deepspeed_warmup_cosine_lr":
            raise ValueError(f"cos_min_ratio: {self.cos_min_ratio:g} is where deepspeed_warmup_cosine_lr ends; "
                             f"lr_scheduler_type {self.lr_scheduler_type} does not read it: drop it")
        if self.val_size >= 1 and self.val_size != int(self.val_size):
            raise ValueError(f"val_size: {self.val_size} is neither a fraction below 1 nor a whole count")
        return self

    def _check_preference(self) -> None:
        """Preference keys only where they are read, and in combinations that compute something."""
        given = [key for key in self.keys_of_section(PREFERENCE.title)
                 if getattr(self, key) != type(self).model_fields[key].default]
        if self.stage not in ("dpo", "kto"):
            if given:
                raise ValueError(f"{', '.join(given)}: preference-training keys, read only by stage: dpo and kto; "
                                 f"this run is stage: {self.stage}: drop them or set stage: dpo or kto")
            return
        other, other_stage = (KTO_ONLY, "kto") if self.stage == "dpo" else (DPO_ONLY, "dpo")
        foreign = [key for key in given if key in other]
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: read only by stage: {other_stage}; this run is stage: "
                             f"{self.stage}: drop {'them' if len(foreign) > 1 else 'it'}")
        if self.ref_model_adapters and not self.ref_model:
            raise ValueError("ref_model_adapters is an adapter merged into ref_model; set ref_model (the folder of "
                             "its base model) too")
        if self.stage == "kto":
            if self.precompute_ref_log_probs is True:
                raise ValueError("precompute_ref_log_probs: true is for stage: dpo; stage: kto computes the "
                                 "reference's log-probs in each step (its KL term pairs each prompt with another "
                                 "sample's response, a different one every step): drop it")
            return  # _check_kto
        sft_only = [key for key in ("train_on_prompt", "mask_history") if getattr(self, key)]
        if sft_only:
            raise ValueError(f"{' and '.join(sft_only)} choose which turns of a conversation train; stage: dpo trains "
                             f"each pair's two responses after their prompt: drop {' and '.join(sft_only)}")
        if self.packing:
            raise ValueError("packing: true with stage: dpo: a micro-batch's pairs are already end to end in one "
                             "row, with no padding and no attention between sequences, wherever padding_free is on "
                             "(the default on CUDA); packing's rows of up to cutoff_len tokens do not apply to pairs: "
                             "drop packing (and neat_packing), and raise per_device_train_batch_size for more pairs "
                             "a row")
        if self.dpo_label_smoothing and self.pref_loss != "sigmoid":
            raise ValueError(f"dpo_label_smoothing: {self.dpo_label_smoothing:g} smooths the sigmoid (DPO) loss only; "
                             f"pref_loss: {self.pref_loss} does not read it: drop it")
        if self.pref_loss in ("orpo", "simpo") and self.precompute_ref_log_probs is True:
            raise ValueError(f"precompute_ref_log_probs: true precomputes the reference's log-probs, and pref_loss: "
                             f"{self.pref_loss} compares no reference: drop precompute_ref_log_probs, or use pref_loss "
                             f"sigmoid, hinge or ipo")
        if self.pref_loss in ("orpo", "simpo") and (self.ref_model or self.ref_model_adapters):
            raise ValueError(f"pref_loss: {self.pref_loss} compares no reference, so ref_model / ref_model_adapters "
                             f"would go unused: drop them, or use pref_loss sigmoid, hinge or ipo")
        if self.context_parallel > 1:
            raise ValueError(f"context_parallel: {self.context_parallel} with stage: dpo is not supported: a "
                             f"response's log-prob would be summed over positions split across processes; set "
                             f"context_parallel: 1 (tensor_parallel splits a large model instead)")

    @classmethod
    def keys_of_section(cls, title: str) -> list[str]:
        return [name for name, field in cls.model_fields.items() if field.json_schema_extra["section"] == title]

    @model_validator(mode="after")
    def _check_cross_node_reduction(self) -> "TrainConfig":
        mixed = self.hsdp_replica_reduce_dtype
        if mixed is not None and mixed != self.grad_reduce_dtype:
            raise ValueError(f"hsdp_replica_reduce_dtype: {mixed} with grad_reduce_dtype: {self.grad_reduce_dtype} "
                             f"is not supported: torch's FSDP2 all-reduces HSDP's gradients across the replicas in "
                             f"the dtype of the reduce-scatter inside a node (MixedPrecisionPolicy.reduce_dtype, one "
                             f"for both). Set grad_reduce_dtype: {mixed} for both, or drop hsdp_replica_reduce_dtype")
        if self.powersgd_rank and self.grad_reduce_dtype == "bf16":
            raise ValueError(f"powersgd_rank: {self.powersgd_rank} and grad_reduce_dtype: bf16 are two communication "
                             f"hooks, and DDP takes one: keep one of them")
        if self.powersgd_rank and self.grad_sync == "flat":
            raise ValueError(f"powersgd_rank: {self.powersgd_rank} is a hook on DDP's buckets; grad_sync: flat has "
                             f"none: drop one of them")
        return self

    @model_validator(mode="after")
    def _check_pipeline(self) -> "TrainConfig":
        """What pipeline_parallel does not combine with yet, refused by name with what to set."""
        pp = self.pipeline_parallel
        if pp == 1:
            return self
        refused = [(self.tensor_parallel > 1 or self.context_parallel > 1, "tensor_parallel or context_parallel "
                    "above 1 (a stage's processes are data-parallel only): set both to 1, or pipeline_parallel: 1"),
                   (self.stage in ("dpo", "kto"), f"stage: {self.stage} (its loss compares whole sequences' log-probs "
                    f"against a reference, which the stages' schedule does not carry): pipeline_parallel: 1"),
                   (self.packing, "packing: true (packed rows' block-diagonal attention is not carried between the "
                    "stages): drop packing"),
                   (self.padding_free is True, "padding_free: true (every stage receives micro-batches of one padded "
                    "shape): leave padding_free unset"),
                   (self.fp16, "fp16: true (each stage would judge the loss scale's overflows by its own gradients): "
                    "use bf16 or fp32"),
                   (self.powersgd_rank > 0, "powersgd_rank (a stage's replicas average their gradients in one flat "
                    "all-reduce, not DDP's buckets): drop powersgd_rank")]
        for refuse, why in refused:
            if refuse:
                raise ValueError(f"pipeline_parallel: {pp} cannot be combined with {why}")
        self._check_pipeline_stages()
        if self.parallel == "hsdp" or self.cpu_offload:
            raise ValueError(f"pipeline_parallel: {pp} with {'cpu_offload' if self.cpu_offload else 'parallel: hsdp'}"
                             f": a stage's processes are its replicas (ddp) or shard it over all of them (zero2, "
                             f"zero3), with the stages across the nodes; set parallel: ddp, zero2 or zero3")
        return self

    def _check_pipeline_stages(self) -> None:
        """The stages a process holds against the schedule: interleaved_1f1b 2 or more, zbv its V of 2, gpipe and
        1f1b one (auto among them); zbv's split backward and what it does not run under."""
        virtual, schedule = self.pipeline_virtual_stages, self.pipeline_schedule
        if virtual is None:
            return
        if schedule == "interleaved_1f1b" and virtual < 2:
            raise ValueError(f"pipeline_virtual_stages: {virtual} under pipeline_schedule: interleaved_1f1b, which "
                             f"interleaves several stages a process: set 2 or more, or pipeline_schedule: 1f1b")
        if schedule == "zbv" and virtual != 2:
            raise ValueError(f"pipeline_virtual_stages: {virtual} under pipeline_schedule: zbv, whose V holds 2 "
                             f"stages a process: set 2 or leave it unset, or use pipeline_schedule: interleaved_1f1b")
        if schedule in ("auto", "gpipe", "1f1b") and virtual != 1:
            raise ValueError(f"pipeline_virtual_stages: {virtual} with pipeline_schedule: {schedule}, which runs one "
                             f"stage a process: use pipeline_schedule: interleaved_1f1b, or leave it unset")

    def _check_kto(self) -> None:
        """What KTO does not combine with, refused by name with what to set."""
        refused = [(self.packing, "packing: true (each sample's response is scored on its own, beside another "
                    "sample's response to its prompt): drop packing"),
                   (self.context_parallel > 1, "context_parallel above 1 (a response's log-prob would be summed "
                    "over positions split across processes): set context_parallel: 1"),
                   (self.train_on_prompt or self.mask_history, "train_on_prompt or mask_history: KTO trains the "
                    "last assistant turn, the response its tag judges; drop them"),
                   (self.dataset_format not in ("auto", "sharegpt", "messages"), f"dataset_format: "
                    f"{self.dataset_format}: KTO reads sharegpt or messages records with a kto_tag, or TRL's prompt / "
                    f"completion / label; leave dataset_format auto")]
        for hit, why in refused:
            if hit:
                raise ValueError(f"stage: kto cannot be combined with {why}")

    @property
    def is_lora(self) -> bool:
        """LoRA adapters train and the base is frozen (lora and qlora)."""
        return self.finetuning_type in ("lora", "qlora")

    @property
    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    # What `auto` means for the keys whose `auto` is no run decision (those the run plan makes concrete: plan.py).
    # The values stay as written: they are the run's identity (`hash()`) and what config.yaml shows.
    @property
    def named_format(self) -> str | None:
        """dataset_format, or None (auto): each file's format is detected from its records; `text` (raw text) for
        stage: pt; `unpaired` (records with a desirability tag, each file's format detected) for stage: kto."""
        if self.stage == "pt":
            return TEXT_FORMAT
        if self.stage == "kto":
            return UNPAIRED_FORMAT
        return None if self.dataset_format == "auto" else self.dataset_format

    @property
    def named_template(self) -> str | None:
        """template, or None (auto): the tokenizer's own chat template where it has one, else ChatML."""
        return template_choice(self.template)

    @property
    def named_parallel(self) -> str | None:
        """parallel, or None (auto): the run plan chooses the mode (plan.parallel_for)."""
        return None if self.parallel == "auto" else self.parallel

    @property
    def named_recompute_ratio(self) -> float | None:
        """gradient_checkpointing_ratio, or None (auto): the run plan's, measured before training on GPUs."""
        return None if self.gradient_checkpointing_ratio == "auto" else float(self.gradient_checkpointing_ratio)

    @property
    def cpu_pinning(self) -> str:
        """cpu_affinity as applied: auto pins as node does (exclusive is unmeasured, so auto only keeps a worker near
        its GPU)."""
        return "node" if self.cpu_affinity == "auto" else self.cpu_affinity

    @classmethod
    def keys_of(cls, *scopes: str) -> list[str]:
        return [name for name, field in cls.model_fields.items() if field.json_schema_extra["scope"] in scopes]

    def math(self) -> dict[str, Any]:
        """The keys of scope `math` (see Section) and their values: what the run computes, kept in checkpoints."""
        return self.model_dump(include=set(self.keys_of(MATH)))

    def hash(self) -> str:
        """Identity of the run's math, nothing about where or how it runs."""
        return math_hash(self.math())

    def write_yaml(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))


def template_choice(template: str | None) -> str | None:
    """A `template` value, the config's or a checkpoint manifest's (None where it predates the key): None for auto,
    the tokenizer's own chat template where it has one, else ChatML."""
    return None if template in (None, "auto") else template


def torchrun_nproc(raw: str) -> str:
    """NPROC_PER_NODE as meshtune reads it: torchrun's names for its default, auto and gpu (a process a GPU,
    meshtune's default too), as not set ("")."""
    return "" if raw in ("auto", "gpu") else raw


def without_autos(tree: Any) -> Any:
    """A foreign config (a DeepSpeed JSON) with each `"auto"` value as None, not given: there `auto` asks the program
    reading the file to fill in its own value, which for meshtune is the key as its config sets it, or its default."""
    if isinstance(tree, dict):
        return {key: without_autos(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [without_autos(value) for value in tree]
    return None if tree == "auto" else tree


def key_default(key: str) -> Any:
    """A key's default value (None for a key without one, or not of TrainConfig)."""
    field = TrainConfig.model_fields.get(key)
    return None if field is None or field.is_required() else field.get_default(call_default_factory=True)


def math_hash(values: dict[str, Any]) -> str:
    """The hash of a run's math keys and values (`TrainConfig.math()`)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs from the command line; values are parsed as YAML (numbers, booleans, lists)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not key=value, e.g. learning_rate=1e-4")
        try:
            overrides[key.strip()] = _yaml(raw) if raw != "" else None
        except yaml.YAMLError:
            overrides[key.strip()] = raw
    return overrides


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of key: value, not a {type(data).__name__}")
    return data


def build_config(values: dict[str, Any], source: str = "config", sources: dict[str, str] | None = None,
                 problems: list[str] | None = None) -> TrainConfig:
    """Validate `values`; every problem of the config in one error, one line each, naming where the key was given
    (`sources[key]`, else `source`): unknown keys with the closest valid key, bad values with what is allowed, and
    `problems` found before (in keys of other tools)."""
    sources = sources or {}
    known = list(TrainConfig.model_fields)
    problems = list(problems or [])
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            hint = f"; did you mean '{close[0]}'?" if close else "; `meshtune train --help` lists the keys"
            problems.append(f"{sources.get(key, source)}: unknown key '{key}'{hint}")
    try:
        config = TrainConfig(**{key: value for key, value in values.items() if key in known})
    except ValidationError as exc:
        problems += _explain(exc, source, sources)
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def _explain(exc: ValidationError, source: str, sources: dict[str, str]) -> list[str]:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        where = sources.get(key, source)
        if err["type"] == "missing":
            lines.append(f"{where}: required key '{key}' is missing ({TrainConfig.model_fields[key].description})")
        elif err["type"] == "value_error" and not key:
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        else:
            hint = ""
            if key in TrainConfig.model_fields:
                hint = f" (allowed: {TrainConfig.model_fields[key].description})"
            lines.append(f"{where}: {key}={err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}{hint}")
    return lines


def describe_keys() -> str:
    """Every key with its default and meaning, by section, for `meshtune train --help`."""
    rows, section = [], None
    for name, field in TrainConfig.model_fields.items():
        if field.json_schema_extra["section"] != section:
            section = field.json_schema_extra["section"]
            rows.append(f"\n{section}:")
        default = "(required)" if field.is_required() else json.dumps(field.default)
        rows.append(f"  {name:<30} {default:<12} {field.description}")
    return "\n".join(rows).lstrip("\n")
