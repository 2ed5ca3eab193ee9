"""Tensor parallelism of the Qwen2 / Qwen3 / Llama / Mistral decoder (transformers' modules) through DTensor's
`parallelize_module`, as torchtitan splits Llama: in each block q / k / v and gate / up are split column-wise
(each process computes its share of the heads and of the MLP's hidden units), o and down row-wise (their partial
outputs reduce-scattered over the positions). Between them the residual stream and the norms are sequence-parallel:
each process holds a share of the positions (so rows are padded to a multiple of the tensor-parallel size). The
embedding is split over the vocabulary, and so is the head: each process keeps its share of the logits, and the
loss is computed across the shares (model/vocab_parallel_loss.py). Attention reads its head counts from the local
q / k / v widths (transformers reshapes with -1), and the query-to-key-value group ratio is the same on every
process, so the attention code runs unchanged on its share of the heads.

LoRA adapters are split to match their base layer, so the adapter's output adds to the base's share exactly:
beside a column-wise base, A is replicated and B column-wise; beside a row-wise base, A row-wise (its partial
product reduce-scattered like the base's) and B replicated, applied to each process's positions
(`PositionShareParallel`).

Every parameter becomes a DTensor on the tensor-parallel mesh, so FSDP2 then shards all of them over the
data-parallel dimensions of one mesh, and the optimizer and gradient clipping see tensors of one mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from meshtune.errors import ModelError
from meshtune.model.loading import transformer_blocks
from meshtune.model.vocab_parallel_loss import VocabShard

COLUMN_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_WISE = ("o_proj", "down_proj")
HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head RMSNorm of queries and keys, applied to the local heads
NORMS = ("input_layernorm", "post_attention_layernorm")


class ReplicateParallel(ParallelStyle):
    """A module every process computes whole on the same whole input (LoRA's A beside a column-wise base): its
    parameters become replicated DTensors, its input is taken as replicated and its output handed on as a plain
    tensor. Its gradients are then the same on every process, as its output's gradient arrives summed (B's
    column-wise input gathers it)."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._replicate, input_fn=self._input,
                                 output_fn=self._output)

    @staticmethod
    def _replicate(name: str, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(key, torch.nn.Parameter(replicated, requires_grad=param.requires_grad))

    @staticmethod
    def _input(module: torch.nn.Module, inputs: Any, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _output(module: torch.nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


class PositionShareParallel(ParallelStyle):
    """A module with replicated weights applied to this process's share of the positions (LoRA's B beside a
    row-wise base, on A's reduce-scattered output: Shard(1) of [batch, positions, rank]). The share reaches the
    module as Shard(0) of [positions, batch, rank]: a linear flattens its input's leading dims, which DTensor allows
    when the first of them is the sharded one (torch before 2.13 refuses a flatten over a sharded second dim). The
    weight's gradient, a partial sum over each process's positions, is summed across them as DTensor's mm gives it;
    the output returns to [batch, positions, out] as a plain tensor, the share the base's output holds."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, partition_fn=ReplicateParallel._replicate,
                                 input_fn=self._input, output_fn=self._output)

    @staticmethod
    def _input(module: torch.nn.Module, inputs: Any, mesh: DeviceMesh) -> tuple:
        share = inputs[0].to_local() if isinstance(inputs[0], DTensor) else inputs[0]
        positions_first = share.transpose(0, 1).contiguous()  # a copy of rank-wide rows: small beside the base's
        return (DTensor.from_local(positions_first, mesh, [Shard(0)], run_check=False), *inputs[1:])

    @staticmethod
    def _output(module: torch.nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local().transpose(0, 1)


def block_plan(block: torch.nn.Module) -> dict[str, ParallelStyle]:
    """How each module of one decoder block is split, by its name in the block; with LoRA (peft's layers hold the
    frozen `base_layer` and the adapters `lora_A.<adapter>`, `lora_B.<adapter>`), the adapters matched to it.

    Sequence parallel between the split layers, as torchtitan: the residual stream and the norms hold a share of
    the positions (Shard(1)); attention and the MLP all-gather their input, and o / down reduce-scatter their
    output back to the shares (together the bytes of the one all-reduce each would take otherwise)."""
    plan: dict[str, ParallelStyle] = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
    }
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in NORMS:
            plan[name] = SequenceParallel()
        elif leaf in HEAD_NORMS:
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)  # input split over heads (dim 2)
        elif leaf in COLUMN_WISE + ROW_WISE:
            column = leaf in COLUMN_WISE
            split = ColwiseParallel() if column else RowwiseParallel(output_layouts=Shard(1))
            if not hasattr(module, "base_layer"):
                plan[name] = split
                continue
            plan[f"{name}.base_layer"] = split
            for adapter in getattr(module, "lora_A", {}):
                # beside a row-wise base, B maps each position of A's reduce-scattered share on its own
                plan[f"{name}.lora_A.{adapter}"] = (ReplicateParallel() if column else
                                                    RowwiseParallel(output_layouts=Shard(1)))
                plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel() if column else PositionShareParallel()
    return plan


def parallelize_model(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model` (bare or peft-wrapped) over `tp_mesh` in place. Each process splits the tensors it holds
    (`src_data_rank=None`: no communication): the same files' values, or nothing yet on the meta device for the
    processes that receive rank 0's weights afterwards. Which parameters train is kept as it was. The model then
    returns this process's share of the logits, and `vocab_shard(model)` says which."""
    trains = {name: p.requires_grad for name, p in model.named_parameters()}
    base = getattr(model, "get_base_model", lambda: model)()
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                       src_data_rank=None)
    # the head gathers the positions and keeps its logits split by vocabulary
    parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Shard(1)), src_data_rank=None)
    _, offset = compute_local_shape_and_global_offset(head.weight.shape, tp_mesh, head.weight.placements)
    model.meshtune_vocab_shard = VocabShard(tp_mesh.get_group(), offset[0])
    parallelize_module(base.model.norm, tp_mesh, SequenceParallel(use_local_output=True), src_data_rank=None)
    blocks = transformer_blocks(model)
    # the embedding's output is whole (the model builds its attention mask from it): the first block takes its share
    parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                              desired_input_layouts=(Shard(1),), use_local_output=True))
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(block), src_data_rank=None)
    for name, param in model.named_parameters():
        param.requires_grad_(trains[name])
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ModelError(f"tensor_parallel does not know how to split {', '.join(plain[:3])}"
                         f"{' ...' if len(plain) > 3 else ''} of {type(base).__name__}; set tensor_parallel: 1")

