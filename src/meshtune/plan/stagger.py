"""pipeline_stagger_rate: whether a node's pipelines start in turn (meshtune.shared_link), priced by the link.

Under a pipeline across nodes with data parallelism inside each stage, a node's processes are that many pipelines,
each sending its own activations over the node's one link. Where the plan knows the link (`link_gbps`) it prices
the step with the pipelines in step and started a hop apart, over the run's own schedule and stages, and staggers
them where that is shorter (on GPUs: on CPU nodes gloo's sends share the cores that compute, and the stagger
measured slower there, so only pipeline_stagger: true staggers them). The run then waits, each training step, its
pipeline's turn x one micro-batch's activations at the link's rate before its first action
(train/pipeline_step.py). Timing only: nothing a step trains on changes."""

from __future__ import annotations

from meshtune.config import TrainConfig
from meshtune.crossing import full_model_facts, hop_seconds, pipeline_step, step_collectives
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.plan.link import bf16_on_link, compute_seconds_of, link_busbw, stagger_asked
from meshtune.plan.pipeline import pipeline_shape
from meshtune.plan.run_plan import Layout, Machine
from meshtune.shared_link import priced_pipeline


def pipeline_stagger(cfg: TrainConfig, env: DistEnv, layout: Layout, pipeline: dict, accumulation: int,
                     machine: Machine, why: dict[str, str]) -> dict:
    """{"pipeline_stagger_rate": bytes/s} where a node's pipelines start in turn (see the module's docstring): as
    pipeline_stagger asks, or under auto where that is predicted shorter; the reason under pipeline_stagger; {}
    without a pipeline. `pipeline`: the schedule's fields pipeline_choice chose; `accumulation`: the plan's
    micro-steps."""
    if layout.pp == 1:
        return {}
    nodes = env.world_size // max(env.local_world_size, 1)
    pipelines = layout.dp.local_world_size  # a stage's data ranks on one node
    asked = cfg.pipeline_stagger
    if asked is False:
        why["pipeline_stagger"] = "off: pipeline_stagger: false"
        return {}
    if needless := stagger_needless(nodes, pipelines):
        why["pipeline_stagger"] = f"{'not used' if asked is True else 'off'}: {needless}"
        return {}
    if refused := stagger_refusal(cfg, layout.parallel):
        if asked is True:
            raise ConfigError(f"pipeline_stagger: true: {refused}; or set pipeline_stagger: auto")
        why["pipeline_stagger"] = f"off: {refused}"
        return {}
    gpus = env.device.type == "cuda"
    if not gpus and asked == "auto":
        why["pipeline_stagger"] = ("off: on CPU nodes gloo's sends share the cores that compute, and the node's "
                                   "pipelines started a hop apart measured no faster (docs/benchmarks/network.md); "
                                   "pipeline_stagger: true staggers them")
        return {}
    schedule, one_row = pipeline["pipeline_schedule"], pipeline["pipeline_one_row"]
    shaped = cfg.model_copy(update={"pipeline_schedule": schedule, "pipeline_parallel": layout.pp,
                                    "pipeline_virtual_stages": pipeline["pipeline_virtual_stages"],
                                    "gradient_accumulation_steps": accumulation})
    facts = full_model_facts(machine.model_size())
    crossing = step_collectives(shaped, layout.parallel, facts, bf16_on_link(cfg, gpus), True, env.world_size,
                                env.local_world_size, pipeline=layout.pp, micro=accumulation)
    micro = accumulation * (cfg.per_device_train_batch_size if one_row else 1)
    shape = pipeline_shape(cfg, facts, schedule, pipeline["pipeline_virtual_stages"], micro,
                           pipeline["pipeline_stages"])
    # each process computes 1 / pp of the model for the step's micro-batches
    compute = compute_seconds_of(shaped, facts, machine.peak_flops(), gpus) / layout.pp
    rate = link_busbw(cfg)
    in_step = pipeline_step(crossing, nodes, rate, compute, shape)
    step, staggered = priced_pipeline(crossing, nodes, rate, compute, shape, pipelines,
                                      stagger_asked(cfg, layout.parallel, gpus))
    hop_ms = hop_seconds(crossing, rate, shape) / pipelines * 1e3
    hop = (f"a hop {hop_ms:.3g} ms: one pipeline's micro-batch alone on the {cfg.link_gbps:g} Gb/s link at "
           f"{cfg.cutoff_len} tokens a row; the run times it by each step's own rows")
    if not staggered:
        why["pipeline_stagger"] = (f"off: the node's {pipelines} pipelines started a hop apart ({hop}) are "
                                   f"predicted no shorter than in step ({in_step.step_s:.3g} s)")
        return {}
    said = "pipeline_stagger: true, " if asked is True else ""
    why["pipeline_stagger"] = (f"on: {said}the node's {pipelines} pipelines start a hop apart ({hop}), predicted "
                               f"step {step.step_s:.3g} s against {in_step.step_s:.3g} s in step")
    return {"pipeline_stagger_rate": rate}


def stagger_needless(nodes: int, pipelines: int) -> str | None:
    """Why there is nothing to stagger, or None."""
    if nodes < 2:
        return "one node: no stage boundary crosses a link"
    if pipelines < 2:
        return "a node holds one pipeline: its link carries one pipeline's activations at a time anyway"
    return None


def stagger_refusal(cfg: TrainConfig, parallel: str) -> str | None:
    """Why a node's pipelines cannot be staggered, or None."""
    if cfg.link_gbps is None:
        return ("the link's rate, which times a hop, is unknown: set link_gbps (meshtune doctor --bandwidth "
                "measures it)")
    if parallel == "zero3":
        return ("zero3 gathers each stage's weights at every micro-batch's forward, collectives among the node's "
                "pipelines that put them back in step")
    return None
