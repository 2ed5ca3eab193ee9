"""Data parallelism: DDP, or FSDP2 `fully_shard` per transformer block then the root (ZeRO-2 / ZeRO-3 / HSDP)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import ContextManager

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshtune.distributed import DistEnv
from meshtune.mesh import ParallelDims
from meshtune.model.loading import transformer_blocks
from meshtune.model.tensor_parallel import parallelize_model
from meshtune.plan import EACH, ONCE, SHARD_EACH


class FlatGradientSync:
    """Data parallelism without DDP's wrapper, for small trainable sets such as LoRA adapters: the replicas start
    from rank 0's values, and after the last backward of a step all gradients are averaged by one all-reduce of
    one flat buffer. DDP's per-parameter hooks and bucket copies cost a fifth of a LoRA step even on one GPU
    (measured); hundreds of adapter tensors are a few hundred MB, a few ms over NVLink, not worth overlapping."""

    def __init__(self, model: torch.nn.Module, world_size: int, reduce_dtype: torch.dtype | None = None,
                 in_sync: bool = False, group: dist.ProcessGroup | None = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = world_size
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self.group = group  # None: every process (a pipeline stage's replicas otherwise)
        if in_sync:  # every replica already holds rank 0's values (rank0_weights)
            return
        for group in self._by_dtype([p.data for p in self.params]):
            flat = _flatten_dense_tensors(group)
            dist.broadcast(flat, group=group, group_src=0)
            for tensor, synced in zip(group, _unflatten_dense_tensors(flat, group)):
                tensor.copy_(synced)

    @staticmethod
    def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault(tensor.dtype, []).append(tensor)
        return list(groups.values())

    def __call__(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for grads in self._by_dtype([p.grad for p in self.params]):
            flat = _flatten_dense_tensors(grads)
            sent = flat.to(self.reduce_dtype or flat.dtype)
            sent.div_(self.world_size)  # as DDP: average, dividing before the sum
            dist.all_reduce(sent, group=self.group)
            flat.copy_(sent)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)


def finish_gradient_sync(model: torch.nn.Module) -> None:
    """After the last micro-step's backward: the flat all-reduce, where the model uses one (DDP and FSDP2
    synchronise inside backward)."""
    sync = getattr(model, "meshtune_flat_sync", None)
    if sync is not None:
        sync()


def settle_gradient_buckets(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> None:
    """Before a process's first step: one backward of `loss()` times 0 through DDP, so that every step this process
    takes, the first included, reduces its gradients in the buckets DDP rebuilds after a first backward (in the
    order gradients come). Without it a process's first step sums every gradient in one bucket, later steps in the
    rebuilt ones; across more than two processes a sum's rounding depends on where a gradient sits in its bucket, so
    a resumed run's first step would differ from the same step of a run that went through. The random streams and
    the gradients are left as they were (none)."""
    if not isinstance(model, DistributedDataParallel):
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        (loss() * 0).backward()
    for p in model.parameters():
        p.grad = None


def bf16_allreduce_hook(process_group, bucket):  # no annotations: DDP compares them with its classes, not strings
    """DDP communication hook: the bucket averaged in bf16, then copied back into its fp32 gradients. What torch's
    `bf16_compress_hook` does; DDP accepts that one, by its name, only on NCCL, and gloo sums bf16 too."""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(sent, group=group, async_op=True).get_future()

    def back(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(back)


def powersgd_state(rank: int) -> PowerSGDState:
    """torch's PowerSGD with error feedback and warm start. Its first iteration is DDP's plain all-reduce, as torch
    requires: DDP rebuilds its buckets after the first backward (settle_gradient_buckets' zero backward). A gradient
    that is all zeros (a LoRA A before its B has moved) has a zero factor, which Gram-Schmidt would divide by: the
    epsilon keeps it zero instead of NaN."""
    return PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                         use_error_feedback=True, warm_start=True, random_seed=0, orthogonalization_epsilon=1e-8)


def wrap_model(model: torch.nn.Module, parallel: str, env: DistEnv, bf16: bool,
               dims: ParallelDims | None = None, prefetch: int | None = 1, grad_sync: str | None = "ddp",
               in_sync: bool = False, reduce_bf16: bool = False, blocks_per_unit: int = 1,
               cpu_offload: bool = False, reshard_after_forward: bool | int | None = None,
               bucket_cap_mb: float | None = None, powersgd_rank: int = 0,
               before_shard: Callable[[list[torch.nn.Module]], None] | None = None,
               mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """Apply the data-parallel wrapper: replicas (`replicate`, ddp) or FSDP2 shards (`shard_in_units`, over the
    mesh `sharding_mesh` picks); fp32 master weights stay fp32 in every mode. `in_sync`: every replica already holds
    rank 0's values (rank0_weights), so neither DDP nor the flat sync broadcasts them once more. `reduce_bf16`:
    gradients cross the processes in bf16 (half the bytes), and are summed back into fp32. `dims`: the run's mesh
    (meshtune/mesh.py; None: every process one shard); with a tp dimension above 1 the model is first split over it,
    then FSDP2 shards it over the data-parallel dimensions of the same mesh, as torchtitan composes them; the mode is
    then never ddp. `mesh`: the processes FSDP2 shards over, given (a pipeline stage's), instead of the run's mesh's.
    `cpu_offload`: FSDP2 keeps every shard in host memory (`offload_policy`). The other options are those of
    `replicate` and `shard_in_units`."""
    if parallel == "ddp":
        return replicate(model, env, grad_sync, in_sync, reduce_bf16, bucket_cap_mb, powersgd_rank)
    dims = dims if dims is not None else ParallelDims.of({"dp_shard": env.world_size}, env)
    tensor_parallel = dims.tp > 1
    mesh = sharding_mesh(model, parallel, dims, mesh)
    reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32 if bf16 else None
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
    reshard = parallel in ("zero3", "hsdp") if reshard_after_forward is None else reshard_after_forward
    policies = dict(mesh=mesh, mp_policy=mixed, offload_policy=offload_policy(cpu_offload, env.device))
    # Q-LoRA's loader fills the blocks unit by unit, then the root; tensor parallel splits the edges over tp itself
    edges = before_shard is None and not tensor_parallel
    return shard_in_units(model, policies, reshard, blocks_per_unit, prefetch, edges, before_shard)


def replicate(model: torch.nn.Module, env: DistEnv, grad_sync: str | None, in_sync: bool, reduce_bf16: bool,
              bucket_cap_mb: float | None, powersgd_rank: int) -> torch.nn.Module:
    """ddp: a whole replica on every process, its gradients averaged by DDP or, with `grad_sync: flat`, by one flat
    all-reduce (FlatGradientSync). `powersgd_rank`: DDP's buckets cross as PowerSGD's low-rank factors
    (approximate). `bucket_cap_mb`: DDP's gradient buckets (torch's 25 MB by default)."""
    if env.world_size == 1:
        return model  # nothing to synchronise; DDP's hooks cost a fifth of a LoRA step on one GPU (measured)
    if grad_sync == "flat":
        model.meshtune_flat_sync = FlatGradientSync(model, env.world_size, torch.bfloat16 if reduce_bf16 else None,
                                                    in_sync)
        return model
    # broadcast_buffers off: a decoder's buffers (rotary frequencies) never change, and the broadcast would
    # be one more collective, a wait for the slowest rank, before every forward
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    # frozen tensors of a subclass (Q-LoRA's NF4 weights) are left out: DDP would broadcast and check them as
    # plain tensors; they never train, and every rank quantized the same files itself
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [
        name for name, p in model.named_parameters() if not p.requires_grad and type(p.data) is not torch.Tensor])
    # gradients as views of DDP's buckets: no copy into the buckets after backward, no second gradient buffer
    ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False, init_sync=not in_sync,
                                  gradient_as_bucket_view=True, **({"bucket_cap_mb": bucket_cap_mb}
                                                                   if bucket_cap_mb else {}))
    if reduce_bf16:
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    elif powersgd_rank:
        ddp.register_comm_hook(powersgd_state(powersgd_rank), powerSGD_hook)
    return ddp


def sharding_mesh(model: torch.nn.Module, parallel: str, dims: ParallelDims, given: DeviceMesh | None) -> DeviceMesh:
    """The processes FSDP2 shards over: under tensor parallel the run's dp dimensions, the model split over its tp
    dimension first (model/tensor_parallel.py); else the mesh `given` (a pipeline stage's), or the run's shards
    (`ParallelDims.fsdp_mesh`: hsdp's replicas of shards, inside a node by default)."""
    if dims.tp > 1:
        parallelize_model(model, dims.sub_mesh("tp"))
        return dims.fsdp_mesh(parallel)
    return given if given is not None else dims.fsdp_mesh(parallel)


def shard_in_units(model: torch.nn.Module, policies: dict, reshard: bool | int, blocks_per_unit: int,
                   prefetch: int | None, edges: bool,
                   before_shard: Callable[[list[torch.nn.Module]], None] | None) -> torch.nn.Module:
    """FSDP2 `fully_shard` per unit of blocks then the root, with `policies` (mesh, mixed precision, offload).
    `reshard`: each unit's gathered weights freed after forward (the run plan's choice; by default zero3's and
    hsdp's yes, zero2's no; an int: to that many processes, a node's). `blocks_per_unit`: consecutive transformer
    blocks sharded as one unit (one all-gather and one reduce-scatter for them all). `edges`: the embedding and the
    head units of their own where the model allows (`edge_units`). `before_shard`: called with each unit's blocks,
    then with the model, right before FSDP2 shards them (Q-LoRA's block-by-block loading: only one unit is ever
    whole on the device). `prefetch`: how many units ahead each one gathers."""
    units = fsdp_units(transformer_blocks(model), blocks_per_unit)
    embedding, head = edge_units(model) if edges else (None, None)
    if embedding is not None:
        # used first in forward and last in backward: zero3 frees it in between
        fully_shard(embedding, reshard_after_forward=reshard, **policies)
    for i, unit in enumerate(units):
        if before_shard is not None:
            before_shard(unit)
        # backward starts with the last unit: freeing its weights after forward would only gather them again at once
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard if i < len(units) - 1 else False,
                    **policies)
    if head is not None:
        # its own unit, as torchtitan shards the output layer: its gradient, the first of backward, is reduced
        # while the blocks' backward runs instead of with the root's after the last block
        fully_shard(head, reshard_after_forward=False, **policies)
    if before_shard is not None:
        before_shard([model])
    # the root (the final norm; the embeddings and head where they are not units of their own) is gathered for the
    # whole forward and again from the start of backward to its end: resharding it in between would cost a gather
    # and save nothing, hence FSDP2's own default for a root
    fully_shard(model, reshard_after_forward=False, **policies)
    if prefetch:
        order = [unit[0] for unit in units]
        set_prefetch(order if embedding is None else [embedding, *order, head], prefetch)  # edges: both or neither
    return model


def edge_units(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The input embedding and the output head, each to be sharded as a unit of its own; (None, None) when they
    share one weight (tied embeddings: one tensor can belong to one FSDP2 unit only, the root's) or the model has no
    such modules. For a 152k vocabulary they are a quarter of a 1.5B model's weights."""
    base = getattr(model, "get_base_model", lambda: model)()
    try:
        embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    if embedding is None or head is None:
        return None, None
    embedding_weights = {id(p) for p in embedding.parameters()}
    if any(id(p) in embedding_weights for p in head.parameters()):
        return None, None
    return embedding, head


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload: each shard lives in host memory, is copied to the GPU for its all-gather, its reduced
    gradient is copied back, and the optimizer steps it on the CPU. Pinned on CUDA, so those copies run
    asynchronously; a CPU run has no device memory to pin for (and pinning needs an accelerator)."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def fsdp_units(blocks: list[torch.nn.Module], blocks_per_unit: int) -> list[list[torch.nn.Module]]:
    """Consecutive blocks in groups of `blocks_per_unit` (the last may be shorter). Fewer units mean fewer, larger
    collectives and fewer FSDP hooks on the host per step; a unit's whole parameters are gathered at once."""
    return [blocks[i:i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]


def set_prefetch(blocks: list[torch.nn.Module], depth: int) -> None:
    """Gather the next `depth` blocks' parameters while this one computes (forward), and the previous ones
    (backward): the all-gathers overlap compute instead of waiting for it to reach each block."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


def gradient_sync(model: torch.nn.Module, last: bool, reduction: str, keep_gathered: bool = False) -> ContextManager:
    """Around one micro-step's backward: whether its gradients cross the processes (plan.gradient_reduction).
    `last`: the optimizer step's last micro-step, on which they always do. `keep_gathered` (FSDP2 units that stay
    whole from forward to backward, zero2's): they also stay whole from one micro-step to the next, so only the first
    micro-step of an optimizer step all-gathers the weights; they hold no more than each backward does already."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if last or reduction == EACH else model.no_sync()
    if isinstance(model, FSDPModule):
        if keep_gathered:
            model.set_reshard_after_backward(last)
        if reduction == ONCE:
            model.set_requires_gradient_sync(last)
        elif reduction == SHARD_EACH:  # reduce-scatter inside the replica always; across the replicas once
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(last)
    return nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
