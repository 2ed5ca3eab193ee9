"""The run plan: every setting the config leaves open (`auto`, or unset) made concrete once, with the reason.

`resolve` reads the config, the processes and their devices, and the checkpoint being resumed. The model builder,
the data plan and the loop read the plan and never an `auto`; the config stays what the user wrote (its hash is
the run's identity across nodes and checkpoints) and is never changed. What only the run itself can find out is
recorded in the plan with its reason (`RunPlan.amended`): the builder turns the fused loss off for a head it cannot
fuse, and the recomputed blocks a `measure` plan leaves open are measured before training. So the plan is logged
once, as one block, after the model is built, and written to output_dir/run_plan.json once the run is accepted,
as the run trains.

`resolve` calls one resolver a concern, in order, each writing its reasons into the plan: the mesh (layout.py, the
link's choice in link.py), the resumed checkpoint's batch (resume.py), precision, the speed levers and their
conflicts (levers.py), memory (memory.py, over the one estimate of a GPU's state), how gradients cross (sync.py),
the reference (reference.py), the pipeline's schedule and stages (pipeline.py) and whether a node's pipelines
start in turn (stagger.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from meshtune.config import TrainConfig
from meshtune.crossing import ModelSize, default_blocks_per_unit
from meshtune.distributed import DistEnv
from meshtune.hardware import bf16_supported, slowest_peak_flops, smallest_gpu_memory, varlen_available
from meshtune.plan.layout import (TP_MODEL_TYPES, context_parallel_size, hsdp_shard_size, resolve_mesh,
                                  tensor_parallel_size)
from meshtune.plan.levers import CONFLICTS, give_way, memory_measurable, recomputation, resolve_levers
from meshtune.plan.link import (LINK_EFFICIENCY, LINK_MARGIN, choose_by_link, link_applies, link_candidates,
                                pick_by_link, pipeline_refusal)
from meshtune.plan.memory import (full_state_bytes, gradient_reduction, offload_reason, reshard_after_forward,
                                  reshard_to_node, resolve_memory, sharding_for_full, sharding_for_qlora)
from meshtune.plan.modes import auto_parallel, choose_parallel, parallel_for
from meshtune.plan.pipeline import (PP_MODEL_TYPES, balanced_stages, head_worth, interleaved_counts, pipeline_choice,
                                    pipeline_parallel_size, pipeline_shapes)
from meshtune.plan.precision import resolve_precision
from meshtune.plan.reference import precompute_reference, reference_reason, resolve_reference
from meshtune.plan.resume import (check_train_batch_size, keep_global_batch, resolve_resume, resume_reason,
                                  resume_request)
from meshtune.plan.run_plan import (EACH, MEASURE, ONCE, SHARD_EACH, SHARDED, Layout, LinkChoice, Machine, RunPlan,
                                    on)
from meshtune.plan.stagger import pipeline_stagger
from meshtune.plan.sync import gradient_crossing, powersgd_rank, resolve_sync

__all__ = [
    "CONFLICTS", "EACH", "LINK_EFFICIENCY", "LINK_MARGIN", "MEASURE", "ONCE", "PP_MODEL_TYPES", "SHARDED", "SHARD_EACH",
    "TP_MODEL_TYPES", "Layout", "LinkChoice", "Machine", "ModelSize", "RunPlan", "auto_parallel", "balanced_stages",
    "check_train_batch_size", "choose_by_link", "choose_parallel", "context_parallel_size", "default_blocks_per_unit",
    "full_state_bytes", "give_way", "gradient_crossing", "gradient_reduction", "head_worth", "hsdp_shard_size",
    "interleaved_counts", "keep_global_batch", "link_applies", "link_candidates", "machine_of", "memory_measurable",
    "offload_reason", "on", "parallel_for", "pick_by_link", "pipeline_choice", "pipeline_parallel_size",
    "pipeline_refusal", "pipeline_shapes", "powersgd_rank", "precompute_reference", "recomputation", "reference_reason",
    "reshard_after_forward", "reshard_to_node", "resolve", "resume_reason", "resume_request", "sharding_for_full",
    "sharding_for_qlora", "tensor_parallel_size",
]


def resolve(cfg: TrainConfig, env: DistEnv, resume_manifest: dict | None,
            model_size: Callable[[], ModelSize], resumed_from: Path | None = None, shared: bool = True) -> RunPlan:
    """The plan of this run, the same on every rank. `model_size` is called only where a choice depends on it
    (full fine-tuning on several GPUs, FSDP2 units); choosing the parallel mode may be a collective. The checkpoint
    resumed (`resumed_from`, found as `resume_request` asked, its manifest `resume_manifest`) and whether output_dir
    is `shared` by all nodes come from the checkpoint manager."""
    why: dict[str, str] = {}
    machine = machine_of(cfg, env, model_size)
    layout = resolve_mesh(cfg, env, machine, why)
    resume = resolve_resume(cfg, env, layout, resume_manifest, resumed_from, shared, why)
    accumulation = resume["gradient_accumulation_steps"]
    precision, levers = resolve_precision(cfg, env, layout.parallel, machine, why), resolve_levers(cfg, env, layout,
                                                                                                   machine, why)
    memory, sync = resolve_memory(cfg, layout, accumulation, machine, why), resolve_sync(cfg, layout, why)
    reference = resolve_reference(cfg, why)
    pipeline = pipeline_choice(cfg, env, layout.pp, layout.parallel, accumulation, machine.model_size, why,
                               layout.link)
    return RunPlan(parallel=layout.parallel, hsdp_shard_size=layout.hsdp_shard, mesh=layout.mesh, **resume,
                   **precision, **levers, **memory, **sync, **reference, **pipeline,
                   **pipeline_stagger(cfg, env, layout, pipeline, accumulation, machine, why), why=why)


def machine_of(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize]) -> Machine:
    """What the resolvers may ask of the model and the devices, each asked here, once, and only when a choice
    needs it: the model without weights is built once; the smallest GPU is a collective, the same on every rank."""
    cuda = env.device.type == "cuda"
    return Machine(model_size=functools.cache(model_size),
                   gpu_bytes=functools.cache(lambda: smallest_gpu_memory(env.device, cfg.gpu_memory_limit)
                                             if cuda else None),
                   peak_flops=functools.cache(lambda: slowest_peak_flops(env.device)),
                   bf16_supported=lambda: bf16_supported(env.device),
                   varlen_available=lambda: varlen_available(env.device),
                   memory_measurable=lambda: memory_measurable(env.device))
