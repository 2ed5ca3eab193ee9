"""The run plan: every setting the config leaves open (`auto`, or unset) made concrete once, with the reason.

`resolve` reads the config, the processes and their devices, and the checkpoint being resumed. The model builder,
the data plan and the loop read the plan and never an `auto`; the config stays what the user wrote (its hash is
the run's identity across nodes and checkpoints) and is never changed. What only the run itself can find out is
recorded in the plan with its reason (`RunPlan.amended`): the builder turns the fused loss off for a head it cannot
fuse, and the recomputed blocks a `measure` plan leaves open are measured before training. So the plan is logged
once, as one block, after the model is built, and written to output_dir/run_plan.json once the run is accepted,
as the run trains.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from pydantic import ValidationError

from meshtune.config import TrainConfig
from meshtune.crossing import MULTI_STAGE_SCHEDULES as MULTI_STAGE
from meshtune.crossing import (MAX_BLOCKS_PER_UNIT, NF4_BYTES, ModelSize, PipelineShape, StepTime, compute_seconds,
                               data_parallel_step, default_blocks_per_unit, fsdp_units, full_model_facts,
                               pipeline_step, stage_costs, step_collectives)
from meshtune.crossing import stages_a_process as virtual_stages
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.hardware import bf16_supported, slowest_peak_flops, smallest_gpu_memory, varlen_available
from meshtune.mesh import ParallelDims

SHARDED = ("zero2", "zero3", "hsdp")
# When gradients cross the processes under gradient accumulation (one micro-step: always on it)
ONCE = "once_per_step"              # only on the last micro-step; each process accumulates its own until then
SHARD_EACH = "shard_each_micro_step"  # hsdp: reduce-scattered inside the replica every micro-step, all-reduced
#                                       across the replicas (the nodes) only on the last
EACH = "each_micro_step"            # reduce-scattered every micro-step, so gradients stay sharded
MEASURE = "measure"  # recompute: the blocks to recompute are measured before training (train/memory_fit.py)


@dataclass(frozen=True)
class RunPlan:
    parallel: str                # ddp | zero2 | zero3 | hsdp
    bf16: bool                   # compute in bf16 (fp32 master weights)
    frozen_bf16: bool  # the frozen base stored in bf16 (LoRA under ddp, Q-LoRA): only adapters are master weights
    bf16_weights: bool           # master_weights bf16: full fine-tuning's weights, gradients and AdamW moments in bf16
    padding_free: bool           # a micro-batch's samples end to end in one row, varlen attention
    fused_loss: bool             # the head computes the loss in chunks (where the head is a bias-free linear layer)
    compile: bool                # torch.compile each transformer block and the loss chunks
    recompute: float | str       # share of the blocks recomputed in backward, or MEASURE (fit memory_budget)
    blocks_per_unit: int | None  # consecutive blocks per FSDP2 unit; None under ddp
    hsdp_shard_size: int | None  # processes sharding one replica; None unless hsdp
    # FSDP2 frees each unit's gathered weights after forward (an int: to that many processes, a node's); None: ddp
    reshard_after_forward: bool | int | None
    gradient_reduction: str      # under accumulation, when gradients cross processes: ONCE, SHARD_EACH, EACH
    cpu_offload: bool            # FSDP2's shards (weights, gradients, optimizer state) in host memory
    gradient_accumulation_steps: int  # the config's, or what keeps a resumed checkpoint's global batch
    fused_adamw: bool
    gc_interval: int             # 0: Python's automatic garbage collection
    weights_from_rank0: bool     # rank 0 reads the model files, the others receive its weights
    grad_sync: str | None        # ddp | flat: how ddp on several processes reduces gradients; None: no ddp sync
    grad_reduce_dtype: str | None  # fp32 | bf16: the dtype gradients cross the processes in; None: none cross
    fsdp_prefetch: int | None    # FSDP2 units gathered explicitly ahead of use (0: FSDP2's own); None under ddp
    resumed_from: str | None     # the checkpoint the run continues; None: it starts at step 0
    why: dict[str, str] = field(default_factory=dict)  # the reason for each setting meshtune chose
    fp16: bool = False           # fp16 compute through autocast and a dynamic loss scale, fp32 master weights (GPUs)
    # the device mesh, outermost dimension first: dp_replicate (replicas), dp_shard (FSDP2 shards), cp (context
    # parallel), tp (tensor parallel, innermost: consecutive ranks, inside one node)
    mesh: dict[str, int] = field(default_factory=dict)
    powersgd_rank: int = 0       # ddp: gradients cross as PowerSGD's rank-r factors; 0: whole
    # pipeline_parallel: torch's schedule (gpipe | 1f1b | interleaved_1f1b | zbv; None: no pipeline), the stages
    # each process holds (pipeline_parallel x that many stages in all) and each stage's blocks [first, end)
    pipeline_schedule: str | None = None
    pipeline_virtual_stages: int = 1
    pipeline_stages: list[tuple[int, int]] = field(default_factory=list)
    # each row of the step's micro-batches a micro-batch of the schedule (pipeline_row_micro_batches, or auto by the
    # link); else each micro-step's rows one
    pipeline_one_row: bool = False
    # stage: dpo: the reference's log-probs computed once before training (train/reference_pass.py)
    precompute_ref_log_probs: bool = False

    @property
    def tensor_parallel(self) -> int:
        return self.mesh.get("tp", 1)

    @property
    def context_parallel(self) -> int:
        return self.mesh.get("cp", 1)

    @property
    def pipeline_parallel(self) -> int:
        return self.mesh.get("pp", 1)

    @property
    def model_parallel(self) -> int:
        """The consecutive processes that take the same micro-batches: a cp x tp group."""
        return self.context_parallel * self.tensor_parallel

    def dims(self, env: DistEnv) -> ParallelDims:
        """The mesh this plan lays out, as `env`'s process sees it: which ranks share its data, its groups."""
        return ParallelDims.of(self.mesh, env)

    def data_env(self, env: DistEnv) -> DistEnv:
        """`env` as the data sees it: one data-parallel rank per cp x tp group, whose processes all take the same
        micro-batches. The same `env` without tensor or context parallelism. Under pipeline_parallel the ranks
        that share data are one of each stage, `world_size / pipeline_parallel` apart (the stages outermost)."""
        return self.dims(env).data_env()

    @property
    def load_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.frozen_bf16 or self.bf16_weights else torch.float32

    @property
    def autocast_bf16(self) -> bool:
        """DDP computes in bf16 through autocast; FSDP2's mixed-precision policy casts by itself."""
        return self.bf16 and self.parallel == "ddp"  # under tensor_parallel ddp runs as FSDP2 replicas

    def describe(self) -> str:
        precision = ("fp16 compute (autocast), dynamic loss scale, fp32 master weights" if self.fp16 else
                     "bf16 compute, frozen base in bf16, fp32 adapters" if self.frozen_bf16 else
                     "bf16 weights, gradients and AdamW moments, stochastic rounding" if self.bf16_weights else
                     "bf16 compute, fp32 master weights" if self.bf16 else "fp32")
        rows = [("parallel", self.parallel), ("precision", precision),
                ("padding_free", on(self.padding_free)), ("fused_loss", on(self.fused_loss)),
                ("torch_compile", on(self.compile)),
                ("gradient_checkpointing", "measured before training" if self.recompute == MEASURE else
                 f"{self.recompute:g} of the blocks" if self.recompute else "off")]
        if "link_gbps" in self.why:  # auto across nodes by the link: every candidate's prediction
            rows.insert(1, ("link_gbps", "not used" if self.why["link_gbps"].startswith("not used") else "chose"))
        if "reference" in self.why:  # stage: dpo
            rows.append(("reference", "none" if self.why["reference"].startswith("none") else
                         "precomputed" if self.why["reference"].startswith("precomputed") else "in the loop"))
        if "precompute_ref_log_probs" in self.why:  # stage: dpo's auto
            rows.append(("precompute_ref_log_probs", on(self.precompute_ref_log_probs)))
        if self.tensor_parallel > 1:
            rows.append(("tensor_parallel", str(self.tensor_parallel)))
        if self.context_parallel > 1:
            rows.append(("context_parallel", str(self.context_parallel)))
        if self.pipeline_parallel > 1:
            rows.append(("pipeline_parallel", str(self.pipeline_parallel)))
            rows.append(("pipeline_schedule", str(self.pipeline_schedule)))
            if self.pipeline_one_row:
                rows.append(("pipeline micro-batches", "one row each"))
            if self.pipeline_virtual_stages > 1:
                rows.append(("pipeline_virtual_stages", str(self.pipeline_virtual_stages)))
            rows.append(("pipeline_stages", ", ".join(f"blocks {a}-{b - 1}" if b > a else "no block"
                                                      for a, b in self.pipeline_stages)))
        if self.model_parallel > 1 or self.pipeline_parallel > 1:
            rows.append(("device_mesh", " x ".join(f"{name} {size}" for name, size in self.mesh.items())))
        if self.blocks_per_unit is not None:
            rows.append(("fsdp_blocks_per_unit", str(self.blocks_per_unit)))
        if self.hsdp_shard_size is not None:
            rows.append(("hsdp_shard_size", str(self.hsdp_shard_size)))
        if self.reshard_after_forward is not None:
            rows.append(("reshard_after_forward", on(self.reshard_after_forward) if isinstance(
                self.reshard_after_forward, bool) else f"to {self.reshard_after_forward} processes (a node)"))
        if self.powersgd_rank:
            rows.append(("powersgd_rank", str(self.powersgd_rank)))
        if self.fsdp_prefetch is not None or "fsdp_prefetch" in self.why:
            rows.append(("fsdp_prefetch", f"{self.fsdp_prefetch} ahead" if self.fsdp_prefetch else
                         "FSDP2's own" if self.fsdp_prefetch == 0 else "none"))
        for key in ("grad_sync", "grad_reduce_dtype"):
            if getattr(self, key) is not None or key in self.why:
                rows.append((key, getattr(self, key) or "none"))
        if self.gradient_accumulation_steps > 1:
            rows.append(("gradient_reduction", self.gradient_reduction))
        if self.cpu_offload or "cpu_offload" in self.why:
            rows.append(("cpu_offload", on(self.cpu_offload)))
        rows += [("gradient_accumulation_steps", str(self.gradient_accumulation_steps)),
                 ("optim", "meshtune bf16 AdamW, stochastic rounding" if self.bf16_weights else
                  "adamw_torch_fused" if self.fused_adamw else "adamw_torch"),
                 ("gc_interval", str(self.gc_interval)),
                 ("load_weights_on", "rank0" if self.weights_from_rank0 else "every_rank"),
                 ("resume_from_checkpoint", self.resumed_from or "none: from step 0")]
        lines = ["run plan (also in output_dir/run_plan.json):"]
        for key, value in rows:
            reason = self.why.get(key)
            lines.append(f"  {key:<28} {value}{f'  ({reason})' if reason else ''}")
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    def amended(self, key: str, reason: str, **fields) -> RunPlan:
        """This plan with `fields` as the run found they must be, and why (under `key`, the row it explains): the
        plan written and logged is the one the run trains with."""
        return replace(self, **fields, why={**self.why, key: reason})


def on(flag: bool) -> str:
    return "on" if flag else "off"


def resolve(cfg: TrainConfig, env: DistEnv, resume_manifest: dict | None,
            model_size: Callable[[], ModelSize], resumed_from: Path | None = None, shared: bool = True) -> RunPlan:
    """The plan of this run, the same on every rank. `model_size` is called only where a choice depends on it
    (full fine-tuning on several GPUs, FSDP2 units); choosing the parallel mode may be a collective. The checkpoint
    resumed (`resumed_from`, found as `resume_request` asked, its manifest `resume_manifest`) and whether output_dir
    is `shared` by all nodes come from the checkpoint manager."""
    why: dict[str, str] = {}
    model_size = functools.cache(model_size)  # builds a model without weights: once, and only if a choice needs it
    tp = tensor_parallel_size(cfg, env, model_size)
    cp = context_parallel_size(cfg, env, tp)
    # the smallest GPU of the job (a collective, the same on every rank), once and only if a choice needs it
    gpu_bytes = functools.cache(lambda: smallest_gpu_memory(env.device, cfg.gpu_memory_limit)
                                if env.device.type == "cuda" else None)
    link = choose_by_link(cfg, env, model_size, gpu_bytes, lambda: slowest_peak_flops(env.device), why)
    pp = link.pipeline if link else pipeline_parallel_size(cfg, env, model_size)
    # the processes the data-parallel wrapper reduces gradients over (and FSDP2 shards over): a tensor-parallel
    # group counts as one; a cp group's processes each hold partial gradients, so they count, as torchtitan's
    # dp_shard x cp; under pipeline_parallel, one stage's processes
    procs = data_parallel_env(env, tp) if pp == 1 else stage_env(env, pp)
    dp = data_parallel_env(procs, cp)  # the data's ranks: a cp x tp group takes the same micro-batches
    parallel = link.mode if link else choose_parallel(cfg, procs, model_size, gpu_bytes, why)
    if pp > 1 and parallel == "hsdp":  # auto across nodes: the stages are across the nodes already
        parallel = "zero2"
        why["parallel"] = ("auto under pipeline_parallel: the stages lie across the nodes, and zero2 shards each "
                           "stage over its processes")
    replicas_only = tp > 1 and parallel == "ddp"
    if replicas_only:  # DDP takes no DTensor parameters: FSDP2 holds whole replicas (a shard of one process)
        parallel = "hsdp"
        why["parallel"] = (f"{why['parallel']}; " if "parallel" in why else "") + (
            "ddp under tensor_parallel: FSDP2 over the dp_replicate dimension, every replica whole (dp_shard 1), "
            "its gradients all-reduced")
    bf16 = not cfg.fp16 and (bf16_supported(env.device) if cfg.bf16 is None else
                             cfg.bf16 and env.device.type == "cuda")
    if cfg.bf16 and env.device.type != "cuda":
        why["precision"] = "bf16 is ignored on CPU"
    fp16 = cfg.fp16 and env.device.type == "cuda"  # fp16: true, for GPUs without bf16, in bf16's place
    if cfg.fp16 and not fp16:
        why["precision"] = "fp16 is ignored on CPU"
    # Q-LoRA's frozen base, NF4 apart, stays bf16 under FSDP2 too: its embeddings and head are a 72B model's largest
    # tensors left, and FSDP2 would only cast fp32 copies of them down to bf16 for every forward
    frozen_bf16 = bf16 and cfg.is_lora and (parallel == "ddp" or cfg.finetuning_type == "qlora")
    padding_free = cfg.padding_free if cfg.padding_free is not None else varlen_available(env.device)
    if tp > 1 and padding_free:
        padding_free = False
        why["padding_free"] = ("off under tensor_parallel: rows are padded to a multiple of tensor_parallel, each "
                               "process holding an equal share of their positions (sequence parallel)")
    if cp > 1 and padding_free:
        padding_free = False
        why["padding_free"] = ("off under context_parallel: rows are padded to a multiple of 64 x context_parallel, "
                               "each process holding two of their 2 x context_parallel chunks; the ring attention "
                               "takes whole rows")
    if pp > 1 and padding_free:
        padding_free = False
        why["padding_free"] = ("off under pipeline_parallel: every micro-batch of a step is padded to one shape, "
                               "the one the stages' sends and receives are set up for")
    # Q-LoRA sharded by FSDP2 with activation checkpointing: on CUDA the recompute of a compiled block saves other
    # tensors than its forward did (torch.utils.checkpoint's CheckpointError), so its blocks run uncompiled
    recompute = recomputation(cfg, env, why)
    if pp > 1 and recompute == MEASURE:
        recompute = 0.0
        why["gradient_checkpointing"] = ("not measured under pipeline_parallel (the measuring steps run the whole "
                                         "model on one process): set gradient_checkpointing_ratio to recompute blocks")
    compile_clash = cfg.finetuning_type == "qlora" and parallel in SHARDED and recompute != 0
    compile_ = cfg.torch_compile if cfg.torch_compile is not None else env.device.type == "cuda" and not compile_clash
    if tp > 1 and compile_:
        compile_ = False
        why["torch_compile"] = "off under tensor_parallel: the blocks run eagerly between their DTensor collectives"
    if pp > 1 and compile_:
        compile_ = False
        why["torch_compile"] = ("off under pipeline_parallel: a stage's blocks run eagerly between its sends and "
                                "receives")
    if cp > 1 and compile_:
        compile_ = False
        why["torch_compile"] = ("off under context_parallel: the ring attention swaps the blocks' attention for "
                                "DTensor collectives while a micro-step runs, and the blocks run eagerly around it")
    for key, value, default in (("padding_free", cfg.padding_free, "on with CUDA"),
                                ("torch_compile", cfg.torch_compile, "on with CUDA" + (
                                    "; off for Q-LoRA sharded by FSDP2 with activation checkpointing, whose "
                                    "compiled blocks fail their recompute" if compile_clash else ""))):
        if value is None and key not in why:  # tensor_parallel's or context_parallel's reason stands
            why[key] = f"default, {default}"
    fused_adamw = cfg.optim == "adamw_torch_fused" or (cfg.optim == "auto" and env.device.type == "cuda")
    # FSDP2's offload: a mode that runs as ddp (LoRA's zero2) has no shards to keep in host memory
    offload = cfg.cpu_offload and parallel in SHARDED
    if cfg.optim == "auto":
        why["optim"] = ("auto: fused on CUDA; the offloaded shards step in torch's fused CPU kernel" if
                        offload and fused_adamw else "auto: fused on CUDA")
    gc_interval = cfg.gc_interval if cfg.gc_interval is not None else (50 if env.world_size > 1 else 0)
    if cfg.gc_interval is None:
        why["gc_interval"] = ("default: all ranks collect at the same steps" if gc_interval else
                              "default with one process: Python's automatic collection")
    weights_from_rank0 = env.world_size > 1 and cfg.load_weights_on == "rank0" and cfg.finetuning_type != "qlora"
    if pp > 1 and weights_from_rank0:
        weights_from_rank0 = False
        why["load_weights_on"] = ("every_rank under pipeline_parallel: each process reads the files and keeps its "
                                  "stage's blocks")
    if cfg.finetuning_type == "qlora":
        why["load_weights_on"] = ("qlora: each process reads the files block by block, quantizes each block and keeps "
                                  "its shard")
    blocks_per_unit = None
    if parallel in SHARDED:
        blocks_per_unit = cfg.fsdp_blocks_per_unit or default_blocks_per_unit(model_size().block_parameters)
        if cfg.fsdp_blocks_per_unit is None:
            why["fsdp_blocks_per_unit"] = f"default: up to {MAX_BLOCKS_PER_UNIT} blocks within ~1B parameters a unit"
    hsdp_shard = 1 if replicas_only else hsdp_shard_size(cfg, procs, parallel, why)
    if cp > 1 and parallel == "hsdp" and hsdp_shard % cp:
        raise ConfigError(f"context_parallel: {cp} does not divide hsdp_shard_size {hsdp_shard}: a cp group's "
                          f"processes shard one replica together; set hsdp_shard_size to a multiple of {cp}")
    reshard = reshard_after_forward(cfg, parallel, hsdp_shard, model_size, gpu_bytes, why) if not replicas_only \
        else False
    if cfg.finetuning_type == "qlora" and parallel == "hsdp" and hsdp_shard == 1:
        raise ConfigError("parallel: hsdp with a shard of 1 process shards nothing, and torchao's NF4 weights cannot "
                          "be sharded over one: for qlora set hsdp_shard_size above 1, or parallel: ddp")
    if offload:  # the config allows it with zero2 / zero3 / hsdp only
        why["cpu_offload"] = offload_reason(cfg.is_lora, model_size().parameters, hsdp_shard or procs.world_size,
                                            procs)
    elif cfg.cpu_offload:
        why["cpu_offload"] = (f"{cfg.parallel} with {cfg.finetuning_type} runs as {parallel}, where FSDP2's offload "
                              f"has no shards to move: the frozen base stays on the GPU, as under DeepSpeed's ZeRO-2, "
                              f"and what ZeRO-2's offload would move, the adapters' gradients and AdamW moments, is "
                              f"a few MB")
    accumulation = keep_global_batch(cfg, resume_manifest, dp.world_size, why,
                                     cfg.gradient_accumulation_steps * (pp if link else 1))
    if link and pp > 1 and "gradient_accumulation_steps" not in why:
        why["gradient_accumulation_steps"] = (
            f"{cfg.gradient_accumulation_steps} x {pp}: the stages across the nodes leave {dp.world_size} pipelines "
            f"of the {env.world_size} processes, each taking {pp} times the micro-batches, so the global batch stays "
            f"{cfg.per_device_train_batch_size * accumulation * dp.world_size}")
    check_train_batch_size(cfg, accumulation, dp.world_size)
    reduction = gradient_reduction(cfg, procs.world_size, parallel, accumulation, model_size, gpu_bytes, why)
    grad_sync, reduce_dtype = gradient_crossing(cfg, procs.world_size, parallel, why)
    if pp > 1 and grad_sync == "ddp":
        grad_sync = "flat"
        why["grad_sync"] = ("flat under pipeline_parallel: a stage's replicas average their gradients in one "
                            "all-reduce after the schedule's last backward")
    reshard = reshard_to_node(cfg, parallel, reshard, procs, tp * cp, why)
    powersgd = powersgd_rank(cfg, parallel, procs.world_size, why)
    prefetch = cfg.fsdp_prefetch if parallel in SHARDED else None
    if prefetch is None and cfg.fsdp_prefetch:
        why["fsdp_prefetch"] = "ddp: no FSDP2 units to gather ahead"
    if reason := resume_reason(cfg, shared, resumed_from):
        why["resume_from_checkpoint"] = reason
    bf16_weights = cfg.master_weights == "bf16"
    if bf16_weights:
        why["optim"] = "master_weights: bf16 steps bf16 weights with stochastic rounding" + (
            "" if cfg.optim == "auto" else f", not {cfg.optim}")
    fused_loss = cfg.fused_loss
    if tp > 1 and fused_loss:
        fused_loss = False
        why["fused_loss"] = ("off under tensor_parallel: the head's vocabulary is split over the tensor-parallel "
                             "processes, and the loss (stage: dpo and kto: each response's log-prob) is computed "
                             "across their shares of the logits (vocabulary-parallel cross-entropy), which are never "
                             "gathered whole")
    if pp > 1 and fused_loss:
        fused_loss = False
        why["fused_loss"] = ("off under pipeline_parallel: the last stage's head returns the logits the schedule "
                             "hands to the loss")
    if cfg.stage == "dpo" and fused_loss:
        why["fused_loss"] = ("stage: dpo: the head returns each response's summed log-prob under the policy, in row "
                             "chunks over the trained positions (their logits computed again in backward); the "
                             "reference's are summed the same way, without gradients")
    if cfg.stage == "kto" and fused_loss:
        fused_loss = False
        why["fused_loss"] = ("off for stage: kto: its KL pass and losses read the policy's logits in full (the fused "
                             "head returns the summed log-probs stage: dpo compares)")
    precompute = cfg.stage == "dpo" and precompute_reference(cfg, why)
    if cfg.stage in ("dpo", "kto"):
        why["reference"] = reference_reason(cfg, precompute)
    return RunPlan(precompute_ref_log_probs=precompute, parallel=parallel, bf16=bf16, frozen_bf16=frozen_bf16,
                   bf16_weights=bf16_weights,
                   padding_free=padding_free, powersgd_rank=powersgd,
                   fused_loss=fused_loss, compile=compile_, recompute=recompute, blocks_per_unit=blocks_per_unit,
                   hsdp_shard_size=hsdp_shard, reshard_after_forward=reshard, gradient_reduction=reduction,
                   cpu_offload=offload,
                   gradient_accumulation_steps=accumulation, fused_adamw=fused_adamw, gc_interval=gc_interval,
                   weights_from_rank0=weights_from_rank0, grad_sync=grad_sync, grad_reduce_dtype=reduce_dtype,
                   fsdp_prefetch=prefetch, resumed_from=str(resumed_from) if resumed_from else None, why=why, fp16=fp16,
                   mesh=({"pp": pp} if pp > 1 else {}) | mesh_layout(parallel, procs.world_size, hsdp_shard, tp, cp),
                   **pipeline_choice(cfg, env, pp, parallel, accumulation, model_size, why, link))


def precompute_reference(cfg: TrainConfig, why: dict[str, str]) -> bool:
    """stage: dpo's `precompute_ref_log_probs`: as set, or under auto where it saves memory (a frozen copy is never
    held while training) or forwards (pairs read more than once)."""
    if cfg.pref_loss in ("orpo", "simpo"):
        return False  # no reference (config.py refuses true)
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


TP_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")  # the decoder blocks model/tensor_parallel.py splits


def tensor_parallel_size(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize]) -> int:
    """`tensor_parallel`, checked against the job and the model: the processes of one tensor-parallel group are
    consecutive ranks inside one node (its links carry every block's activations four times a pass), and each holds
    an equal share of the attention and key-value heads. A layout that cannot work is refused, naming the counts that
    do."""
    tp = cfg.tensor_parallel
    if tp == 1:
        return 1
    refused = ("finetuning_type: qlora (torchao's NF4 weights are not split by DTensor's tensor parallel)"
               if cfg.finetuning_type == "qlora" else
               "cpu_offload (the tensor-parallel collectives run on the GPUs' own weights)" if cfg.cpu_offload else
               "additional_target (the modules it trains in full are not split)" if cfg.additional_target else None)
    if refused:
        raise ConfigError(f"tensor_parallel: {tp} cannot be combined with {refused}; set tensor_parallel: 1")
    size = model_size()
    if size.model_type not in TP_MODEL_TYPES:
        raise ConfigError(f"tensor_parallel: {tp}: meshtune splits the blocks of {', '.join(TP_MODEL_TYPES)} models, "
                          f"not model_type {size.model_type or 'unknown'} of {cfg.model_name_or_path}; set "
                          f"tensor_parallel: 1")
    if size.tied_embeddings:
        raise ConfigError(f"tensor_parallel: {tp}: {cfg.model_name_or_path} ties its output head to the input "
                          f"embedding (tie_word_embeddings), which meshtune does not split; such models are small "
                          f"enough for tensor_parallel: 1 with parallel: zero3")
    working = [d for d in range(1, env.local_world_size + 1) if env.local_world_size % d == 0
               and size.attention_heads % d == 0 and size.kv_heads % d == 0]
    counts = f"counts that work here: {', '.join(map(str, working))}"
    if env.local_world_size % tp:
        raise ConfigError(f"tensor_parallel: {tp} does not divide the {env.local_world_size} processes of a node "
                          f"(a tensor-parallel group stays inside one node); {counts}")
    if size.attention_heads % tp or size.kv_heads % tp:
        raise ConfigError(f"tensor_parallel: {tp} does not divide the model's {size.attention_heads} attention heads "
                          f"and {size.kv_heads} key-value heads (each process holds an equal share); {counts}")
    if env.world_size % tp:
        raise ConfigError(f"tensor_parallel: {tp} does not divide the job's {env.world_size} processes; {counts}")
    return tp


def context_parallel_size(cfg: TrainConfig, env: DistEnv, tp: int) -> int:
    """`context_parallel`, checked against the job: the processes of a cp group are consecutive ranks (next to
    tensor parallel's, which stay innermost), and each row is cut into 2 x cp chunks. A layout or an option that
    cannot work with it is refused, with what to set."""
    cp = cfg.context_parallel
    if cp == 1:
        return 1
    refused = ("tensor_parallel above 1 (context parallel composes with data parallelism only)" if tp > 1 else
               "packing (a packed row needs a block-diagonal mask, which torch's ring attention does not take)"
               if cfg.packing else
               "padding_free: true (the ring attention takes whole padded rows; leave padding_free unset)"
               if cfg.padding_free else None)
    if refused:
        raise ConfigError(f"context_parallel: {cp} cannot be combined with {refused}; set context_parallel: 1")
    if env.device.type != "cuda":
        raise ConfigError(f"context_parallel: {cp} needs CUDA GPUs: torch's ring attention runs over the CUDA "
                          f"attention kernels (flash, memory-efficient, cuDNN); set context_parallel: 1 on CPU")
    if env.world_size % cp:
        working = [d for d in range(1, env.world_size + 1) if env.world_size % d == 0]
        raise ConfigError(f"context_parallel: {cp} does not divide the job's {env.world_size} processes; counts "
                          f"that work here: {', '.join(map(str, working))}")
    return cp


PP_MODEL_TYPES = TP_MODEL_TYPES  # decoders whose blocks, embedding, norm and head model/pipeline_parallel.py splits


def pipeline_parallel_size(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize]) -> int:
    """`pipeline_parallel`, checked against the job and the model: the stages are outermost in the mesh (rank r is
    on stage r // (world_size / pp)), so with the processes of one node a stage only activations cross nodes. What
    the config alone refuses, config.py does."""
    pp = cfg.pipeline_parallel
    if pp == 1:
        return 1
    if env.world_size % pp:
        working = [d for d in range(1, env.world_size + 1) if env.world_size % d == 0]
        raise ConfigError(f"pipeline_parallel: {pp} does not divide the job's {env.world_size} processes; counts "
                          f"that work here: {', '.join(map(str, working))}")
    size = model_size()
    if size.model_type not in PP_MODEL_TYPES:
        raise ConfigError(f"pipeline_parallel: {pp}: meshtune splits the decoders of {', '.join(PP_MODEL_TYPES)} "
                          f"models into stages, not model_type {size.model_type or 'unknown'} of "
                          f"{cfg.model_name_or_path}; set pipeline_parallel: 1")
    if size.tied_embeddings:
        raise ConfigError(f"pipeline_parallel: {pp}: {cfg.model_name_or_path} ties its output head to the input "
                          f"embedding (tie_word_embeddings), one weight the first and the last stage would both "
                          f"train; set pipeline_parallel: 1 (such models are small enough for parallel: zero3)")
    return pp


EMPTY_ENDS = ", the first and the last, several a process under ddp, may hold only the embedding or the head"


def ends_may_be_empty(virtual: int, parallel: str) -> bool:
    """Whether the first and the last stage may hold no block: where a process holds several stages and they are
    not FSDP2's (with one a process, a stage with no block would leave its process nothing to train under LoRA;
    FSDP2 shards a stage by its blocks)."""
    return virtual > 1 and parallel == "ddp"


def check_stage_blocks(cfg: TrainConfig, env: DistEnv, pp: int, parallel: str, blocks: int) -> None:
    """The model's blocks against the stages: a block a stage, or but for the ends (`ends_may_be_empty`)."""
    virtual = virtual_stages(cfg)

    def least(d: int) -> int:
        return d * virtual - 2 if ends_may_be_empty(virtual, parallel) else d * virtual

    if blocks < least(pp):
        working = [d for d in range(1, env.world_size + 1) if env.world_size % d == 0 and least(d) <= blocks]
        raise ConfigError(f"pipeline_parallel: {pp}: {pp * virtual} stages need at least {least(pp)} blocks (a block "
                          f"a stage{EMPTY_ENDS if virtual > 1 else ''}), and the model has {blocks}; counts that "
                          f"work here: {', '.join(map(str, working))}")


def interleaved_counts(pp: int, limit: int) -> list[int]:
    """The micro-batch counts up to `limit` torch's ScheduleInterleaved1F1B runs on `pp` processes: a whole number
    of rounds of max(1, n // pp) each."""
    return [n for n in range(1, limit + 1) if n % max(1, n // pp) == 0]


def pipeline_choice(cfg: TrainConfig, env: DistEnv, pp: int, parallel: str, micro_batches: int,
                    model_size: Callable[[], ModelSize], why: dict[str, str], link: LinkChoice | None = None) -> dict:
    """The schedule and the stages' blocks under pipeline_parallel (nothing without it). A step's micro-batches
    (gradient_accumulation_steps) are the schedule's: 1F1B, which holds at most pp micro-batches' activations
    on a stage, needs at least pp of them to fill the pipeline; GPipe runs any number; Interleaved1F1B a whole
    number of rounds; ZBV any number. With pipeline_row_micro_batches each row of them is one of the schedule's.
    Where the link chose the pipeline (`link`), its schedule and split."""
    if pp == 1:
        return {}
    if link is not None and link.schedule is not None:
        return link_pipeline(cfg, link, micro_batches, model_size(), parallel, why)
    one_row = bool(cfg.pipeline_row_micro_batches)
    micro_batches *= cfg.per_device_train_batch_size if one_row else 1
    counted = "gradient_accumulation_steps" + (" x per_device_train_batch_size" if one_row else "")
    schedule = cfg.pipeline_schedule
    if schedule == "1f1b" and micro_batches < pp:
        raise ConfigError(f"pipeline_schedule: 1f1b needs at least pipeline_parallel ({pp}) micro-batches a step, "
                          f"and the step has {micro_batches} ({counted}): raise "
                          f"gradient_accumulation_steps to {pp}, or use pipeline_schedule: gpipe")
    if schedule == "interleaved_1f1b" and micro_batches % max(1, micro_batches // pp):
        raise ConfigError(f"pipeline_schedule: interleaved_1f1b runs the micro-batches in rounds of "
                          f"max(1, micro-batches // pipeline_parallel), a whole number of them, and the step's "
                          f"{micro_batches} ({counted}) are not; counts that work on {pp} stages: "
                          f"{', '.join(map(str, interleaved_counts(pp, max(micro_batches, 4 * pp))))}")
    if schedule not in ("gpipe", "1f1b", *MULTI_STAGE):
        schedule = "1f1b" if micro_batches >= pp else "gpipe"
        why["pipeline_schedule"] = (f"auto: 1f1b, {micro_batches} micro-batches a step fill {pp} stages, and a stage "
                                    f"holds at most {pp} micro-batches' activations" if schedule == "1f1b" else
                                    f"auto: gpipe, {micro_batches} micro-batches a step are fewer than the {pp} "
                                    f"stages 1f1b needs")
    virtual = virtual_stages(cfg)
    size = model_size()
    head = head_worth(size)
    check_stage_blocks(cfg, env, pp, parallel, size.blocks)
    stages = balanced_stages(size.blocks, pp * virtual, head, ends_may_be_empty(virtual, parallel))
    why["pipeline_stages"] = stages_reason(stages, size.blocks, head, pp, schedule)
    return {"pipeline_schedule": schedule, "pipeline_virtual_stages": virtual, "pipeline_stages": stages,
            "pipeline_one_row": one_row}


def head_worth(size: ModelSize) -> float:
    """The output head's cost in blocks: its matmul's FLOPs a token (2 x vocabulary x hidden, forward) against a
    block's (2 x its parameters); 0 where the head is unknown. The embedding is a lookup and counts as nothing."""
    return size.head_parameters / size.block_parameters if size.block_parameters else 0.0


def balanced_stages(blocks: int, stages: int, head: float, empty_ends: bool = False) -> list[tuple[int, int]]:
    """Consecutive blocks [first, end) for each of `stages` stages, the slowest stage as fast as it can be: a stage
    costs its blocks, the last one `head` blocks more. Every stage holds a block, but with `empty_ends` the first
    and the last may hold none (the embedding alone, the head alone). Among splits as fast, the one with the
    smallest sum of squared costs (the most even), so blocks that divide evenly with no head split in equal
    shares."""
    def cost(stage: int, held: int) -> float:
        return held + (head if stage == stages - 1 else 0.0)

    # best[s][b]: (slowest, sum of squares) of the first s stages holding the first b blocks, and stage s-1's count
    best: list[dict[int, tuple[tuple[float, float], int]]] = [{0: ((0.0, 0.0), 0)}]
    for stage in range(stages):
        least = 0 if empty_ends and stage in (0, stages - 1) else 1
        row: dict[int, tuple[tuple[float, float], int]] = {}
        for before, ((slowest, squares), _) in best[-1].items():
            for held in range(least, blocks - before + 1):
                c = cost(stage, held)
                score = (max(slowest, c), squares + c * c)
                if before + held not in row or score < row[before + held][0]:
                    row[before + held] = (score, held)
        best.append(row)
    counts, end = [], blocks
    for stage in range(stages, 0, -1):
        held = best[stage][end][1]
        counts.append(held)
        end -= held
    first, bounds = 0, []
    for held in reversed(counts):
        bounds.append((first, first + held))
        first += held
    return bounds


def stages_reason(stages: list[tuple[int, int]], blocks: int, head: float, pp: int, schedule: str) -> str:
    """Why the stages hold the blocks they do, for run_plan.json."""
    held = ", ".join(str(end - first) for first, end in stages)
    where = (f"rank r holding stages r and {2 * pp - 1} - r" if schedule == "zbv" else
             f"rank r holding stages r, r + {pp}, ..." if len(stages) > pp else "a stage a process")
    costs = (f"the head (vocabulary x hidden) costs {head:.2f} blocks' FLOPs and the embedding, a lookup, none"
             if head else "the head's size unknown, each stage costs its blocks")
    return (f"{held} of the {blocks} blocks in the {len(stages)} stages ({where}): the slowest stage as fast as it "
            f"can be, as {costs}; the embedding on the first stage, the final norm and head on the last")


def stage_env(env: DistEnv, pp: int) -> DistEnv:
    """One pipeline stage's view of `env`: the stages are outermost, so a stage is `world_size / pp` consecutive
    ranks and this process's data rank is its place among them."""
    per_stage = env.world_size // pp
    return replace(env, rank=env.rank % per_stage, world_size=per_stage,
                   local_rank=env.local_rank % per_stage, local_world_size=min(env.local_world_size, per_stage))


def data_parallel_env(env: DistEnv, group: int) -> DistEnv:
    """The data-parallel view of `env`: each `group` of consecutive ranks (a tensor- or context-parallel group)
    counts as one process."""
    if group == 1:
        return env
    return replace(env, rank=env.rank // group, world_size=env.world_size // group,
                   local_rank=env.local_rank // group, local_world_size=max(env.local_world_size // group, 1))


def mesh_layout(parallel: str, procs: int, hsdp_shard: int | None, tp: int, cp: int = 1) -> dict[str, int]:
    """The device mesh's dimensions, outermost first: replicas, then shards (FSDP2's), then context parallel, then
    tensor parallel innermost, so a tensor-parallel group is consecutive ranks of one node. `procs`: the processes
    gradients are reduced over (tensor-parallel groups counted as one), `hsdp_shard` among them; a cp group lies
    inside a shard (sharded modes) or among the replicas (ddp)."""
    shard = {"ddp": 1, "hsdp": hsdp_shard or 1}.get(parallel, procs)
    if shard % cp:  # ddp: the cp group's processes are replicas of each other
        return {"dp_replicate": procs // cp, "dp_shard": 1, "cp": cp, "tp": tp}
    return {"dp_replicate": procs // shard, "dp_shard": shard // cp, "cp": cp, "tp": tp}


def resume_request(cfg: TrainConfig, shared: bool) -> tuple[bool, Path | None]:
    """Whether the run looks for a checkpoint to continue, and the one it names (None: the newest complete, verified
    one in output_dir, as `auto` asks). Asked before `resolve`: the plan depends on the checkpoint found."""
    if not shared or cfg.resume_from_checkpoint == "none":
        return False, None
    return True, None if cfg.resume_from_checkpoint == "auto" else Path(cfg.resume_from_checkpoint)


def resume_reason(cfg: TrainConfig, shared: bool, resumed_from: Path | None) -> str | None:
    """Why the run continues the checkpoint it does, or none, where meshtune chose it."""
    if not shared:
        return "output_dir is not shared by all nodes (allow_local_checkpoints): no resume"
    if cfg.resume_from_checkpoint != "auto":
        return None
    place = cfg.checkpoint_dir or "output_dir"  # where the checkpoints are: a store's URL names itself
    return (f"auto: the newest complete, verified checkpoint in {place}" if resumed_from else
            f"auto: no complete checkpoint in {place}")


def gradient_crossing(cfg: TrainConfig, world_size: int, parallel: str, why: dict[str, str]
                      ) -> tuple[str | None, str | None]:
    """How gradients cross the processes (`grad_sync`: DDP's buckets or one flat all-reduce, for ddp; FSDP2
    reduce-scatters by itself) and in which dtype; under ddp on one process nothing crosses, so neither applies."""
    if parallel == "ddp" and world_size == 1:
        if cfg.grad_sync == "flat" or cfg.grad_reduce_dtype == "bf16":
            why["grad_sync"] = why["grad_reduce_dtype"] = "one process: no gradient crosses processes"
        return None, None
    if parallel != "ddp" and cfg.grad_sync == "flat":
        why["grad_sync"] = f"{parallel}: FSDP2 reduce-scatters the gradients itself; flat is for ddp"
    return (cfg.grad_sync if parallel == "ddp" else None), cfg.grad_reduce_dtype


def memory_measurable(device: torch.device) -> bool:
    """Where a step's memory can be measured before training (the caching allocator's peaks): GPUs."""
    return device.type == "cuda"


def recomputation(cfg: TrainConfig, env: DistEnv, why: dict[str, str]) -> float | str:
    """The share of blocks recomputed in backward, or MEASURE: the fewest that fit memory_budget, from steps measured
    before training. Left open, GPU runs measure (a step that fits recomputes nothing), CPU runs recompute nothing; a
    ratio given turns recomputation on; `gradient_checkpointing: false` never recomputes."""
    if cfg.gradient_checkpointing is False:
        return 0.0
    cuda = memory_measurable(env.device)
    if cfg.gradient_checkpointing_ratio != "auto":
        return float(cfg.gradient_checkpointing_ratio)
    if cfg.gradient_checkpointing is None:
        why["gradient_checkpointing"] = ("default on GPUs: the largest step is measured before training and blocks are "
                                         "recomputed only where it would not fit memory_budget" if cuda else
                                         "default on CPU: nothing recomputed")
        return MEASURE if cuda else 0.0
    if not cuda:
        why["gradient_checkpointing"] = "ratio auto on CPU: every block (memory is measured on GPUs only)"
        return 1.0
    return MEASURE


def choose_parallel(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize],
                    gpu_bytes: Callable[[], float | None], why: dict[str, str]) -> str:
    mode, reason = parallel_for(cfg, env.world_size, env.local_world_size, env.device.type == "cuda", gpu_bytes,
                                model_size)
    if reason:
        why["parallel"] = reason
    return mode


def parallel_for(cfg: TrainConfig, processes: int, per_node: int, gpus: bool, gpu_bytes: Callable[[], float | None],
                 model_size: Callable[[], ModelSize]) -> tuple[str, str | None]:
    """The parallel mode a job of `processes` (`per_node` a node) runs, and why where meshtune chose it: `auto` made
    concrete (`auto_parallel`); other values pass through, but for two that cannot do what they say, Q-LoRA sharded
    over one process and LoRA under zero2. The doctor asks the same from the nodes' facts."""
    if cfg.finetuning_type == "qlora" and processes == 1 and cfg.parallel in SHARDED:
        return "ddp", (f"{cfg.parallel} on one process: nothing to shard (and torchao's NF4 weights cannot be "
                       f"sharded over one)")
    if cfg.finetuning_type == "lora" and cfg.parallel == "zero2":
        return "ddp", ("zero2 with LoRA runs as ddp: ZeRO-2 shards gradients and optimizer state, which LoRA has "
                       "for its adapters only, and never the weights (DeepSpeed's ZeRO-2 keeps the frozen base "
                       "whole on every GPU too), while FSDP2 would gather the whole base again every step")
    if cfg.parallel != "auto":
        return cfg.parallel, None
    mode, reason = auto_parallel(cfg, processes, per_node, gpus, gpu_bytes, model_size)
    return mode, f"auto: {reason}"


def full_state_bytes(cfg: TrainConfig, n_params: int, shards: int, whole_weights: bool,
                     unsharded_grads: bool = False) -> float:
    """One GPU's bytes of full fine-tuning's model state, the one estimate every choice of the plan reads: the bf16
    weights where they stay whole (zero2, hsdp keeping them from forward to backward), the process's shard of the
    state (16 bytes a parameter in fp32: weights, gradients, two AdamW moments; 8 with `master_weights: bf16`), and
    gradients held unsharded under accumulation without sync (4 bytes a parameter, as FSDP2 accumulates them)."""
    state = 8 if cfg.master_weights == "bf16" else 16
    return (2 * n_params if whole_weights else 0) + state * n_params / shards + (4 * n_params if unsharded_grads else 0)


def auto_parallel(cfg: TrainConfig, processes: int, per_node: int, gpus: bool, gpu_bytes: Callable[[], float],
                  model_size: Callable[[], ModelSize]) -> tuple[str, str]:
    """The mode `parallel: auto` picks, and why; the doctor asks the same from the nodes' facts.

    LoRA trains a few million parameters: ddp all-reduces only theirs and keeps the frozen base in bf16. Full
    fine-tuning on one node: zero2 reduce-scatters the gradients and steps the optimizer on a shard, at a fraction of
    ddp's memory; zero3 where zero2's whole weights would not leave room (`sharding_for_full`). Across nodes the
    network is the slow link: hsdp shards inside each node and replicates across nodes, so only the gradients'
    all-reduce crosses it, once an optimizer step, overlapping backward; zero3 over every process only when one
    node's GPUs cannot hold the model's state. Q-LoRA shards its 4-bit model only where a GPU could not hold it
    whole (`sharding_for_qlora`), inside a node first."""
    nodes = max(processes // max(per_node, 1), 1)
    if cfg.finetuning_type == "qlora" and processes > 1 and gpus:
        mode, reason = sharding_for_qlora(model_size(), processes, gpu_bytes())
        if mode == "zero3" and nodes > 1 and per_node > 1 and qlora_bytes(model_size()) / per_node <= 0.5 * gpu_bytes():
            return "hsdp", (f"{reason}; on {nodes} nodes hsdp shards it over each node's {per_node} GPUs instead, so "
                            f"only the adapters' gradients cross the network")
        return mode, reason
    if cfg.is_lora:
        return "ddp", "LoRA: only the adapters' gradients are all-reduced"
    if processes == 1:
        return "ddp", "one process"
    if not gpus:
        return "ddp", "CPU processes"
    n_params = model_size().parameters
    if nodes == 1:
        return sharding_for_full(cfg, n_params, processes, gpu_bytes())
    share = full_state_bytes(cfg, n_params, per_node, whole_weights=False)
    if per_node == 1 and share <= 0.5 * gpu_bytes():
        return "ddp", (f"full fine-tuning on {nodes} nodes of one GPU: each holds the whole model "
                       f"({share / 2**30:.1f} GiB of state of {gpu_bytes() / 2**30:.0f} GiB), so only the gradients' "
                       f"all-reduce crosses the network, overlapping backward")
    if per_node > 1 and share <= 0.5 * gpu_bytes():
        return "hsdp", (f"full fine-tuning on {nodes} nodes x {per_node} GPUs: hsdp shards the model over each node's "
                        f"GPUs ({share / 2**30:.1f} GiB of state per GPU of {gpu_bytes() / 2**30:.0f} GiB) and "
                        f"replicates it across nodes, so only the gradients' all-reduce crosses the network")
    mode, reason = sharding_for_full(cfg, n_params, processes, gpu_bytes())
    if per_node > 1:
        reason += (f"; one node's {per_node} GPUs cannot hold the model's state for hsdp "
                   f"({share / 2**30:.1f} GiB each)")
    return mode, reason


LINK_EFFICIENCY = 0.9  # of the line rate, what NCCL's all-reduce reaches on a healthy network (an assumption)
LINK_MARGIN = 0.02     # another mode replaces auto's rule only where its predicted step is this much shorter


@dataclass(frozen=True)
class LinkChoice:
    """`parallel: auto` chosen by the link (`link_gbps`): the data-parallel mode (inside each stage under a
    pipeline) and the pipeline's stages across the nodes (1: none)."""

    mode: str
    pipeline: int
    schedule: str | None = None  # the pipeline's schedule, and each row a micro-batch of it (`pipeline_shapes`)
    one_row: bool = False


def choose_by_link(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize],
                   gpu_bytes: Callable[[], float | None], peak_flops: Callable[[], float | None],
                   why: dict[str, str]) -> LinkChoice | None:
    """`parallel: auto` chosen by the link (`pick_by_link`) where `link_applies`, a GPU's compute estimated at
    MFU_ASSUMED of the job's slowest measured bf16 matmul rate; None (the rules without the link) elsewhere."""
    nodes = env.world_size // max(env.local_world_size, 1)
    if cfg.link_gbps is None or cfg.parallel != "auto" or nodes < 2:
        return None
    if not link_applies(cfg, nodes, env.device.type == "cuda"):
        why["link_gbps"] = ("not used: the plan chooses by the link for full fine-tuning with parallel: auto on "
                            "GPUs (no compute estimate on CPU; LoRA's adapters move little), without tensor, "
                            "context or pipeline parallel set")
        return None
    compute = compute_seconds_of(cfg, full_model_facts(model_size()), peak_flops())
    best, predicted, rule_reason = pick_by_link(cfg, env.world_size, env.local_world_size, model_size(), gpu_bytes(),
                                                compute)
    label = {choice: link_label(choice, nodes) for choice in predicted}
    step = predicted[best]
    others = ", ".join(f"{label[c]} {predicted[c].efficiency:.1%} ({predicted[c].step_s:.3g} s)" for c in predicted
                       if c != best)
    why["parallel"] = (f"auto by the link ({cfg.link_gbps:g} Gb/s): {label[best]}, predicted at {step.efficiency:.1%} "
                       f"per GPU of one node's step ({step.exposed_s:.3g} s of its {step.step_s:.3g} s not hidden"
                       + (f", the bubble {step.bubble_s:.3g} s" if step.bubble_s else "") + f"); {others}"
                       + (f"; without the link: {rule_reason}" if rule_reason else ""))
    why["link_gbps"] = "predicted per GPU: " + ", ".join(f"{label[c]} {predicted[c].efficiency:.1%}" for c in predicted)
    if refused := pipeline_refusal(cfg, model_size(), nodes):
        why["link_gbps"] += f"; no pipeline across the nodes: {refused}"
    return best


def link_applies(cfg: TrainConfig, nodes: int, gpus: bool) -> bool:
    """Whether `parallel: auto` chooses by the link: `link_gbps` set, full fine-tuning on several nodes of GPUs,
    with no tensor, context or pipeline parallel set. The doctor asks the same."""
    return (cfg.link_gbps is not None and cfg.parallel == "auto" and nodes > 1 and gpus
            and cfg.finetuning_type == "full" and cfg.pipeline_parallel == 1 and cfg.tensor_parallel == 1
            and cfg.context_parallel == 1)


def pick_by_link(cfg: TrainConfig, processes: int, per_node: int, size: ModelSize, card: float,
                 compute: float) -> tuple[LinkChoice, dict[LinkChoice, StepTime], str | None]:
    """Of the modes whose state fits (`link_candidates`), the one whose predicted step (meshtune.crossing: bytes a
    node at LINK_EFFICIENCY of the line rate, hidden behind `compute` seconds a GPU) is shortest; auto's rule without
    the link stands unless another is LINK_MARGIN faster. Also every candidate's step, and the rule's reason where
    it stands."""
    predicted = link_candidates(cfg, processes, per_node, size, card, compute)
    rule, reason = auto_parallel(cfg, processes, per_node, True, lambda: card, lambda: size)
    best = link_pick(predicted, LinkChoice(rule, 1))
    return best, predicted, reason if best == LinkChoice(rule, 1) else None


def link_pick(predicted: dict[LinkChoice, StepTime], rule: LinkChoice) -> LinkChoice:
    """The shortest predicted step, unless auto's rule without the link is within LINK_MARGIN of it."""
    best = min(predicted, key=lambda choice: predicted[choice].step_s)
    if rule in predicted and predicted[best].step_s > (1 - LINK_MARGIN) * predicted[rule].step_s:
        return rule
    return best


def link_label(choice: LinkChoice, nodes: int) -> str:
    if choice.pipeline == 1:
        return choice.mode
    split = ", micro-batches of one row" if choice.one_row else ""
    return f"pipeline_parallel {nodes} ({choice.mode} inside each stage, {choice.schedule}{split})"


def link_candidates(cfg: TrainConfig, processes: int, per_node: int, size: ModelSize, card: float,
                    compute: float) -> dict[LinkChoice, StepTime]:
    """Each mode's predicted optimizer step across the nodes, a GPU computing for `compute` seconds, where its state
    takes at most half of `card`: hsdp over a node (ddp with one GPU a node), zero2, zero3, and a pipeline stage a
    node (where config.py and the model allow it) sharded inside the node as zero2 or zero3 (`sharding_for_full`),
    its micro-batches the config's x the stages so the global batch stays."""
    nodes = processes // per_node
    facts, n, micro = full_model_facts(size), size.parameters, cfg.gradient_accumulation_steps
    bf16 = not cfg.fp16 and cfg.bf16 is not False
    busbw = cfg.link_gbps / 8 * 1e9 * LINK_EFFICIENCY
    units = fsdp_units(size, cfg.fsdp_blocks_per_unit)
    fits = {"hsdp" if per_node > 1 else "ddp": full_state_bytes(cfg, n, per_node, whole_weights=False),
            "zero2": full_state_bytes(cfg, n, processes, whole_weights=True), "zero3": 0.0}
    predicted = {}
    for mode, held in fits.items():
        if held > 0.5 * card:
            continue
        each = mode in ("zero2", "zero3") and gradient_reduction(cfg, processes, mode, micro, lambda: size,
                                                                 lambda: card, {}) == EACH
        crossing = step_collectives(cfg, mode, facts, bf16, True, processes, per_node, reduce_each=each, pipeline=1)
        predicted[LinkChoice(mode, 1)] = data_parallel_step(crossing, nodes, busbw, compute, micro, units)
    if pipeline_refusal(cfg, size, nodes) is None:
        stage = sharding_for_full(cfg, n // nodes, per_node, card)[0] if per_node > 1 else "ddp"
        if per_node > 1 or full_state_bytes(cfg, n // nodes, 1, whole_weights=False) <= 0.5 * card:
            for (schedule, one_row), shape in pipeline_shapes(cfg, size, nodes, micro * nodes, stage).items():
                shaped = cfg.model_copy(update={"pipeline_schedule": schedule})
                crossing = step_collectives(shaped, stage, facts, bf16, True, processes, per_node, pipeline=nodes,
                                            micro=micro * nodes)
                choice = LinkChoice(stage, nodes, schedule, one_row)
                predicted[choice] = pipeline_step(crossing, nodes, busbw, compute, shape)
    return predicted


def pipeline_shapes(cfg: TrainConfig, size: ModelSize, pp: int, micro: int,
                    parallel: str) -> dict[tuple[str, bool], PipelineShape]:
    """The pipelines of `pp` stages the link choice weighs, by (schedule, one row a micro-batch): the step's
    `micro` micro-batches as the config has them, and (per_device_train_batch_size above 1) each row one, unless
    pipeline_row_micro_batches names one; under each, pipeline_schedule where the config names one, else 1f1b
    (gpipe where the micro-batches are fewer than the stages), interleaved_1f1b (2 stages a process; where its rounds
    divide the micro-batches) and zbv, each where the blocks give every stage one (`check_stage_blocks`). Each stage
    costs what its blocks (and the last stage's head) cost (crossing.stage_costs), the stages balanced as the run
    builds them (`balanced_stages`)."""
    rows = cfg.per_device_train_batch_size
    named = cfg.pipeline_schedule if cfg.pipeline_schedule != "auto" else None
    splits = [False, True] if cfg.pipeline_row_micro_batches is None and rows > 1 else [
        bool(cfg.pipeline_row_micro_batches)]
    recompute = (cfg.named_recompute_ratio or 0.0) if cfg.gradient_checkpointing else 0.0
    facts = full_model_facts(size)
    shapes = {}
    for one_row, m in ((split, micro * rows if split else micro) for split in splits):
        for schedule in [named] if named else ["1f1b" if m >= pp else "gpipe", "interleaved_1f1b", "zbv"]:
            virtual = cfg.pipeline_virtual_stages or (2 if schedule in MULTI_STAGE else 1)
            empty_ends = ends_may_be_empty(virtual, parallel)
            if (schedule == "1f1b" and m < pp or schedule == "interleaved_1f1b" and m % max(1, m // pp)
                    or size.blocks < pp * virtual - (2 if empty_ends else 0)):
                continue  # what pipeline_choice and check_stage_blocks refuse
            stages = balanced_stages(size.blocks, pp * virtual, head_worth(size), empty_ends)
            costs = stage_costs(facts, stages, cfg.is_lora, recompute, cfg.cutoff_len)
            shapes[schedule, one_row] = PipelineShape(schedule, virtual, m, costs)
    return shapes


def link_pipeline(cfg: TrainConfig, link: LinkChoice, micro_batches: int, size: ModelSize, parallel: str,
                  why: dict[str, str]) -> dict:
    """The pipeline the link chose (`pipeline_shapes`): its schedule, stages and split, and why."""
    virtual = cfg.pipeline_virtual_stages or (2 if link.schedule in MULTI_STAGE else 1)
    head = head_worth(size)
    stages = balanced_stages(size.blocks, link.pipeline * virtual, head, ends_may_be_empty(virtual, parallel))
    why["pipeline_stages"] = stages_reason(stages, size.blocks, head, link.pipeline, link.schedule)
    if cfg.pipeline_schedule == "auto" or cfg.pipeline_row_micro_batches is None:
        count = micro_batches * (cfg.per_device_train_batch_size if link.one_row else 1)
        rows = "one row" if link.one_row else f"{cfg.per_device_train_batch_size} rows"
        why["pipeline_schedule"] = (f"auto by the link: {link.schedule} over {count} micro-batches of {rows}, the "
                                    f"shortest predicted step of the pipelines weighed (see parallel)")
    return {"pipeline_schedule": link.schedule, "pipeline_virtual_stages": virtual, "pipeline_stages": stages,
            "pipeline_one_row": link.one_row}


def compute_seconds_of(cfg: TrainConfig, facts, peak: float | None) -> float:
    """A GPU's compute for a step (meshtune.crossing's estimate), the same in every mode: under a pipeline each GPU
    computes 1 / stages of the model for stages x the micro-batches."""
    seconds = compute_seconds(cfg, facts, peak)
    if seconds is None:
        raise ConfigError("link_gbps: the plan could not measure the GPUs' matmul rate to estimate a step's "
                          "compute; unset link_gbps")
    return seconds


def pipeline_refusal(cfg: TrainConfig, size: ModelSize, stages: int) -> str | None:
    """Why `stages` pipeline stages cannot run this config and model (config.py's refusals, and the model's: its
    type, a tied head, fewer blocks than stages), or None. Stages of unequal blocks are priced as they are
    (`pipeline_shapes`)."""
    try:
        TrainConfig(**{**cfg.model_dump(), "pipeline_parallel": stages})
    except ValidationError as exc:
        return "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
    if size.model_type not in PP_MODEL_TYPES or size.tied_embeddings or size.blocks < stages:
        return (f"the model ({size.model_type or 'unknown'} type, {size.blocks} blocks"
                f"{', a tied head' if size.tied_embeddings else ''}) does not split into {stages} stages")
    return None


def sharding_for_full(cfg: TrainConfig, n_params: int, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """zero2 unless its whole bf16 weights plus its share of the state (`full_state_bytes`) would take over half of
    a GPU's memory."""
    zero2_bytes = full_state_bytes(cfg, n_params, world_size, whole_weights=True)
    share = f"{zero2_bytes / 2**30:.1f} GiB of weights and state per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if zero2_bytes <= 0.5 * gpu_bytes:
        return "zero2", f"full fine-tuning on {world_size} GPUs, {share}"
    return "zero3", f"full fine-tuning on {world_size} GPUs; zero2 would hold {share}"


def sharding_for_qlora(size: ModelSize, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """Q-LoRA under ddp keeps the whole 4-bit model on every GPU: its block weights in NF4, embeddings and head in
    bf16. Where that would take over half of the smallest GPU (activations and the adapters' state need the rest),
    zero3 shards it over the processes, as zero3 does for full fine-tuning."""
    whole = qlora_bytes(size)
    held = f"{whole / 2**30:.1f} GiB of 4-bit model per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if whole <= 0.5 * gpu_bytes:
        return "ddp", f"Q-LoRA: {held}; only the adapters' gradients are all-reduced"
    return "zero3", (f"Q-LoRA: ddp would hold {held}; zero3 shards it, "
                     f"{whole / world_size / 2**30:.1f} GiB per GPU over {world_size}")


def qlora_bytes(size: ModelSize) -> float:
    """The whole Q-LoRA base: block weights in NF4, embeddings and head in bf16."""
    block_params = size.block_parameters * size.blocks
    return NF4_BYTES * block_params + 2 * (size.parameters - block_params)


def reshard_after_forward(cfg: TrainConfig, parallel: str, shard: int | None, model_size: Callable[[], ModelSize],
                          gpu_bytes: Callable[[], float | None], why: dict[str, str]) -> bool | None:
    """Whether FSDP2 frees each unit's gathered weights after its forward and gathers them again for backward: zero3
    does (least memory), zero2 does not (one gather a micro-step). hsdp gathers inside a node, over its fast links:
    for full fine-tuning it keeps the weights like zero2 where the node's GPUs hold them with the state, else
    reshards like zero3; LoRA and Q-LoRA reshard (their point is memory). Whatever the mode, the last unit, the head
    and the root keep theirs: backward needs them first (model/parallel.py). Weights kept from forward to backward
    also stay whole from one micro-step to the next under gradient accumulation (parallel.py's gradient_sync)."""
    if parallel not in SHARDED:
        return None
    if parallel != "hsdp":
        return parallel == "zero3"
    if cfg.is_lora:
        return True
    card = gpu_bytes()
    keep = ("hsdp, full fine-tuning: each replica's processes keep every unit's weights from forward to backward, "
            "as zero2")
    if card is None:
        why["reshard_after_forward"] = keep
        return False
    n_params = model_size().parameters
    held = full_state_bytes(cfg, n_params, shard, whole_weights=True)
    if held <= 0.5 * card:
        why["reshard_after_forward"] = (f"{keep} ({held / 2**30:.1f} GiB of weights and state per GPU of "
                                        f"{card / 2**30:.0f} GiB)")
        return False
    why["reshard_after_forward"] = (f"hsdp, full fine-tuning: whole weights and state would take {held / 2**30:.1f} "
                                    f"GiB per GPU of {card / 2**30:.0f} GiB; gathered again for backward, as zero3")
    return True


def reshard_to_node(cfg: TrainConfig, parallel: str, reshard: bool | None, procs: DistEnv, model_parallel: int,
                    why: dict[str, str]) -> bool | int | None:
    """`zero3_reshard_to_node`: zero3's units resharded after forward to the processes of one node (FSDP2's
    reshard_after_forward as an int), so that backward gathers them inside the node; the ranks of a node are
    consecutive, which is how FSDP2 groups them."""
    if not cfg.zero3_reshard_to_node:
        return reshard
    per_node = procs.local_world_size
    if parallel != "zero3":
        why["zero3_reshard_to_node"] = (f"{parallel}: not applied; it reshards zero3's units" + (
            " (hsdp gathers inside a node already)" if parallel == "hsdp" else ""))
    elif model_parallel > 1:
        why["zero3_reshard_to_node"] = "not applied under tensor or context parallel: FSDP2 shards over a sub-mesh"
    elif procs.world_size == per_node:
        why["zero3_reshard_to_node"] = "one node: every gather stays inside it already; resharded as zero3"
    elif per_node == 1:
        why["zero3_reshard_to_node"] = "one process a node: a node's share is the process's own; resharded as zero3"
    else:
        why["reshard_after_forward"] = (f"zero3_reshard_to_node: after forward each unit keeps the weights of its "
                                        f"node's {per_node} processes, so backward's all-gathers stay inside the node")
        return per_node
    return reshard


def powersgd_rank(cfg: TrainConfig, parallel: str, world_size: int, why: dict[str, str]) -> int:
    """`powersgd_rank`, where DDP's buckets cross the processes: ddp on several of them."""
    if not cfg.powersgd_rank:
        return 0
    if parallel != "ddp":
        raise ConfigError(f"powersgd_rank: {cfg.powersgd_rank} compresses DDP's gradient buckets; this run is "
                          f"parallel {parallel} (FSDP2 reduce-scatters its own): set parallel: ddp, or drop "
                          f"powersgd_rank")
    if world_size == 1:
        why["powersgd_rank"] = "one process: no gradient crosses processes"
        return 0
    why["powersgd_rank"] = (f"{cfg.powersgd_rank}: DDP's buckets cross as PowerSGD's rank-{cfg.powersgd_rank} "
                            f"factors, with error feedback (approximate)")
    return cfg.powersgd_rank


def gradient_reduction(cfg: TrainConfig, world_size: int, parallel: str, accumulation: int,
                       model_size: Callable[[], ModelSize], gpu_bytes: Callable[[], float | None],
                       why: dict[str, str]) -> str:
    """When gradients cross the processes under gradient accumulation. Once an optimizer step where memory allows:
    each process accumulates its own until the last micro-step (DDP's no_sync; FSDP2 without gradient sync, which
    holds them unsharded in fp32, 4 bytes a trainable parameter). hsdp reduce-scatters inside each replica every
    micro-step (a node's fast links) and all-reduces across the replicas, the slow links, once. zero2 (or zero3)
    full fine-tuning reduce-scatters every micro-step unless the unsharded gradients fit beside its weights and
    state: zero2 unless the GPU is known too small, zero3 only where it is known large enough."""
    if accumulation == 1 or world_size == 1:
        return ONCE
    if parallel == "ddp":
        why["gradient_reduction"] = "ddp: all-reduced on the last micro-step only (no_sync before it)"
        return ONCE
    if parallel == "hsdp":
        why["gradient_reduction"] = ("hsdp: reduce-scattered inside each replica every micro-step, all-reduced "
                                     "across the replicas on the last only")
        return SHARD_EACH
    if cfg.is_lora:
        why["gradient_reduction"] = f"{parallel}: reduced on the last micro-step only (the adapters' gradients)"
        return ONCE
    card = gpu_bytes()
    if card is None:
        once = parallel == "zero2"
        verdict = "no GPU to hold"
    else:
        n_params = model_size().parameters
        held = full_state_bytes(cfg, n_params, world_size, whole_weights=parallel == "zero2", unsharded_grads=True)
        once = held <= 0.5 * card
        verdict = f"{held / 2**30:.1f} GiB per GPU of {card / 2**30:.0f} GiB with unsharded fp32 gradients"
    if once:
        why["gradient_reduction"] = f"{parallel}: reduced on the last micro-step only ({verdict})"
        return ONCE
    why["gradient_reduction"] = f"{parallel}: reduce-scattered every micro-step, so gradients stay sharded ({verdict})"
    return EACH


def offload_reason(is_lora: bool, n_params: int, shards: int, env: DistEnv) -> str:
    """What cpu_offload moves to host memory, and how much of it one node holds: each process keeps its shard
    (1 / `shards` of the model) of the fp32 weights, and for full fine-tuning their gradients and two Adam moments
    too (16 bytes a parameter; LoRA's frozen base 4, its adapters a few MB). The GPU keeps the gathered units and
    the activations only."""
    per_param = 4 if is_lora else 16
    node_bytes = per_param * n_params / shards * env.local_world_size
    size = f"{node_bytes / 2**30:.1f} GiB" if node_bytes >= 2**30 else f"{node_bytes / 2**20:.1f} MiB"
    if env.device.type != "cuda":
        return (f"CPU processes: every tensor is in host memory already (~{size} of shards a node); FSDP2's "
                f"offload path runs unpinned and saves nothing")
    held = "weights" if is_lora else "weights, gradients and optimizer state"
    return (f"FSDP2 CPUOffloadPolicy: the shards' {held} in pinned host memory, ~{size} a node, copied to the GPU "
            f"for each all-gather; the optimizer steps on the CPU")


def hsdp_shard_size(cfg: TrainConfig, env: DistEnv, parallel: str, why: dict[str, str]) -> int | None:
    """hsdp shards each replica over the processes of one node unless told otherwise; the size must divide the job."""
    if parallel != "hsdp":
        return None
    shard = cfg.hsdp_shard_size or env.local_world_size
    if cfg.hsdp_shard_size is None:
        why["hsdp_shard_size"] = "default: the processes of one node"
    if env.world_size % shard:
        raise ConfigError(f"hsdp_shard_size: {shard} does not divide the {env.world_size} processes; use a divisor "
                          f"(by default the processes of one node: {env.local_world_size})")
    return shard


def check_train_batch_size(cfg: TrainConfig, accumulation: int, world_size: int) -> None:
    """`train_batch_size` (DeepSpeed's) is what the user expects the global batch to be: a different one is an error
    before the first step, not a run with another learning dynamic."""
    actual = cfg.per_device_train_batch_size * accumulation * world_size
    if cfg.train_batch_size is not None and cfg.train_batch_size != actual:
        raise ConfigError(
            f"train_batch_size {cfg.train_batch_size} is not the global batch this job makes: "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{accumulation} x {world_size} processes = {actual}; change one of them, or set train_batch_size to "
            f"{actual} (\"auto\" in a DeepSpeed JSON)")


def keep_global_batch(cfg: TrainConfig, manifest: dict | None, world_size: int, why: dict[str, str],
                      configured: int | None = None) -> int:
    """Resuming on another world size: the same global batch (so the same data order and math) through another
    gradient accumulation, or a clear error when no whole number of micro-steps gives it. `configured`: the
    accumulation the plan runs without a checkpoint (default: the config's)."""
    configured = configured or cfg.gradient_accumulation_steps
    saved = (manifest or {}).get("global_batch")
    per_step = cfg.per_device_train_batch_size * world_size
    if not saved or per_step * configured == saved:
        return configured
    if saved % per_step:
        raise ConfigError(
            f"the checkpoint was trained with a global batch of {saved}, which {world_size} processes x "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} cannot make up; choose a process count "
            f"or batch size that divides {saved}, or resume_from_checkpoint: none to start over")
    accumulation = saved // per_step
    why["gradient_accumulation_steps"] = (
        f"resuming on {world_size} processes: gradient_accumulation_steps {configured} -> {accumulation} "
        f"keeps the checkpoint's global batch of {saved}")
    return accumulation
