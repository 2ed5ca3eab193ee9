"""A DeepSpeed JSON (`deepspeed: ds_config.json` in a config, `--deepspeed` on the command line) as meshtune keys.

ZeRO stages become FSDP2 modes, offload becomes FSDP2's CPU offload, and the batch, precision, clipping, optimizer
and scheduler entries become our keys. `"auto"` (HF Trainer fills it from its own arguments) takes our value: it is
read as not given (`config.without_autos`). An explicit value is used when the config does not set that key, and
is an error naming both when it sets another. Every entry we do not honour is named in one warning, never dropped
silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtune.config import TrainConfig, without_autos
from meshtune.errors import ConfigError

STAGE_TO_PARALLEL = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}
# DeepSpeed's schedules, run as DeepSpeed computes them (train/schedule.py)
SCHEDULERS = {"WarmupLR": "deepspeed_warmup_lr", "WarmupDecayLR": "deepspeed_warmup_decay_lr",
              "WarmupCosineLR": "deepspeed_warmup_cosine_lr"}
# what DeepSpeed's scheduler takes where its entry is absent (not "auto", which HF Trainer fills in)
WARMUP_NUM_STEPS, WARMUP_DECAY_MAX_LR = 1000, 0.001
# Entries that tune how DeepSpeed runs, not what it computes: FSDP2 decides these by itself.
TUNING = ("overlap_comm", "allgather_partitions", "allgather_bucket_size", "reduce_scatter", "reduce_bucket_size",
          "contiguous_gradients", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
          "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
          "stage3_gather_16bit_weights_on_model_save", "elastic_checkpoint", "ignore_unused_parameters")


@dataclass
class Translation:
    """What a DeepSpeed file says in meshtune keys, and what it says that meshtune does not do."""

    values: dict[str, Any] = field(default_factory=dict)      # our key -> value taken from the file
    unhonoured: list[str] = field(default_factory=list)       # dotted entries not applied (one warning line)
    notes: list[str] = field(default_factory=list)            # how an entry was applied, when not one to one
    problems: list[str] = field(default_factory=list)         # conflicts and unsupported settings (errors)


def read_deepspeed(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; errors name the file and what to do."""
    if not path.is_file():
        raise ConfigError(f"deepspeed: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"deepspeed: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                          ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed: {path} must hold a JSON object of DeepSpeed settings")
    return data


def translate_deepspeed(ds: dict[str, Any], name: str, given: dict[str, Any], sources: dict[str, str]
                        ) -> Translation:
    """`ds` (the file `name`) against `given`, the keys the user set (YAML or command line, where `sources` says)."""
    out = Translation()
    entries = without_autos(ds)  # an entry left to meshtune is None from here on

    def take(key: str, value: Any, entry: str) -> None:
        """Their explicit value for our `key`: used unless the user set another one."""
        if value is None:
            return
        if key in given and given[key] != value:
            out.problems.append(f"{name}: {entry} is {json.dumps(value)} but {key} is {given[key]!r} "
                                f"({sources.get(key, 'config')}); set one of them to the other's value, "
                                f"or the DeepSpeed entry to \"auto\"")
        elif key not in given:
            out.values[key] = value

    lora = given.get("finetuning_type", TrainConfig.model_fields["finetuning_type"].default) == "lora"
    _zero(entries.pop("zero_optimization", None) or {}, name, lora, take, out)
    _precision(entries.pop("bf16", None), entries.pop("fp16", None), name, take, out)
    for entry, key in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                       ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                       ("train_batch_size", "train_batch_size"),
                       ("gradient_clipping", "max_grad_norm")):
        if entry in entries:
            take(key, entries.pop(entry), entry)
    if "optimizer" in entries:
        _optimizer(entries.pop("optimizer") or {}, name, take, out)
    if "scheduler" in entries:
        _scheduler(entries.pop("scheduler") or {}, name, given, sources, take, out)
    out.unhonoured += sorted(entries)
    return out


def _zero(zero: dict[str, Any], name: str, lora: bool, take, out: Translation) -> None:
    zero = dict(zero)
    stage = zero.pop("stage", 0)
    if stage not in STAGE_TO_PARALLEL:  # "auto" too: HF Trainer has no stage to fill in
        shown = '"auto"' if stage is None else repr(stage)
        out.problems.append(f"{name}: zero_optimization.stage {shown} is not 0, 1, 2 or 3")
        return
    take("parallel", STAGE_TO_PARALLEL[stage], "zero_optimization.stage")
    if stage == 1:
        out.notes.append(f"{name}: ZeRO stage 1 runs as zero2 (FSDP2 shards gradients along with the optimizer state)")
    offloaded = []
    for entry in ("offload_optimizer", "offload_param"):
        device = (zero.pop(entry, None) or {}).get("device", "none")
        if device == "nvme":
            out.problems.append(f"{name}: zero_optimization.{entry}.device nvme is not supported: FSDP2 offloads to "
                                f"CPU memory; set it to \"cpu\"")
        elif device == "cpu":
            offloaded.append(entry)
        elif device not in ("none", None):
            out.problems.append(f"{name}: zero_optimization.{entry}.device {device!r} is not cpu, nvme or none")
    if offloaded and stage == 0:
        out.problems.append(f"{name}: {' and '.join(offloaded)} need ZeRO stage 1, 2 or 3 (FSDP2 offloads shards); "
                            f"set zero_optimization.stage")
    elif offloaded:
        take("cpu_offload", True, f"zero_optimization.{offloaded[0]}")
        if lora and stage in (1, 2):
            out.notes.append(f"{name}: {' and '.join(offloaded)} under ZeRO stage {stage} with LoRA: nothing is "
                             f"offloaded: DeepSpeed moves the adapters' few MB of gradients and AdamW state to the "
                             f"CPU, meshtune runs LoRA's zero2 as ddp and keeps them on the GPU (the run plan's "
                             f"cpu_offload row says why)")
        else:
            out.notes.append(f"{name}: {' and '.join(offloaded)} → cpu_offload: FSDP2 keeps parameters, gradients "
                             f"and optimizer state in CPU memory and steps the optimizer there")
    out.unhonoured += [f"zero_optimization.{key}" for key in sorted(zero)]


def _precision(bf16: dict | None, fp16: dict | None, name: str, take, out: Translation) -> None:
    bf16_on = (bf16 or {}).get("enabled")
    fp16_on = (fp16 or {}).get("enabled")
    if fp16_on is True and bf16_on is True:
        out.problems.append(f"{name}: bf16.enabled and fp16.enabled are both true; keep one")
    if fp16_on in (True, False):
        take("fp16", fp16_on, "fp16.enabled")  # its loss-scale settings are torch's GradScaler defaults here
    if bf16_on in (True, False):
        take("bf16", bf16_on, "bf16.enabled")
    for block, settings in (("bf16", bf16), ("fp16", fp16)):
        out.unhonoured += [f"{block}.{key}" for key in sorted(settings or {}) if key != "enabled"]


def _optimizer(block: dict[str, Any], name: str, take, out: Translation) -> None:
    kind = str(block.get("type", "AdamW"))
    if kind.lower() not in ("adam", "adamw"):
        out.problems.append(f"{name}: optimizer.type {kind!r}: meshtune trains with AdamW; remove the optimizer "
                            f"block or set its type to AdamW")
        return
    params = dict(block.get("params") or {})
    if kind.lower() == "adam" and params.pop("adam_w_mode", True) is False:
        out.problems.append(f"{name}: optimizer Adam with adam_w_mode false (L2 in the gradient) is not AdamW; "
                            f"meshtune trains with AdamW's decoupled weight decay")
    take("learning_rate", params.pop("lr", None), "optimizer.params.lr")
    betas = params.pop("betas", None)
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            out.problems.append(f"{name}: optimizer.params.betas {betas!r} is not a pair [beta1, beta2]")
        else:
            take("adam_beta1", betas[0], "optimizer.params.betas[0]")
            take("adam_beta2", betas[1], "optimizer.params.betas[1]")
    take("adam_epsilon", params.pop("eps", None), "optimizer.params.eps")
    take("weight_decay", params.pop("weight_decay", None), "optimizer.params.weight_decay")
    out.unhonoured += [f"optimizer.params.{key}" for key in sorted(params)]
    out.unhonoured += [f"optimizer.{key}" for key in sorted(block) if key not in ("type", "params")]


def _scheduler(block: dict[str, Any], name: str, given: dict[str, Any], sources: dict[str, str], take,
               out: Translation) -> None:
    kind = block.get("type")
    if kind not in SCHEDULERS:
        out.problems.append(f"{name}: scheduler.type {kind!r} is not supported; meshtune has {', '.join(SCHEDULERS)} "
                            f"(as lr_scheduler_type {', '.join(SCHEDULERS.values())}); remove the scheduler block "
                            f"to use lr_scheduler_type")
        return
    params = dict(block.get("params") or {})
    ours = SCHEDULERS[kind]
    used = "lr_scheduler_type" not in given or given["lr_scheduler_type"] == ours
    if used:
        take("lr_scheduler_type", ours, "scheduler.type")
    else:
        # HF Trainer lets the file's scheduler win silently; the user's explicit choice is what meshtune follows
        out.notes.append(f"{name}: scheduler {kind} (lr_scheduler_type {ours}) is not used: lr_scheduler_type "
                         f"{given['lr_scheduler_type']!r} ({sources.get('lr_scheduler_type', 'config')}) is; HF "
                         f"Trainer would have run the file's {kind}")
    if used and "warmup_num_steps" not in params:
        take("warmup_steps", WARMUP_NUM_STEPS, "scheduler.params.warmup_num_steps (absent: DeepSpeed's default)")
        out.notes.append(f"{name}: scheduler {kind} gives no warmup_num_steps: {WARMUP_NUM_STEPS} warmup steps, "
                         f"DeepSpeed's default (\"auto\" takes warmup_steps / warmup_ratio)")
    take("warmup_steps", params.pop("warmup_num_steps", None), "scheduler.params.warmup_num_steps")
    if used and kind == "WarmupDecayLR" and "warmup_max_lr" not in params:
        if "learning_rate" in out.values:  # DeepSpeed's scheduler would overrule the optimizer's lr
            lr = out.values["learning_rate"]
            out.problems.append(f"{name}: scheduler WarmupDecayLR gives no warmup_max_lr, so DeepSpeed peaks at its "
                                f"default {WARMUP_DECAY_MAX_LR}, not optimizer.params.lr {lr}; set "
                                f"scheduler.params.warmup_max_lr to the peak you mean (or \"auto\")")
        else:
            take("learning_rate", WARMUP_DECAY_MAX_LR, "scheduler.params.warmup_max_lr (absent: DeepSpeed's default)")
    take("learning_rate", params.pop("warmup_max_lr", None), "scheduler.params.warmup_max_lr")
    take("max_steps", params.pop("total_num_steps", None), "scheduler.params.total_num_steps")
    for entry in ("warmup_min_lr", "warmup_min_ratio"):
        value = params.pop(entry, None)
        if value not in (None, 0, 0.0):
            out.problems.append(f"{name}: scheduler.params.{entry} {value!r}: meshtune's warmups start at 0; set it "
                                f"to 0 or \"auto\"")
    warmup_type = params.pop("warmup_type", None)
    cos_min_ratio = params.pop("cos_min_ratio", None)
    out.unhonoured += [f"scheduler.params.{key}" for key in sorted(params)]
    if not used:  # its warmup_type and cos_min_ratio shape a schedule that does not run
        return
    if warmup_type not in (None, "log", "linear"):  # DeepSpeed warns and warms up as log
        out.notes.append(f"{name}: scheduler.params.warmup_type {warmup_type!r} is neither log nor linear: log, as "
                         f"DeepSpeed falls back to")
        warmup_type = "log"
    take("warmup_type", warmup_type, "scheduler.params.warmup_type")
    if kind == "WarmupCosineLR":
        take("cos_min_ratio", cos_min_ratio, "scheduler.params.cos_min_ratio")
    elif cos_min_ratio is not None:
        out.unhonoured.append("scheduler.params.cos_min_ratio")
