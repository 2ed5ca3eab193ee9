"""torch.compile of the transformer blocks: one graph that every layer reuses, for every sample length."""

from __future__ import annotations

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from meshtune.model.loading import transformer_blocks


def keep_one_graph_for_all_lengths() -> None:
    """Inductor's mix-order reduction (the fused RMSNorm backward that computes the input and weight gradients in one
    kernel, GPU only) decides whether to fuse by the token count with guards: >= 4096 rows, >= 5 MiB, rows >= 2 x
    hidden. Where the norm weights train (full fine-tuning), a step whose token count lands on the other side of one
    of these recompiles the blocks, and the layers' shared frame can reach dynamo's recompile limit and run
    uncompiled from then on. Non-strict mode skips those checks, so no guard is added; the fusion stays."""
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    # one frame serves every layer: checkpointed forward, recompute, plain forward and eval are separate entries
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 32))


def trace_checkpoints_with_balanced_side_effects() -> None:
    """A block that checkpoints inside its forward (model/recompute.py) is traced with the checkpoint as one
    operator, which dynamo refuses where the forward mutates Python state outside it: transformers >= 5.2x's layers
    set and reset a context variable of the `kernels` package around their hub kernels, so the whole block would
    run uncompiled. The mutation is undone within the same forward, so not replaying it in the recompute changes
    nothing."""
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def take_module_floats_as_constants() -> None:
    """Dynamo traces a module's float attributes (RMSNorm's eps, peft's scaling, a dropout's p, attention's scale)
    as 0-dimensional tensor inputs of the graph by default: a tensor built on the host for each of them at every
    call of a block, and arithmetic on them that the compiler's partitioner does not count as part of the block's
    checkpoint. A recomputed block with counter dropout masks so saved its dropped inputs for backward (their
    product with 1 / (1 - p)) instead of recomputing them (on the CPU: tests/test_counter_dropout.py; a GPU step's
    peak did not move with the change). As constants they are guarded on their values, which every layer of a model
    shares: one graph still serves all blocks."""
    torch._dynamo.config.specialize_float = True


def compile_blocks(model: torch.nn.Module, activation_memory_budget: float = 1.0, combo_kernels: bool = False) -> None:
    """torch.compile each transformer block in place (one graph reused by every layer; sample lengths vary,
    so shapes are marked dynamic from the start instead of recompiling).

    Dynamo's DDPOptimizer is switched off: under DDP's forward it would cut every block's graph at DDP's bucket
    boundaries (25 MB, the first 1 MB) and compile the pieces apart. A block is already a natural bucket
    boundary: its backward returns all its gradients at once, and DDP all-reduces them while earlier blocks
    run their backward.

    `activation_memory_budget` < 1: the compiler keeps at most that share of each block's activations for
    backward and recomputes the rest inside the block's backward graph, choosing operators by their estimated
    time per byte freed.

    `combo_kernels`: inductor launches independent pointwise kernels of a graph as one (on GPUs; each launch costs
    the host 10-20 us, and a LoRA block casts each of its 14 adapter weights on its own)."""
    torch._dynamo.config.optimize_ddp = False
    keep_one_graph_for_all_lengths()
    trace_checkpoints_with_balanced_side_effects()
    take_module_floats_as_constants()
    # read when a graph's backward is partitioned: 1 keeps what the min-cut partitioner keeps by default
    # (it already recomputes cheap pointwise operators); lower, it solves for the least recompute time that fits
    functorch_config.activation_memory_budget = activation_memory_budget
    inductor_config.combo_kernels = combo_kernels
    for block in transformer_blocks(model):
        block.compile(dynamic=True)
