"""Keys of LLaMA-Factory YAMLs, HF TrainingArguments and Qwen's finetune.py that are not meshtune's own.

Each such key is renamed to ours, ignored with the reason (listed in one warning), or refused with the reason when
ignoring it would change what is trained. A key meshtune has under the same name never reaches this table. Methods
meshtune does not have (GaLore, OFT, Ray, ...) are families of keys, each key named as its method's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from meshtune.config import TrainConfig

LF, HF, QWEN, AXOLOTL, TRL = ("LLaMA-Factory's", "HF TrainingArguments'", "Qwen's finetune.py's", "Axolotl's",
                              "TRL's")


@dataclass
class Outcome:
    values: dict[str, Any] = field(default_factory=dict)  # our keys it sets
    ignored: str | None = None                            # why it is ignored (a warning), when it is
    refused: str | None = None                            # why it cannot run (an error), when it cannot


Handler = Callable[[Any], Outcome]


def renamed(ours: str) -> Handler:
    return lambda value: Outcome(values={ours: value})


def ignored(reason: str, *silent: Any) -> Handler:
    """Ignored with `reason`; no warning for the `silent` values, which ask for what meshtune does anyway."""
    return lambda value: Outcome() if _among(value, silent) else Outcome(ignored=reason)


def only(accepted: dict[Any, dict[str, Any]], refusal: str) -> Handler:
    """The values in `accepted` set those keys (or nothing); any other value is refused with `refusal`."""
    def handle(value: Any) -> Outcome:
        for option, values in accepted.items():
            if _among(value, (option,)):
                return Outcome(values=dict(values))
        return Outcome(refused=refusal)
    return handle


def off_at_zero(refusal: str) -> Handler:
    """A strength: unset or 0 asks for nothing; any other value is refused with `refusal`."""
    def handle(value: Any) -> Outcome:
        zero = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)
        return Outcome() if zero else Outcome(refused=refusal)
    return handle


def replica_log_level(value: Any) -> Outcome:
    """HF's level for the processes other than the main one: log_level_all_ranks; passive keeps meshtune's default
    (rank 0 logs, the others only the warnings they alone see)."""
    if _among(value, ("passive",)):
        return Outcome()
    level = str(value).lower()
    return Outcome(values={"log_level_all_ranks": "error" if level == "critical" else level})


def _among(value: Any, options: tuple) -> bool:
    return any(_same(value, option) for option in options)


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type (true is not 1); text compared without case, as LLaMA-Factory and HF parse it."""
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return type(a) is type(b) and a == b


NO_DOWNLOAD = "meshtune reads local files only and never downloads"
CACHE = ("the data is tokenized once per job into a shared cache, rebuilt by itself when data, tokenizer, template or "
         "cutoff_len change")
SHARDING = ("meshtune shards with FSDP2 through its own keys: parallel: zero3 (or zero2, hsdp), cpu_offload: true, "
            "and nnodes / nproc_per_node / master_addr / master_port (or the launcher's environment)")

OWN_KEYS = frozenset(TrainConfig.model_fields)
# key -> (whose key it is, what meshtune does with its value)
FOREIGN: dict[str, tuple[str, Handler]] = {
    # method
    "do_train": (LF, only({True: {}}, "meshtune train always trains; do_train: false asks it not to")),
    "do_eval": (HF, ignored("evaluation runs when val_size or eval_dataset is set: every eval_steps and at the end",
                            True, False)),
    "do_predict": (HF, only({False: {}}, "generation over a test set is not part of meshtune train; load "
                                         "output_dir/final with transformers to generate")),
    "quantization_bit": (LF, only({4: {"finetuning_type": "qlora"}, None: {}},
                                  "meshtune quantizes the frozen base to 4-bit NF4 only (Q-LoRA: quantization_bit: 4); "
                                  "8-, 3- and 2-bit bases are not supported")),
    "quantization_method": (LF, only({"bnb": {}, "bitsandbytes": {}},
                                     "the 4-bit base is NF4 with double-quantized scales (through torchao), which is "
                                     "what quantization_method: bnb gives; hqq and eetq are other quantizers")),
    "quantization_type": (LF, only({"nf4": {}}, "the 4-bit base is NF4; fp4 is not supported")),
    "double_quantization": (LF, only({True: {}}, "meshtune's NF4 always double-quantizes its scales")),
    "trust_remote_code": (LF, ignored("meshtune builds only architectures transformers has built in: code shipped in "
                                      "a model folder never runs (a folder whose config.json or "
                                      "tokenizer_config.json has an auto_map is refused before anything starts)",
                                      False)),
    "use_lora": (QWEN, only({True: {"finetuning_type": "lora"}, False: {}}, "it takes True or False")),
    "q_lora": (QWEN, only({True: {"finetuning_type": "qlora"}, False: {}}, "it takes True or False")),
    "lora_r": (QWEN, renamed("lora_rank")),
    "lora_target_modules": (QWEN, renamed("lora_target")),
    "lora_bias": (QWEN, only({"none": {}}, "LoRA trains no bias terms in meshtune; set lora_bias none")),
    "lora_weight_path": (QWEN, lambda value: Outcome(values={"adapter_name_or_path": value} if value else {})),
    "use_rslora": (LF, only({False: {}}, "rank-stabilized LoRA scaling is not supported; "
                                         "meshtune scales by alpha / r")),
    "use_dora": (LF, only({False: {}}, "DoRA is not supported")),
    "create_new_adapter": (LF, only({False: {}}, "a new adapter on top of merged ones is not supported; merge them "
                                                 "into the base (meshtune export ADAPTER --merge) and train on it")),
    "fix_vit": (QWEN, ignored("meshtune trains text models only", True, False)),
    # data
    "data_path": (QWEN, renamed("dataset")),
    "eval_data_path": (QWEN, renamed("eval_dataset")),
    "model_max_length": (QWEN, renamed("cutoff_len")),
    "lazy_preprocess": (QWEN, ignored(CACHE, True, False)),
    "overwrite_cache": (LF, ignored(CACHE, False)),
    "preprocessing_num_workers": (LF, ignored("tokenization runs once per job, into the shared cache")),
    "preprocessing_batch_size": (LF, ignored("tokenization runs once per job, into the shared cache")),
    "dataloader_num_workers": (HF, ignored("batches are read from the memory-mapped token cache in the training "
                                           "process; no loader workers are needed", 0)),
    "dataloader_pin_memory": (HF, ignored("batches are always copied through pinned memory", True)),
    "dataloader_persistent_workers": (HF, ignored("there are no loader workers", False)),
    "neat_packing": (LF, only({True: {"packing": True}, False: {}}, "it takes true or false")),
    "streaming": (LF, only({False: {}}, f"{CACHE}; streaming would change the order samples are drawn in")),
    "mix_strategy": (LF, only({"concat": {}}, "datasets are concatenated; interleaving is not supported")),
    "media_dir": (LF, ignored("meshtune trains text models only")),
    # preference training: TRL's DPOConfig and KTOConfig names for ours, LLaMA-Factory's that meshtune does not
    # compute
    "beta": ("TRL DPOConfig's and KTOConfig's", renamed("pref_beta")),
    "desirable_weight": ("TRL KTOConfig's", renamed("kto_chosen_weight")),
    "undesirable_weight": ("TRL KTOConfig's", renamed("kto_rejected_weight")),
    "loss_type": ("TRL DPOConfig's", renamed("pref_loss")),
    "label_smoothing": ("TRL DPOConfig's", renamed("dpo_label_smoothing")),
    "pref_bco_weight": (LF, off_at_zero("it adds BCO's classifier loss to DPO's, which meshtune does not compute")),
    "ld_alpha": (LF, off_at_zero("it weights the responses' tokens past their common length (LD-DPO), which "
                                 "meshtune does not compute")),
    "ref_model_quantization_bit": (LF, off_at_zero("it quantizes the reference model, which meshtune keeps in the "
                                                   "training precision")),
    "precompute_ref_batch_size": ("TRL DPOConfig's", ignored("precompute_ref_log_probs' pass runs batches of "
                                                             "per_device_train_batch_size pairs, a forward without "
                                                             "gradients that the step's memory holds already")),
    "use_ref_model": ("TRL's", ignored("the reference follows from pref_loss: none for orpo and simpo")),
    # outputs and logging
    "overwrite_output_dir": (HF, ignored("output_dir is never cleared: a run resumes its newest complete checkpoint "
                                         "(resume_from_checkpoint: auto); set resume_from_checkpoint: none to start "
                                         "over", False)),
    "logging_dir": (HF, ignored("metrics go to output_dir/metrics.jsonl, and with report_to: tensorboard to "
                                "output_dir/tensorboard/")),
    "logging_strategy": (HF, only({"steps": {}}, "meshtune logs every logging_steps optimizer steps")),
    "logging_first_step": (HF, ignored("the first logged step is logging_steps", False)),
    "run_name": (HF, ignored("the run is named by its output_dir")),
    "evaluation_strategy": (HF, renamed("eval_strategy")),
    "save_only_model": (HF, ignored("checkpoints always keep the optimizer and data position, so a resume is exact",
                                    False)),
    "save_safetensors": (HF, ignored("final/ is always safetensors", True)),
    "include_num_input_tokens_seen": (HF, ignored("metrics.jsonl always counts tokens", False)),
    "include_tokens_per_second": (HF, ignored("metrics.jsonl always has tokens/s", False)),
    "push_to_hub": (HF, only({False: {}}, NO_DOWNLOAD + " nor uploads; push output_dir/final yourself")),
    "hub_model_id": (HF, ignored(NO_DOWNLOAD + " nor uploads")),
    "cache_dir": (HF, ignored(NO_DOWNLOAD)),
    "use_fast_tokenizer": (LF, ignored("the model folder's tokenizer is loaded as transformers loads it", True)),
    # precision, speed and distribution
    "remove_unused_columns": (HF, ignored("meshtune reads the dataset's columns itself")),
    "disable_tqdm": (HF, ignored("rank 0 shows meshtune's one progress bar", False)),
    "log_level": (HF, ignored("meshtune's log level is --log-level or MESHTUNE_LOG_LEVEL", "passive")),
    "log_level_replica": (HF, replica_log_level),
    "local_rank": (HF, ignored("torchrun gives each process its rank")),
    "gradient_checkpointing_kwargs": (HF, ignored("meshtune checkpoints activations its own way "
                                                  "(gradient_checkpointing, gradient_checkpointing_ratio)")),
    "load_best_model_at_end": (HF, only({False: {}}, "final/ holds the last step's model; pick an earlier "
                                                      "checkpoint-N yourself from metrics.jsonl's eval_loss")),
    "tf32": (HF, ignored("meshtune computes its matmuls in bf16 (bf16: true, the default) and keeps fp32 matmuls at "
                         "full fp32 precision under bf16: false", False, None)),
    "flash_attn": (LF, ignored("meshtune picks the attention kernel itself (torch's flash and variable-length "
                               "kernels where the GPU has them)", "auto")),
    "enable_liger_kernel": (LF, ignored("meshtune's fused output head and loss (fused_loss: true) does the same job",
                                        False)),
    "use_unsloth": (LF, ignored("meshtune uses its own fast paths", False)),
    "use_unsloth_gc": (LF, ignored("meshtune uses its own fast paths", False)),
    "disable_gradient_checkpointing": (LF, only({True: {"gradient_checkpointing": False}, False: {}},
                                               "disable_gradient_checkpointing takes true or false")),
    "ddp_find_unused_parameters": (HF, ignored("meshtune sets DDP up for the parameters that train")),
    "ddp_backend": (HF, ignored("meshtune uses nccl on GPUs and gloo on CPU")),
    "fsdp": (HF, lambda value: Outcome() if not value else Outcome(refused=SHARDING)),
    "fsdp_config": (HF, lambda value: Outcome() if not value else Outcome(refused=SHARDING)),
    "lr_scheduler_kwargs": (HF, only({None: {}}, "schedules take no extra arguments")),
    "pure_bf16": (LF, only({False: {}}, "it trains bf16 weights without fp32 master weights; the nearest meshtune "
                                        "has is master_weights: bf16 for full fine-tuning (bf16 weights, updates "
                                        "rounded stochastically), which you can set instead")),
    "disable_shuffling": (LF, only({False: {}}, "every epoch's order is a permutation drawn from the seed")),
    "early_stopping_steps": (LF, only({None: {}}, "training runs all its steps and final/ holds the last one; pick "
                                                  "an earlier checkpoint-N yourself from metrics.jsonl's eval_loss")),
    "compute_accuracy": (LF, ignored("evaluation reports eval_loss, the exact token mean", False)),
    "include_effective_tokens_per_second": (LF, ignored("metrics.jsonl always has tokens/s", False)),
    "use_mca": (LF, ignored("meshtune trains through DDP or FSDP2, not Megatron Core", False)),
    # features of the other tools that meshtune does not have, each said as what it is
    "neftune_noise_alpha": (HF, off_at_zero("it turns on NEFTune (uniform noise of that scale "
                                     "added to the input embeddings while training), which meshtune does not have: "
                                     "its embeddings are never perturbed; drop the key")),
    "label_smoothing_factor": (HF, off_at_zero("it smooths the labels (part of each target token's loss "
                                        "spread over the whole vocabulary), which meshtune does not have: its loss "
                                        "is the plain cross-entropy of the target tokens; set it to 0 or drop it")),
    "rope_scaling": (LF, only({None: {}}, "it rescales the model's rotary position embeddings (linear, dynamic, "
                                          "yarn, llama3) to extend its context, which meshtune does not have: the "
                                          "model runs as its config.json says; write rope_scaling into a copy of the "
                                          "model folder's config.json instead")),
    "resize_vocab": (LF, only({False: {}}, "it resizes the tokenizer's vocabulary and the model's embeddings, which "
                                           "meshtune does not have: the model keeps the vocabulary it was saved "
                                           "with")),
    "new_special_tokens": (LF, only({None: {}}, "it adds special tokens to the tokenizer (and rows to the "
                                                "embeddings), which meshtune does not have: add them to the model "
                                                "folder's tokenizer and resize its embeddings before training")),
    "add_special_tokens": (LF, only({None: {}}, "it adds special tokens to the tokenizer (and rows to the "
                                                "embeddings), which meshtune does not have: add them to the model "
                                                "folder's tokenizer and resize its embeddings before training")),
    "add_tokens": (LF, only({None: {}}, "it adds tokens to the tokenizer (and rows to the embeddings), which "
                                        "meshtune does not have: add them to the model folder's tokenizer and resize "
                                        "its embeddings before training")),
    "shift_attn": (LF, only({False: {}}, "it turns on LongLoRA's shifted sparse attention (S²-Attn), which meshtune "
                                         "does not have: every token attends to its whole sample")),
    "upcast_layernorm": (LF, ignored("it keeps the norm layers' weights in fp32, which meshtune does not have: "
                                     "weights that train are fp32 master weights anyway, a frozen base keeps its "
                                     "dtype, and transformers' RMSNorm computes in fp32 either way", False)),
    "enable_thinking": (LF, only({True: {}, None: {}}, "enable_thinking: false strips the thoughts from the "
                                                       "records' answers for a reasoning template, which meshtune "
                                                       "does not have; use template: qwen3_nothink for answers "
                                                       "without a thinking block, or strip the <think> blocks from "
                                                       "the data")),
    "moe_aux_loss_coef": (LF, only({None: {}}, "it adds a mixture-of-experts router's auxiliary loss at that weight, "
                                               "which meshtune does not have: its loss is the cross-entropy of the "
                                               "target tokens alone; drop the key")),
    "full_determinism": (HF, ignored("it switches torch to deterministic algorithms for every kernel, which meshtune "
                                     "does not have: every random stream is seeded from seed, runs on CPU repeat bit "
                                     "for bit, and GPU runs use torch's default kernels", False)),
    "use_reentrant_gc": (LF, ignored("it picks reentrant activation checkpointing, which meshtune does not have: it "
                                     "recomputes with torch's non-reentrant checkpoint, the same math", False)),
    "buffer_size": (LF, ignored("it is the shuffle buffer of streaming: true, which meshtune does not have: each "
                                "epoch is a permutation of the whole dataset drawn from the seed")),
    "eval_on_each_dataset": (LF, ignored("it reports a loss for each eval_dataset apart, which meshtune does not "
                                         "have: eval_loss is the exact token mean over all of them", False)),
    "average_tokens_across_devices": (HF, ignored("false averages each process's loss over its own tokens, which "
                                                  "meshtune does not have: it always divides the summed token loss "
                                                  "by the global batch's target-token count (what true does)", True)),
    "image_max_pixels": (LF, ignored("it caps the pixels of each image a multimodal model reads, which meshtune "
                                     "does not have: it trains text models only")),
    # Axolotl
    "micro_batch_size": (AXOLOTL, renamed("per_device_train_batch_size")),  # Axolotl's batch per GPU per micro-step
}

METHODS = "meshtune trains LoRA, Q-LoRA or full with AdamW"


@dataclass(frozen=True)
class Family:
    """The keys of one method of another tool that meshtune does not have, by name or prefix: each named as that
    method's (never read as a look-alike key of ours). `switch` turns the method on and is refused when on (it
    would change what is trained); the others are read only with the method on, so they are ignored."""
    whose: str
    setting: str                  # what its keys are: "a GaLore setting"
    why: str                      # why meshtune has no such thing
    prefixes: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    switch: str | None = None     # the key that turns the method on
    method: str = ""              # what the switch turns on, for its refusal
    read_with: str | None = None  # what the other keys need to be read, when not the switch

    def handler(self, key: str) -> Handler:
        if key == self.switch:
            return only({False: {}, None: {}}, f"it turns on {self.method}: {self.why}")
        needs = self.read_with or (f"{self.switch}: true" if self.switch else None)
        return ignored(f"it is {self.setting}{f', read only with {needs}' if needs else ''}: {self.why}")


FAMILIES = (
    Family(LF, "a GaLore setting", METHODS, ("galore_",), switch="use_galore",
           method="GaLore (low-rank projection of full fine-tuning's gradients)"),
    Family(LF, "an APOLLO setting", METHODS, ("apollo_",), switch="use_apollo",
           method="the APOLLO optimizer (low-rank scaling of full fine-tuning's updates)"),
    Family(LF, "a BAdam setting", METHODS, ("badam_",), switch="use_badam",
           method="the BAdam optimizer (full fine-tuning one block of layers at a time)"),
    Family(LF, "an OFT setting", METHODS, ("oft_",), ("module_dropout",), read_with="finetuning_type: oft"),
    Family(LF, "a freeze (partial-parameter) fine-tuning setting", METHODS,
           keys=("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"),
           read_with="finetuning_type: freeze"),
    Family(LF, "a multimodal setting", "meshtune trains text models only",
           keys=("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model", "train_mm_proj_only",
                 "image_min_pixels", "image_do_pan_and_scan", "crop_to_patches", "video_max_pixels",
                 "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video", "audio_sampling_rate")),
    Family(LF, "a PiSSA setting", "meshtune's LoRA starts as peft's default (B zero, A Kaiming-uniform)",
           ("pissa_",), switch="pissa_init", method="PiSSA initialisation"),
    Family(LF, "a LoRA+ setting", "every trainable parameter has the one learning_rate", ("loraplus_",),
           switch="loraplus_lr_ratio", method="LoRA+ (a larger learning rate for the B matrices)",
           read_with="loraplus_lr_ratio set"),
    Family(LF, "a DFT loss setting", "meshtune's loss is the mean cross-entropy over target tokens",
           switch="use_dft_loss", method="the DFT loss (each token's loss weighted by the model's probability of it)"),
    Family(LF, "a LLaMA Pro setting", METHODS, switch="use_llama_pro",
           method="LLaMA Pro (training only blocks added to the model)"),
    Family(LF, "an Adam-mini setting", METHODS, switch="use_adam_mini", method="the Adam-mini optimizer"),
    Family(LF, "a Muon setting", METHODS, switch="use_muon", method="the Muon optimizer"),
    Family(LF, "a Ray setting", "meshtune starts its processes with torchrun, not Ray: nproc_per_node processes on "
                                "each of nnodes nodes", ("ray_",), ("resources_per_worker", "placement_strategy")),
    Family(LF, "a SwanLab setting", "metrics go to output_dir/metrics.jsonl and loss.png", ("swanlab_",),
           ("use_swanlab",)),
    Family(LF, "a PPO or reward-model setting", "read only by stage: ppo or rm, and meshtune trains sft, pt, dpo "
                                                "and kto", ("ppo_", "reward_model")),
)


def foreign_handler(key: str) -> tuple[str, Handler] | None:
    """(whose key it is, what meshtune does with its value) for a key of another tool; None for any other key."""
    if key in OWN_KEYS:  # ours, though a family's prefix may match it (pref_beta)
        return None
    if key in FOREIGN:
        return FOREIGN[key]
    for family in FAMILIES:
        if key in family.keys or key == family.switch or key.startswith(family.prefixes):
            return family.whose, family.handler(key)
    return None


def translate_foreign(values: dict[str, Any], sources: dict[str, str], default_source: str
                      ) -> tuple[dict[str, Any], list[str], list[str]]:
    """(values in our keys, warning lines for ignored keys, error lines for refused ones). A renamed key that
    meets our own key (or another rename) with a different value is an error naming both."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    warnings, problems = [], []
    for key, value in values.items():
        if foreign_handler(key) is None:
            out[key] = value
            origin.setdefault(key, key)
    for key, value in values.items():
        if (foreign := foreign_handler(key)) is None:
            continue
        whose, handle = foreign
        where = sources.get(key, default_source)
        outcome = handle(value)
        if outcome.refused is not None:
            problems.append(f"{where}: {key}: {value!r} is {whose}; meshtune cannot run it: {outcome.refused}")
        elif outcome.ignored is not None:
            warnings.append(f"{key} is {whose}; ignored because {outcome.ignored}")
        for ours, mapped in outcome.values.items():
            if ours in out and out[ours] != mapped and not _upgrade(ours, out[ours], mapped):
                problems.append(f"{where}: {key}: {value!r} means {ours}: {mapped!r}, but {origin[ours]} sets "
                                f"{ours}: {out[ours]!r}; keep one of them")
                continue
            out[ours] = _upgrade(ours, out.get(ours), mapped) or mapped
            origin[ours] = key
            if key in sources:
                sources.setdefault(ours, sources[key])
    return out, warnings, problems


def _upgrade(key: str, current: Any, mapped: Any) -> Any:
    """LLaMA-Factory writes Q-LoRA as finetuning_type: lora plus quantization_bit: 4; both mean qlora."""
    if key == "finetuning_type" and {current, mapped} == {"lora", "qlora"}:
        return "qlora"
    return None
