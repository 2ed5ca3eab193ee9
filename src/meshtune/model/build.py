"""The model a run trains, built in one fixed order: each step relies on the ones before it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.mesh import ParallelDims
from meshtune.model.attention import use_varlen
from meshtune.model.block_loading import BlockLoader
from meshtune.model.compile import compile_blocks
from meshtune.model.counter_dropout import use_counter_dropout
from meshtune.model.context_parallel import use_context_parallel_attention
from meshtune.model.flops import FlopCounter
from meshtune.model.loading import load_model, model_skeleton
from meshtune.model.lora import add_lora, set_adapter, starting_adapter
from meshtune.model.loss_head import install_loss_head, output_head
from meshtune.model.parallel import FlatGradientSync, wrap_model
from meshtune.model.pipeline_parallel import StageForward, held_blocks, held_stages, keep_stages, stage_forwards
from meshtune.model.rank0_weights import check_same_model, full_state, receive_replicated, receive_shards
from meshtune.model.recompute import enable_checkpointing
from meshtune.plan import MEASURE, RunPlan

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    model: torch.nn.Module  # inside its data-parallel wrapper (DDP, FSDP2, the flat sync, or none on one process)
    flops: FlopCounter      # FLOPs a batch needs, counted on the model as loaded
    plan: RunPlan           # the plan it was built to: what the model could not do turned off, with the reason
    pipeline: DeviceMesh | None = None  # pipeline_parallel's (pp, dp) mesh; the model is then this process's stage
    # what the pipeline schedule runs: the forward of each stage this process holds (one: FSDP2's root)
    stages: list[StageForward] | None = None
    held: list[int] | None = None  # the stage of each, of the pipeline's len(plan.pipeline_stages)


def build_model(cfg: TrainConfig, plan: RunPlan, env: DistEnv, dims: ParallelDims) -> BuiltModel:
    """`dims`: the run's mesh (plan.dims), whose device meshes are built once, on first use, for the whole run."""
    model_dir = Path(cfg.model_name_or_path).expanduser()
    # rank 0 reads the files; the others build the same modules on the meta device (no memory, no reads).
    # Q-LoRA: every process starts empty and reads the files block by block as it quantizes (data_parallel)
    reads_files = env.is_main or not plan.weights_from_rank0
    empty = cfg.finetuning_type == "qlora" or not reads_files
    model = model_skeleton(model_dir, plan.load_dtype) if empty else load_model(model_dir, plan.load_dtype)
    flops = FlopCounter.of(model)  # before LoRA adds parameters and FSDP2 shards them
    if plan.padding_free:
        use_varlen(model)  # before compile: the blocks are traced with the attention they will run
    if plan.context_parallel > 1:
        use_context_parallel_attention(model)  # causal, no mask: what the ring attention takes
    # the model's own head, before peft wraps it: same weight, same state-dict keys
    plan = fuse_loss_into_head(model, cfg, plan)
    torch.manual_seed(cfg.seed)  # every rank draws the same LoRA A matrices, whatever the layout
    if cfg.is_lora:
        model = add_lora(model, cfg)
        if plan.lora_dropout_masks == "counter":
            use_counter_dropout(model)  # before checkpointing: the blocks then draw nothing inside their forward
    # continuing an adapter: its weights replace the new ones where the files are read (the others receive them
    # with the base's); Q-LoRA's empty adapters take them as each block is filled
    start = starting_adapter(model, cfg) if cfg.adapter_name_or_path and reads_files else None
    if start and not empty:
        set_adapter(model, start)
    if start:
        logger.info(f"LoRA continues the adapter in {cfg.adapter_name_or_path} ({len(start)} weights, "
                    f"r {cfg.lora_rank})")
    # Q-LoRA's NF4 comes after LoRA (its frozen base layers only), as each block is filled: in data_parallel
    if plan.recompute:
        # measured: every block until the steps measured before training choose (train/memory_fit.py)
        # before compile: the recompute runs the compiled block
        enable_checkpointing(model, 1.0 if plan.recompute == MEASURE else plan.recompute)
    if plan.compile:
        # before the wrapper: DDP's and FSDP2's hooks stay outside the compiled graphs
        compile_blocks(model, cfg.activation_memory_budget, cfg.compile_combo_kernels)
    model.config.use_cache = False  # training never reads a key-value cache
    if plan.pipeline_parallel > 1:
        mesh, held, forwards = pipeline_stages(model, cfg, plan, env, dims, start)
        return BuiltModel(model, flops, plan, pipeline=mesh, stages=forwards, held=held)
    loader = None
    if cfg.finetuning_type == "qlora":
        loader = BlockLoader(model, model_dir, env.device, cfg.seed, nf4_shards(plan, dims), start)
    wrapped = data_parallel(model, cfg, plan, env, dims, loader)
    if loader is not None:
        loader.close()
        logger.info(loader.describe(wrapped))
    return BuiltModel(wrapped, flops, plan)


def pipeline_stages(model: torch.nn.Module, cfg: TrainConfig, plan: RunPlan, env: DistEnv, dims: ParallelDims,
                    adapter: dict[str, torch.Tensor] | None) -> tuple[DeviceMesh, list[int], list[StageForward]]:
    """The model cut down to this process's pipeline stages, on its device, the stages it holds and the forward of
    each the schedule runs. A stage's processes (the mesh's dp dimension) are its replicas, averaging their
    gradients in one flat all-reduce after the schedule's last backward (ddp), or shard it with FSDP2 (zero2 / zero3;
    each stage's forward a root, as the schedule calls it, so torch's stage turns the reduce-scatter off but for the
    last micro-batch). Every process read the same files and drew the same LoRA
    weights, so they start equal. Q-LoRA: each process built the model empty and reads, quantizes (and shards) only
    its stages' blocks, block by block; `adapter`, the one it continues."""
    mesh = dims.pipeline_mesh()
    held = held_stages(mesh.get_local_rank("pp"), plan.pipeline_parallel, plan.pipeline_virtual_stages,
                       plan.pipeline_schedule)
    last = len(plan.pipeline_stages) - 1
    keep_stages(model, [plan.pipeline_stages[s] for s in held], first=0 in held, last=last in held)
    forwards = stage_forwards(model, held, plan.pipeline_stages)
    replicas = mesh["dp"].size()
    sharded = plan.parallel != "ddp" and replicas > 1
    loader = None
    if cfg.finetuning_type == "qlora":
        loader = BlockLoader(model, Path(cfg.model_name_or_path).expanduser(), env.device, cfg.seed,
                             replicas if sharded else 1, adapter, blocks=held_blocks(model))
    if sharded:
        # the loader knows the model by its own names: a stage's forward, an FSDP2 root, stands for it
        fill = None if loader is None else lambda modules: loader([model if m in forwards else m for m in modules])
        for forward in forwards:  # each stage its own FSDP2 root, as torchtitan shards each model part
            wrap_model(forward, plan.parallel, env, plan.bf16, prefetch=plan.fsdp_prefetch,
                       reduce_bf16=plan.grad_reduce_dtype == "bf16", blocks_per_unit=plan.blocks_per_unit or 1,
                       reshard_after_forward=plan.reshard_after_forward, dims=dims, mesh=mesh["dp"],
                       before_shard=fill)
    else:
        if loader is not None:
            loader.load_all(model)  # on the device, block by block
        else:
            model.to(env.device)
        if replicas > 1:
            model.meshtune_flat_sync = FlatGradientSync(model, replicas, torch.bfloat16 if plan.grad_reduce_dtype ==
                                                        "bf16" else None, in_sync=True, group=mesh["dp"].get_group())
    if loader is not None:
        loader.close()
        if held_blocks(model):  # else its stages are the embedding and the head alone: nothing to quantize
            logger.info(loader.describe(model))
    return mesh, held, forwards


def nf4_shards(plan: RunPlan, dims: ParallelDims) -> int:
    """The processes FSDP2 splits each weight over: all of them (zero2 / zero3), one replica's (hsdp), none (ddp);
    a cp group's among them (tensor parallel, whose tp dimension FSDP2 leaves out, is refused for qlora)."""
    return dims.dp_shard * dims.cp if plan.parallel != "ddp" else 1


def data_parallel(model: torch.nn.Module, cfg: TrainConfig, plan: RunPlan, env: DistEnv, dims: ParallelDims,
                  loader: BlockLoader | None) -> torch.nn.Module:
    """The model on this process's device inside its data-parallel wrapper, holding rank 0's weights where the
    other ranks built it empty: ddp receives them whole before DDP wraps it; FSDP2 moves each unit to the GPU as it
    shards it (the whole model is never on one GPU; with cpu_offload each shard then goes to host memory), then every
    rank receives its shard. Q-LoRA (`loader`): every process fills its empty model from the files block by block,
    each block quantized, and under FSDP2 sharded, before the next is read."""
    if plan.weights_from_rank0:
        check_same_model(model, env)  # the empty models match rank 0's tensor for tensor, or the broadcast would hang
    wrap = dict(parallel=plan.parallel, env=env, bf16=plan.bf16, dims=dims,
                prefetch=plan.fsdp_prefetch, grad_sync=plan.grad_sync, reduce_bf16=plan.grad_reduce_dtype == "bf16",
                blocks_per_unit=plan.blocks_per_unit or 1, cpu_offload=plan.cpu_offload,
                reshard_after_forward=plan.reshard_after_forward, bucket_cap_mb=cfg.ddp_bucket_cap_mb,
                powersgd_rank=plan.powersgd_rank)
    if plan.parallel == "ddp":
        if loader is not None:
            loader.load_all(model)
        elif plan.weights_from_rank0:
            receive_replicated(model, env)
        else:
            model.to(env.device)
        return wrap_model(model, in_sync=plan.weights_from_rank0 or loader is not None, **wrap)
    state = full_state(model, env) if plan.weights_from_rank0 else None  # taken before sharding moves the parameters
    model = wrap_model(model, before_shard=loader, **wrap)
    if state is not None:
        receive_shards(model, state, env, plan.cpu_offload)
    return model


def fuse_loss_into_head(model: torch.nn.Module, cfg: TrainConfig, plan: RunPlan) -> RunPlan:
    """The output head computes the loss (LossHead) where the plan asks for the fused loss and the head allows it;
    where it does not, the plan amended: fused_loss off, and why."""
    if not plan.fused_loss:
        return plan
    reason = head_adapted(model, cfg)
    if reason is None and install_loss_head(model, plan.compile):
        return plan
    if reason is None:
        head = output_head(model)
        biased = " with a bias" if getattr(head, "bias", None) is not None else ""
        reason = (f"the output head is a {type(head).__name__}{biased}, not the bias-free linear layer whose loss is "
                  f"computed in chunks")
    logger.info(f"fused_loss: off, {reason}")
    return plan.amended("fused_loss", reason, fused_loss=False)


def head_adapted(model: torch.nn.Module, cfg: TrainConfig) -> str | None:
    """Why the head cannot fuse the loss where LoRA adapts it (lora_target names it): peft adds the adapter's
    logits to the head's output, so the head must return logits, not the fused loss; the plain loss path trains
    it. None where LoRA leaves the head alone."""
    head = output_head(model)
    name = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head), None)
    if not cfg.is_lora or name not in cfg.lora_target:
        return None
    return f"lora_target adapts the output head ({name}), whose logits the loss then needs"
