"""The mesh resolver: tensor, context and pipeline parallel checked against the job and the model, the data-parallel
mode (by the link where `link_gbps` applies), hsdp's shard, and the device mesh they make."""

from __future__ import annotations

from collections.abc import Callable

from meshtune.config import TrainConfig
from meshtune.crossing import ModelSize
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.mesh import ParallelDims
from meshtune.plan.link import choose_by_link
from meshtune.plan.modes import choose_parallel
from meshtune.plan.pipeline import PP_MODEL_TYPES, pipeline_parallel_size, refuse_unsplit_model
from meshtune.plan.run_plan import Layout, Machine

TP_MODEL_TYPES = PP_MODEL_TYPES  # the decoder blocks model/tensor_parallel.py splits


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
    refuse_unsplit_model(f"tensor_parallel: {tp}", cfg.model_name_or_path, size, TP_MODEL_TYPES,
                         "the blocks of {} models", "which meshtune does not split; such models are small enough "
                         "for tensor_parallel: 1 with parallel: zero3")
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


def resolve_mesh(cfg: TrainConfig, env: DistEnv, machine: Machine, why: dict[str, str]) -> Layout:
    """The parallel layout of the run: its degrees, the data-parallel mode, hsdp's shard and the device mesh."""
    tp = tensor_parallel_size(cfg, env, machine.model_size)
    cp = context_parallel_size(cfg, env, tp)
    link = choose_by_link(cfg, env, machine.model_size, machine.gpu_bytes, machine.peak_flops, why)
    pp = link.pipeline if link else pipeline_parallel_size(cfg, env, machine.model_size)
    unsplit = ParallelDims.of({"pp": pp, "cp": cp, "tp": tp}, env)  # the data-parallel split waits for the mode
    procs = unsplit.reducing_env()
    parallel = link.mode if link else choose_parallel(cfg, procs, machine.model_size, machine.gpu_bytes, why)
    parallel, replicas_only = mode_in_layout(parallel, tp, pp, why)
    hsdp_shard = 1 if replicas_only else hsdp_shard_size(cfg, procs, parallel, why)
    check_hsdp_shard(cfg, parallel, hsdp_shard, cp)
    return Layout(parallel=parallel, dims=unsplit.split_for(parallel, hsdp_shard), hsdp_shard=hsdp_shard,
                  replicas_only=replicas_only, link=link)


def mode_in_layout(parallel: str, tp: int, pp: int, why: dict[str, str]) -> tuple[str, bool]:
    """The data-parallel mode as the layout runs it, and whether it holds whole replicas only: auto's hsdp is zero2
    inside a pipeline's stages; ddp under tensor_parallel is FSDP2 over whole replicas (DDP takes no DTensor
    parameters)."""
    if pp > 1 and parallel == "hsdp":  # auto across nodes: the stages are across the nodes already
        parallel = "zero2"
        why["parallel"] = ("auto under pipeline_parallel: the stages lie across the nodes, and zero2 shards each "
                           "stage over its processes")
    if not (tp > 1 and parallel == "ddp"):
        return parallel, False
    why["parallel"] = (f"{why['parallel']}; " if "parallel" in why else "") + (
        "ddp under tensor_parallel: FSDP2 over the dp_replicate dimension, every replica whole (dp_shard 1), "
        "its gradients all-reduced")
    return "hsdp", True


def check_hsdp_shard(cfg: TrainConfig, parallel: str, shard: int | None, cp: int) -> None:
    """hsdp's shard against context parallel and Q-LoRA."""
    if cp > 1 and parallel == "hsdp" and shard % cp:
        raise ConfigError(f"context_parallel: {cp} does not divide hsdp_shard_size {shard}: a cp group's "
                          f"processes shard one replica together; set hsdp_shard_size to a multiple of {cp}")
    if cfg.finetuning_type == "qlora" and parallel == "hsdp" and shard == 1:
        raise ConfigError("parallel: hsdp with a shard of 1 process shards nothing, and torchao's NF4 weights cannot "
                          "be sharded over one: for qlora set hsdp_shard_size above 1, or parallel: ddp")
