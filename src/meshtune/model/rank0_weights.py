"""Weights read once per job: global rank 0 loads the model files, every other process builds the same model on
the meta device (no memory, no file reads), and rank 0's values reach them over the process group.

Otherwise each process holds the whole fp32 model in host memory while it starts: 8 processes of a 7B model take
240 GB of one node's memory, and a 70B model cannot start at all. Under FSDP2 the receiving ranks keep only their
shard (torch's `set_model_state_dict` with `broadcast_from_rank0`), so no GPU holds the whole model either.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from meshtune.distributed import DistEnv
from meshtune.errors import ModelError


def structure(model: torch.nn.Module) -> list[tuple[str, tuple, str]]:
    """Every parameter and buffer by name, shape and dtype, in the order all ranks walk them."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def check_same_model(model: torch.nn.Module, env: DistEnv) -> None:
    """The empty models must match rank 0's loaded one tensor for tensor, or the broadcast would pair the wrong
    tensors (or wait forever): compare a digest, and name the first difference."""
    mine = structure(model)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests: list = [None] * env.world_size
    dist.all_gather_object(digests, digest)
    differing = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if not differing:
        return
    reference = [mine if env.is_main else None]
    dist.broadcast_object_list(reference, src=0)
    difference = next((f": {a[0]} is {list(a[1])} {a[2]} on rank 0, {b[0]} {list(b[1])} {b[2]} on rank {env.rank}"
                       for a, b in zip(reference[0], mine) if a != b), "")
    if not difference and len(mine) != len(reference[0]):
        difference = f": {len(reference[0])} tensors on rank 0, {len(mine)} on rank {env.rank}"
    raise ModelError(f"the model built without weights on rank(s) {', '.join(map(str, differing))} differs from the "
                     f"one rank 0 loaded{difference}. Set load_weights_on: every_rank to have each process read the "
                     f"files itself")


def full_state(model: torch.nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Rank 0's whole state dict, taken before sharding (its tensors keep the values once FSDP2 moves the
    parameters); the other ranks contribute nothing."""
    return dict(model.state_dict()) if env.is_main else {}


def receive_replicated(model: torch.nn.Module, env: DistEnv) -> None:
    """ddp: every rank holds the whole model. The empty ones get device memory, then every parameter and buffer
    comes from rank 0 (DDP's own start-up broadcast skips buffers, such as the rotary frequencies, when it does
    not broadcast them every step)."""
    if env.is_main:
        model.to(env.device)
    else:
        empty_on_device(model, env.device)
    _broadcast_from_rank0([*model.parameters(), *model.buffers()])


def receive_shards(model: torch.nn.Module, state: dict[str, torch.Tensor], env: DistEnv,
                   cpu_offload: bool = False) -> None:
    """zero2 / zero3 / hsdp, after fully_shard: each rank takes its shard of rank 0's tensors, then the buffers
    (which FSDP2 does not shard, and which non-persistent ones the state dict leaves out). With cpu_offload the
    shards stay in host memory, where FSDP2 requires them: the empty models get host memory, the broadcast copies
    into the shards in place, and the buffers (on the host meanwhile: the state dict's tensors must share one
    device) go back to the device."""
    home = torch.device("cpu") if cpu_offload else env.device
    if env.is_main:
        buffers_to(model, home)
    else:
        empty_on_device(model, home)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    buffers_to(model, env.device)
    _broadcast_from_rank0(list(model.buffers()))


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Every buffer moved to `device` in place, as fully_shard moves them; the parameters stay where they are."""
    for buffer in model.buffers():
        buffer.data = buffer.data.to(device)


def empty_on_device(model: torch.nn.Module, device: torch.device) -> None:
    """`to_empty`, keeping tied parameters tied (input and output embeddings of the small Qwen2.5 models): moving
    off the meta device makes a new Parameter per name, which would leave this rank with one tensor more than
    rank 0 and the output head no longer the embedding."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for first, *others in (group for group in names.values() if len(group) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)


def _broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)
