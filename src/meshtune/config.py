"""The training config: one YAML file plus `key=value` overrides, validated before any process group exists.

Key names follow Hugging Face TrainingArguments and LLaMA-Factory where one exists, so users can bring their
configs. Every error names the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
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


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class TrainConfig(BaseModel):
    """All keys of `meshtune train`. The field descriptions are the `--help` text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model and method
    model_name_or_path: str = Field(description="local Hugging Face model directory (config.json, safetensors, tokenizer)")
    finetuning_type: Literal["full", "lora", "qlora"] = Field("lora", description="full | lora | qlora (LoRA on a base whose block linear weights are stored in 4-bit NF4 through torchao: about a quarter of the base's memory; parallel ddp; every process reads the model files)")
    lora_rank: int = Field(8, gt=0, description="LoRA rank r")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA alpha; default 2 x lora_rank")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA path (0 keeps runs topology-independent)")
    lora_target: list[str] = Field(["all"], description="'all' (every linear layer but the head) or module names, e.g. q_proj,v_proj")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    gradient_checkpointing_ratio: float = Field(1.0, gt=0.0, le=1.0, description="with gradient_checkpointing: the fraction of transformer blocks recomputed, spread evenly (1 = all, as HF; 0.5 = every other block: faster, more memory)")
    bf16: bool | None = Field(None, description="bf16 compute on CUDA; default: on when the GPU supports it; CPU runs fp32")

    # data
    dataset: list[str] = Field(description="training data file(s): JSON list or JSONL; comma-separated or a list")
    eval_dataset: list[str] | None = Field(None, description="held-out data file(s); otherwise val_size splits the training data")
    dataset_format: Literal["auto", "alpaca", "sharegpt", "qwen", "messages"] = Field("auto", description="auto | alpaca | sharegpt | qwen | messages")
    template: Literal["auto", "chatml", "tokenizer"] = Field("auto", description="auto (tokenizer's chat template, else ChatML) | chatml | tokenizer")
    cutoff_len: int = Field(2048, gt=1, description="samples are truncated to this many tokens")
    val_size: float = Field(0.0, ge=0.0, description="held-out part of the training data: a fraction (<1) or a count")
    skip_invalid: bool = Field(False, description="skip malformed records (counted) instead of stopping")
    tokenized_path: str | None = Field(None, description="where the tokenized cache lives (default: output_dir/tokenized); share it across nodes to tokenize once")
    packing: bool = Field(False, description="pack samples into rows of up to cutoff_len (no attention across samples)")
    group_by_length: bool = Field(False, description="without packing: micro-batches of similar lengths inside each global batch")

    # optimisation
    per_device_train_batch_size: int = Field(1, gt=0, description="samples (or packed rows) per process per micro-step")
    per_device_eval_batch_size: int = Field(8, gt=0, description="samples per process per evaluation step")
    gradient_accumulation_steps: int = Field(1, gt=0, description="micro-steps per optimizer step")
    learning_rate: float = Field(1e-4, gt=0.0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(0.999, gt=0.0, lt=1.0, description="AdamW beta2")
    num_train_epochs: float = Field(3.0, gt=0.0, description="epochs, used when max_steps is -1")
    max_steps: int = Field(-1, ge=-1, description="optimizer steps; -1 = from num_train_epochs")
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = Field("cosine", description="cosine | linear | constant (after warmup)")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="warmup as a fraction of all steps")
    warmup_steps: int = Field(0, ge=0, description="warmup steps; overrides warmup_ratio when > 0")
    max_grad_norm: float = Field(1.0, ge=0.0, description="gradient clipping; 0 turns it off")
    seed: int = Field(42, description="seeds the data order, model init of new weights and RNG streams")

    # speed levers: each on by default where it pays, and each can be turned off for debugging
    padding_free: bool | None = Field(None, description="the samples of a micro-batch end to end in one row, attended by torch's variable-length flash attention: no padding, no attention across samples. The global batch is then dealt to micro-batches by tokens: equal token counts, not equal sample counts. Default: on with CUDA; elsewhere off (it still works: one attention call per sample)")
    fused_loss: bool = Field(True, description="output head and cross-entropy in row chunks over target positions only: the full-vocabulary logits are never stored (5-8 GiB less on a 1.5B model)")
    torch_compile: bool | None = Field(None, description="torch.compile every transformer block and the fused loss (as HF torch_compile). Default: on with CUDA (the first steps then include compilation)")
    optim: Literal["auto", "adamw_torch", "adamw_torch_fused"] = Field("auto", description="auto (fused AdamW on CUDA) | adamw_torch | adamw_torch_fused")
    grad_sync: Literal["ddp", "flat"] = Field("ddp", description="parallel ddp on several processes: ddp (DistributedDataParallel, gradients all-reduced in buckets during backward) | flat (no wrapper: one all-reduce of all gradients after backward; for small trainable sets such as LoRA)")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="the dtype gradients cross the processes in (all-reduce, reduce-scatter): fp32 (exact sums, as torchtitan) | bf16 (half the bytes, as DeepSpeed's default communication_data_type under bf16; sums over many ranks lose precision). The optimizer always steps fp32 gradients")
    fsdp_blocks_per_unit: int | None = Field(None, ge=1, description="zero2 / zero3 / hsdp: consecutive transformer blocks sharded as one FSDP2 unit. More blocks per unit: fewer, larger all-gathers and reduce-scatters and fewer hooks on the host each step, at the memory of gathering them all at once (zero3 / hsdp). Default: as many as keep a unit within about 1B parameters, at most 4 (4 measured 39% faster than 1 on full 1.5B over 4 H100s, and 30% faster on full 7B zero3 with expandable_segments)")
    fsdp_prefetch: int = Field(0, ge=0, description="zero2 / zero3 / hsdp: blocks whose parameters are explicitly gathered ahead of use in forward and backward (0 = FSDP2's own implicit prefetching, measured faster on one H100)")

    expandable_segments: bool = Field(True, description="CUDA: the caching allocator grows its segments instead of allocating new ones (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan runs): no fragmentation retries. Measured on full 7B zero3 over 4 H100s: 102 allocator retries a run without it at 4 blocks a unit, none with it. A PYTORCH_CUDA_ALLOC_CONF you set yourself is left as it is")

    gc_interval: int | None = Field(None, ge=0, description="Python's garbage collection every N optimizer steps, on all ranks at the same step, and never in between: otherwise each rank collects at its own moments and the others wait for it at the next collective (as torchtitan does). 0 = Python's automatic collection. Default: 50 with several processes, 0 with one")

    profile_steps: str | None = Field(None, description="profile optimizer steps FIRST-LAST (e.g. 10-12) with torch.profiler: a Chrome trace per rank and rank 0's costliest operators in output_dir/profile/")

    # parallelism and launch
    parallel: Literal["auto", "ddp", "zero2", "zero3", "hsdp"] = Field("auto", description="auto | ddp | zero2 (FSDP2, keep params after forward) | zero3 (FSDP2, reshard) | hsdp (shard inside a node, replicate across nodes). auto: ddp for LoRA, for one process and on CPU; full fine-tuning on several GPUs: zero2 (measured 20% faster than ddp on 4 H100s, at a third of the memory), or zero3 where zero2's full bf16 weights plus its share of the fp32 state would take over half a GPU")
    load_weights_on: Literal["rank0", "every_rank"] = Field("rank0", description="rank0: only global rank 0 reads the model files; the other processes build the model without weights and receive rank 0's over the process group (under zero2 / zero3 / hsdp only their shard), so a node's host memory holds one copy, not one per process | every_rank: each process reads the files itself")
    hsdp_shard_size: int | None = Field(None, gt=0, description="hsdp: processes that shard one replica; default: the processes of one node")
    nproc_per_node: int | None = Field(None, gt=0, description="processes on this machine; default: visible GPUs, 1 on CPU")
    ddp_timeout: int = Field(600, gt=0, description="seconds a collective may wait before the job fails")
    nnodes: str | None = Field(None, description="nodes in the job, or an elastic range MIN:MAX; default from env / scheduler, else 1")
    node_rank: int | None = Field(None, ge=0, description="this node's rank (0 = master); default from env / scheduler")
    master_addr: str | None = Field(None, description="address of node 0 (rendezvous host); default from env / scheduler")
    master_port: int | None = Field(None, gt=0, lt=65536, description="rendezvous port on master_addr; required for several nodes")
    local_addr: str | None = Field(None, description="the address other nodes reach this node at (torchrun --local-addr); default: hostname lookup. Set it when the hostname resolves to the wrong network")
    max_restarts: int = Field(3, ge=0, description="times torchrun restarts all workers after a failure (they resume from the newest checkpoint)")
    rdzv_timeout: int = Field(300, gt=0, description="seconds to wait for all nodes to join before failing with a diagnosis")

    # outputs
    output_dir: str = Field("output", description="metrics.jsonl, config.yaml, loss.png and final/ go here")
    logging_steps: int = Field(10, gt=0, description="log (and write metrics.jsonl) every N optimizer steps")
    eval_steps: int | None = Field(None, gt=0, description="evaluate every N steps (default: only at the end); needs val_size or eval_dataset")
    save_final: bool = Field(True, description="write the trained model (or LoRA adapter) to output_dir/final at the end; false for throughput runs and smoke tests, where writing a 7B model's 30 GB would take longer than the training")
    save_steps: int = Field(0, ge=0, description="write a sharded checkpoint every N optimizer steps (0 = only final/)")
    save_total_limit: int | None = Field(None, gt=0, description="complete checkpoints to keep (the newest is never deleted)")
    async_save: bool = Field(False, description="write checkpoints in the background while training continues (one at a time)")
    resume_from_checkpoint: str = Field("auto", description="auto (newest complete, verified checkpoint in output_dir) | none | a checkpoint path")
    allow_local_checkpoints: bool = Field(False, description="start even if output_dir is not shared by all nodes (checkpoints then split across nodes)")

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_text(cls, value: Any) -> Any:
        """`nnodes: 2` and `nnodes: 1:4` (elastic) both arrive as text."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

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

    @field_validator("dataset", "eval_dataset", "lora_target", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        """LLaMA-Factory writes lists as comma-separated strings: `lora_target: q_proj,v_proj`."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_supported(self) -> "TrainConfig":
        if self.finetuning_type == "qlora" and self.parallel not in ("auto", "ddp"):
            raise ValueError(f"finetuning_type: qlora trains with parallel: ddp (what auto picks); sharding its 4-bit "
                             f"weights with {self.parallel} is not supported: set parallel: ddp or auto")
        if not self.dataset:
            raise ValueError("dataset: no file given; set dataset: path/to/train.jsonl")
        if self.val_size >= 1 and self.val_size != int(self.val_size):
            raise ValueError(f"val_size: {self.val_size} is neither a fraction below 1 nor a whole count")
        return self

    @property
    def is_lora(self) -> bool:
        """LoRA adapters train and the base is frozen (lora and qlora)."""
        return self.finetuning_type in ("lora", "qlora")

    @property
    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def hash(self) -> str:
        """Identity of the run's math: every key but where things are written and how many local processes."""
        exclude = {"output_dir", "tokenized_path", "nproc_per_node", "logging_steps", "nnodes", "node_rank",
                   "master_addr", "master_port", "local_addr", "max_restarts", "rdzv_timeout", "ddp_timeout",
                   "resume_from_checkpoint", "async_save", "allow_local_checkpoints", "save_total_limit",
                   "profile_steps", "gc_interval", "expandable_segments"}
        blob = json.dumps(self.model_dump(exclude=exclude), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def write_yaml(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))


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


def build_config(values: dict[str, Any], source: str = "config") -> TrainConfig:
    """Validate `values`; unknown keys name the closest valid key, bad values name what is allowed."""
    known = list(TrainConfig.model_fields)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; `meshtune train --help` lists the keys"
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    values = load_yaml(path)
    values.update(parse_overrides(overrides or []))
    return build_config(values, source=str(path))


def _explain(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "missing":
            lines.append(f"{source}: required key '{key}' is missing ({TrainConfig.model_fields[key].description})")
        elif err["type"] == "value_error" and not key:
            lines.append(f"{source}: {err['msg'].removeprefix('Value error, ')}")
        else:
            hint = ""
            if key in TrainConfig.model_fields:
                hint = f" (allowed: {TrainConfig.model_fields[key].description})"
            lines.append(f"{source}: {key}={err.get('input')!r}: {err['msg']}{hint}")
    return "\n".join(lines)


def describe_keys() -> str:
    """One line per key with its default, for `meshtune train --help`."""
    rows = []
    for name, field in TrainConfig.model_fields.items():
        default = "(required)" if field.is_required() else json.dumps(field.default)
        rows.append(f"  {name:<30} {default:<12} {field.description}")
    return "\n".join(rows)
