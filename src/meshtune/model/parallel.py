"""Data parallelism: DDP, or FSDP2 `fully_shard` per transformer block then the root (ZeRO-2 / ZeRO-3 / HSDP)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers, found by the class names HF models list in `_no_split_modules`."""
    base = getattr(model, "get_base_model", lambda: model)()
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise RuntimeError(f"cannot find the transformer blocks of {type(base).__name__} to shard")
    return blocks


class FlatGradientSync:
    """Data parallelism without DDP's wrapper, for small trainable sets such as LoRA adapters: the replicas start
    from rank 0's values, and after the last backward of a step all gradients are averaged by one all-reduce of
    one flat buffer. DDP's per-parameter hooks and bucket copies cost a fifth of a LoRA step even on one GPU
    (measured); hundreds of adapter tensors are a few hundred MB, a few ms over NVLink, not worth overlapping."""

    def __init__(self, model: torch.nn.Module, world_size: int, reduce_dtype: torch.dtype | None = None,
                 in_sync: bool = False):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = world_size
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        if in_sync:  # every replica already holds rank 0's values (rank0_weights)
            return
        for group in self._by_dtype([p.data for p in self.params]):
            flat = _flatten_dense_tensors(group)
            dist.broadcast(flat, src=0)
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
            dist.all_reduce(sent)
            flat.copy_(sent)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)


def finish_gradient_sync(model: torch.nn.Module) -> None:
    """After the last micro-step's backward: the flat all-reduce, where the model uses one (DDP and FSDP2
    synchronise inside backward)."""
    sync = getattr(model, "meshtune_flat_sync", None)
    if sync is not None:
        sync()


def choose_parallel(requested: str, is_lora: bool, env: DistEnv, count_parameters: Callable[[], int]
                    ) -> tuple[str, str]:
    """`parallel: auto` made concrete, with the reason, the same on every rank; other values pass through.

    LoRA trains a few million parameters: ddp all-reduces only theirs and keeps the frozen base in bf16. Full
    fine-tuning on several GPUs: zero2 reduce-scatters the gradients and steps the optimizer on a shard, measured
    20% faster than ddp on 4 H100s (full 1.5B, docs/benchmarks.md) at a third of its peak memory. zero2 keeps
    every block's bf16 weights whole from forward to backward; where those plus its 16-byte-per-parameter share of
    the fp32 state would take over half the smallest GPU, zero3 (reshard after forward) leaves room for activations.
    """
    if requested != "auto":
        return requested, ""
    if is_lora:
        return "ddp", "LoRA: only the adapters' gradients are all-reduced"
    if env.world_size == 1:
        return "ddp", "one process"
    if env.device.type != "cuda":
        return "ddp", "CPU processes"
    smallest = torch.tensor([torch.cuda.get_device_properties(env.device).total_memory], dtype=torch.float64,
                            device=env.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)  # one choice for nodes with different GPUs
    return sharding_for_full(count_parameters(), env.world_size, smallest.item())


def sharding_for_full(n_params: int, world_size: int, gpu_bytes: float) -> tuple[str, str]:
    """zero2 unless its whole bf16 weights plus its share of the fp32 state (16 bytes a parameter: weights,
    gradients, two Adam moments) would take over half of a GPU's memory."""
    zero2_bytes = 2 * n_params + 16 * n_params / world_size
    share = f"{zero2_bytes / 2**30:.1f} GiB of weights and state per GPU of {gpu_bytes / 2**30:.0f} GiB"
    if zero2_bytes <= 0.5 * gpu_bytes:
        return "zero2", f"full fine-tuning on {world_size} GPUs, {share}"
    return "zero3", f"full fine-tuning on {world_size} GPUs; zero2 would hold {share}"


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


def wrap_model(model: torch.nn.Module, parallel: str, env: DistEnv, bf16: bool,
               hsdp_shard_size: int | None = None, prefetch: int = 1, grad_sync: str = "ddp",
               in_sync: bool = False, reduce_bf16: bool = False, blocks_per_unit: int | None = 1) -> torch.nn.Module:
    """Apply the data-parallel wrapper; fp32 master weights stay fp32 in every mode. `in_sync`: every replica
    already holds rank 0's values (rank0_weights), so neither DDP nor the flat sync broadcasts them once more. `reduce_bf16`:
    gradients cross the processes in bf16 (half the bytes), and are summed back into fp32. `blocks_per_unit`:
    consecutive transformer blocks sharded as one FSDP2 unit (one all-gather and one reduce-scatter for them all);
    None: `default_blocks_per_unit`."""
    if parallel == "ddp":
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
        ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False, init_sync=not in_sync)
        if reduce_bf16:
            ddp.register_comm_hook(None, bf16_allreduce_hook)
        return ddp
    reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32 if bf16 else None
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
    reshard = parallel in ("zero3", "hsdp")
    mesh = data_parallel_mesh(parallel, env, hsdp_shard_size)
    blocks = transformer_blocks(model)
    units = fsdp_units(blocks, blocks_per_unit or default_blocks_per_unit(blocks))
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed)
    if prefetch:
        set_prefetch([unit[0] for unit in units], prefetch)
    return model


UNIT_PARAMS = 1_000_000_000  # a unit's parameters, at most; 4 blocks of Qwen2.5-7B (0.93B) were measured
MAX_BLOCKS_PER_UNIT = 4       # the largest unit measured (1.5B and 7B); larger ones are unmeasured


def default_blocks_per_unit(blocks: list[torch.nn.Module]) -> int:
    """Blocks per FSDP2 unit when the config leaves it open. On 4 H100s, 4 blocks a unit were 39% faster than 1 on
    full 1.5B (zero2) and 30% on full 7B (zero3): each unit's hooks and collectives cost host time, and the
    ranks wait for the slowest host at every collective. The cap keeps what zero3 gathers at once (a unit, and
    the next one prefetched) small beside the GPU: 72B's 0.9B-parameter blocks stay one a unit."""
    if not blocks:
        return 1
    per_block = max(sum(p.numel() for p in blocks[0].parameters()), 1)
    return max(1, min(MAX_BLOCKS_PER_UNIT, UNIT_PARAMS // per_block))


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


def data_parallel_mesh(parallel: str, env: DistEnv, hsdp_shard_size: int | None) -> DeviceMesh:
    """1-D mesh over all ranks (zero2 / zero3), or 2-D (replicate, shard) for hsdp: parameters are sharded
    inside a node, over its fast links, and each node holds a full replica, so only gradient all-reduces cross
    the slower network between nodes."""
    device_type = env.device.type
    if parallel != "hsdp":
        return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("shard",))
    shard = hsdp_shard_size or env.local_world_size
    if env.world_size % shard:
        raise ConfigError(f"hsdp_shard_size: {shard} does not divide the {env.world_size} processes; use a divisor "
                          f"(by default the processes of one node: {env.local_world_size})")
    return init_device_mesh(device_type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def gradient_sync(model: torch.nn.Module, sync: bool) -> ContextManager:
    """Skip the gradient all-reduce on all but the last micro-step of an optimizer step."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
