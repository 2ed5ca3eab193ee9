"""The plan's record: `RunPlan`, every concrete choice the run trains with and the reason for each, and `Machine`,
what the resolvers ask of the model and the devices."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from meshtune.crossing import ModelSize
from meshtune.distributed import DistEnv
from meshtune.mesh import ParallelDims

PIPELINE_KEYS = {"pipeline_schedule": "auto", "pipeline_virtual_stages": None, "pipeline_row_micro_batches": None,
                 "pipeline_stagger": "auto"}  # the keys that shape a pipeline, and their unset values

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
    # a node's pipelines (a stage's data-parallel replicas there) started in turn: each training step, this process
    # waits its pipeline's turn x one micro-batch's activations at this rate (bytes/s) before its first action; 0: in
    # step (meshtune.shared_link)
    pipeline_stagger_rate: float = 0.0
    # stage: dpo: the reference's log-probs computed once before training (train/reference_pass.py)
    precompute_ref_log_probs: bool = False
    # LoRA's dropout masks: torch | counter (model/counter_dropout.py); None: no dropout
    lora_dropout_masks: str | None = None

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
        """The mesh this plan lays out, as `env`'s process sees it: which ranks share its data, its groups. The loop
        makes one a run (its device meshes are built once, on first use); elsewhere it answers questions only."""
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
        if "lora_dropout_masks" in self.why:  # LoRA's dropout in recomputed compiled blocks
            rows.append(("lora_dropout_masks", self.lora_dropout_masks))
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
            if "pipeline_stagger" in self.why:
                rows.append(("pipeline_stagger", on(bool(self.pipeline_stagger_rate))))
        else:  # a pipeline's keys the config sets without a pipeline
            rows += [(key, "not used") for key in PIPELINE_KEYS if key in self.why]
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


@dataclass(frozen=True)
class Machine:
    """What the plan asks of the model and the devices, each asked once and only where a choice needs it: the model's
    size (a model built without weights), the job's smallest GPU (a collective, the same on every rank; None on CPU),
    the slowest GPU's measured bf16 matmul rate, and what the device can do."""

    model_size: Callable[[], ModelSize]
    gpu_bytes: Callable[[], float | None]
    peak_flops: Callable[[], float | None]
    bf16_supported: Callable[[], bool]
    varlen_available: Callable[[], bool]
    memory_measurable: Callable[[], bool]


@dataclass(frozen=True)
class LinkChoice:
    """`parallel: auto` chosen by the link (`link_gbps`): the data-parallel mode (inside each stage under a
    pipeline) and the pipeline's stages across the nodes (1: none)."""

    mode: str
    pipeline: int
    schedule: str | None = None  # the pipeline's schedule, and each row a micro-batch of it (`pipeline_shapes`)
    one_row: bool = False
    # a node's pipelines started a hop apart (meshtune.shared_link): how it was priced, not which choice it is
    stagger: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Layout:
    """The parallel layout the mesh resolver chose, which every later resolver reads: the degrees as one
    `ParallelDims`, whose answers size the job."""

    parallel: str                # ddp | zero2 | zero3 | hsdp, as the data-parallel wrapper runs it
    dims: ParallelDims           # pp x dp_replicate x dp_shard x cp x tp, as this process sees them
    hsdp_shard: int | None
    replicas_only: bool          # ddp under tensor_parallel, run as FSDP2 replicas (a shard of one process)
    link: LinkChoice | None      # auto chosen by the link, or None

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def model_parallel(self) -> int:
        return self.dims.model_parallel

    @property
    def mesh(self) -> dict[str, int]:
        return self.dims.layout

    @property
    def procs(self) -> DistEnv:
        """The processes the data-parallel wrapper reduces gradients over (and FSDP2 shards over): a tensor-parallel
        group counts as one; a cp group's processes each hold partial gradients, so they count, as torchtitan's
        dp_shard x cp; under pipeline_parallel, one stage's processes."""
        return self.dims.reducing_env()

    @property
    def dp(self) -> DistEnv:
        """The data's ranks: a cp x tp group takes the same micro-batches."""
        return self.dims.data_env()
