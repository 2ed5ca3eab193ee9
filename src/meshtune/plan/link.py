"""`parallel: auto` chosen by the link (`link_gbps`): each candidate mode's step predicted by crossing.py's arithmetic
from the bytes a node sends at the link's rate, hidden behind a GPU's compute (on CPU: added to a process's), and the
shortest taken."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from meshtune.config import TrainConfig
from meshtune.crossing import (ModelSize, StepTime, compute_seconds, data_parallel_step, fsdp_units,
                               full_model_facts, step_collectives)
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.hardware import host_bytes_a_process
from meshtune.plan.memory import full_state_bytes, gradient_reduction, sharding_for_full
from meshtune.plan.modes import auto_parallel
from meshtune.plan.pipeline import PP_MODEL_TYPES, pipeline_shapes
from meshtune.plan.run_plan import EACH, LinkChoice
from meshtune.shared_link import priced_pipeline

LINK_EFFICIENCY = 0.9  # of the line rate, what NCCL's all-reduce reaches on a healthy network (an assumption)


LINK_MARGIN = 0.02     # another mode replaces auto's rule only where its predicted step is this much shorter


def choose_by_link(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize],
                   gpu_bytes: Callable[[], float | None], peak_flops: Callable[[], float | None],
                   why: dict[str, str]) -> LinkChoice | None:
    """`parallel: auto` chosen by the link (`pick_by_link`) where `link_applies`, a process's compute estimated from
    the job's slowest measured matmul rate (a GPU's bf16, a CPU's fp32); None (the rules without the link)
    elsewhere."""
    nodes = env.world_size // max(env.local_world_size, 1)
    if cfg.link_gbps is None or cfg.parallel != "auto" or nodes < 2:
        return None
    if not link_applies(cfg, nodes):
        why["link_gbps"] = ("not used: the plan chooses by the link for full fine-tuning with parallel: auto "
                            "(LoRA's adapters move little), without tensor, context or pipeline parallel set")
        return None
    gpus = env.device.type == "cuda"
    card = gpu_bytes() if gpus else host_bytes_a_process(env.local_world_size)
    compute = compute_seconds_of(cfg, full_model_facts(model_size()), peak_flops(), gpus)
    best, predicted, rule_reason = pick_by_link(cfg, env.world_size, env.local_world_size, model_size(), card,
                                                compute, gpus)
    if not predicted:
        why["link_gbps"] = (f"not used: no mode holds the model's state in half of a process's "
                            f"{card / 2**30:.0f} GiB")
        return None
    label = {choice: link_label(choice, nodes) for choice in predicted}
    step = predicted[best]
    others = ", ".join(f"{label[c]} {predicted[c].efficiency:.1%} ({predicted[c].step_s:.3g} s)" for c in predicted
                       if c != best)
    why["parallel"] = (f"auto by the link ({cfg.link_gbps:g} Gb/s): {label[best]}, predicted at {step.efficiency:.1%} "
                       f"per GPU of one node's step ({step.exposed_s:.3g} s of its {step.step_s:.3g} s not hidden"
                       + (f", the bubble {step.bubble_s:.3g} s" if step.bubble_s else "") + f"); {others}"
                       + (f"; without the link: {rule_reason}" if rule_reason else ""))
    why["link_gbps"] = "predicted per GPU: " + ", ".join(f"{label[c]} {predicted[c].efficiency:.1%}" for c in predicted)
    if refused := pipeline_refusal(cfg, model_size(), nodes):
        why["link_gbps"] += f"; no pipeline across the nodes: {refused}"
    return best


def link_applies(cfg: TrainConfig, nodes: int) -> bool:
    """Whether `parallel: auto` chooses by the link: `link_gbps` set, full fine-tuning on several nodes, with no
    tensor, context or pipeline parallel set. The doctor asks the same."""
    return (cfg.link_gbps is not None and cfg.parallel == "auto" and nodes > 1
            and cfg.finetuning_type == "full" and cfg.pipeline_parallel == 1 and cfg.tensor_parallel == 1
            and cfg.context_parallel == 1)


def pick_by_link(cfg: TrainConfig, processes: int, per_node: int, size: ModelSize, card: float,
                 compute: float, gpus: bool = True) -> tuple[LinkChoice, dict[LinkChoice, StepTime], str | None]:
    """Of the modes whose state fits (`link_candidates`), the one whose predicted step (meshtune.crossing: bytes a
    node at LINK_EFFICIENCY of the line rate, hidden behind `compute` seconds a GPU) is shortest; auto's rule without
    the link stands unless another is LINK_MARGIN faster. Also every candidate's step, and the rule's reason where
    it stands."""
    predicted = link_candidates(cfg, processes, per_node, size, card, compute, gpus)
    rule, reason = auto_parallel(cfg, processes, per_node, gpus, lambda: card, lambda: size)
    if not predicted:
        return LinkChoice(rule, 1), predicted, reason
    best = link_pick(predicted, LinkChoice(rule, 1))
    return best, predicted, reason if best == LinkChoice(rule, 1) else None


def link_pick(predicted: dict[LinkChoice, StepTime], rule: LinkChoice) -> LinkChoice:
    """The shortest predicted step, unless auto's rule without the link is within LINK_MARGIN of it."""
    best = min(predicted, key=lambda choice: predicted[choice].step_s)
    if rule in predicted and predicted[best].step_s > (1 - LINK_MARGIN) * predicted[rule].step_s:
        return rule
    return best


def link_label(choice: LinkChoice, nodes: int) -> str:
    if choice.pipeline == 1:
        return choice.mode
    split = ", micro-batches of one row" if choice.one_row else ""
    staggered = ", a node's pipelines started a hop apart" if choice.stagger else ""
    return f"pipeline_parallel {nodes} ({choice.mode} inside each stage, {choice.schedule}{split}{staggered})"


def link_candidates(cfg: TrainConfig, processes: int, per_node: int, size: ModelSize, card: float,
                    compute: float, gpus: bool = True) -> dict[LinkChoice, StepTime]:
    """Each mode's predicted optimizer step across the nodes, a GPU computing for `compute` seconds, where its state
    takes at most half of `card`: hsdp over a node (ddp with one GPU a node), zero2, zero3, and a pipeline stage a
    node (where the config and the model allow it) sharded inside the node as zero2 or zero3 (`sharding_for_full`),
    its micro-batches the config's x the stages so the global batch stays. On CPU (`gpus` false) auto's CPU mode,
    ddp, and a pipeline stage a node with ddp inside it: gloo's reduce-scatter moves an all-reduce's bytes and a
    node's processes share its cores, so sharding inside a node saves no time there; fp32 activations, and nothing
    hidden behind the compute. A pipeline's node holds `per_node` of them (a stage's replicas), staggered where that
    is shorter (shared_link.priced_pipeline)."""
    nodes = processes // per_node
    facts, n, micro = full_model_facts(size), size.parameters, cfg.gradient_accumulation_steps
    bf16, busbw = bf16_on_link(cfg, gpus), link_busbw(cfg)
    units = fsdp_units(size, cfg.fsdp_blocks_per_unit)
    if gpus:
        fits = {"hsdp" if per_node > 1 else "ddp": full_state_bytes(cfg, n, per_node, whole_weights=False),
                "zero2": full_state_bytes(cfg, n, processes, whole_weights=True), "zero3": 0.0}
    else:
        fits = {"ddp": full_state_bytes(cfg, n, 1, whole_weights=False)}
    predicted = {}
    for mode, held in fits.items():
        if held > 0.5 * card:
            continue
        each = mode in ("zero2", "zero3") and gradient_reduction(cfg, processes, mode, micro, lambda: size,
                                                                 lambda: card, {}) == EACH
        crossing = step_collectives(cfg, mode, facts, bf16, True, processes, per_node, gloo=not gpus,
                                    reduce_each=each, pipeline=1)
        predicted[LinkChoice(mode, 1)] = data_parallel_step(crossing, nodes, busbw, compute, micro, units, gpus)
    if pipeline_refusal(cfg, size, nodes) is None:
        stage = sharding_for_full(cfg, n // nodes, per_node, card)[0] if per_node > 1 and gpus else "ddp"
        if per_node > 1 and gpus or full_state_bytes(cfg, n // nodes, 1, whole_weights=False) <= 0.5 * card:
            for (schedule, one_row), shape in pipeline_shapes(cfg, size, nodes, micro * nodes, stage).items():
                shaped = cfg.model_copy(update={"pipeline_schedule": schedule})
                crossing = step_collectives(shaped, stage, facts, bf16, True, processes, per_node, pipeline=nodes,
                                            micro=micro * nodes)
                step, stagger = priced_pipeline(crossing, nodes, busbw, compute, shape, per_node,
                                                stagger_asked(cfg, stage, gpus))
                predicted[LinkChoice(stage, nodes, schedule, one_row, stagger)] = step
    return predicted


def link_busbw(cfg: TrainConfig) -> float:
    """The bytes a second a node's link carries: LINK_EFFICIENCY of link_gbps."""
    return cfg.link_gbps / 8 * 1e9 * LINK_EFFICIENCY


def bf16_on_link(cfg: TrainConfig, gpus: bool) -> bool:
    """Whether weights and activations cross in bf16 (GPUs computing in bf16); fp32 otherwise."""
    return gpus and not cfg.fp16 and cfg.bf16 is not False


def stagger_asked(cfg: TrainConfig, parallel: str, gpus: bool) -> bool | None:
    """How a pipeline's node's pipelines are priced (shared_link.priced_pipeline): as pipeline_stagger asks (None:
    auto, staggered where shorter); in step under zero3 inside the stages, whose gathers keep them so, and under
    auto on CPU, where gloo's sends share the cores that compute and staggering measured no faster
    (docs/benchmarks/network.md)."""
    if parallel == "zero3":
        return False
    if cfg.pipeline_stagger == "auto":
        return None if gpus else False
    return cfg.pipeline_stagger


def compute_seconds_of(cfg: TrainConfig, facts, peak: float | None, gpus: bool = True) -> float:
    """A process's compute for a step (meshtune.crossing's estimate), the same in every mode: under a pipeline each
    process computes 1 / stages of the model for stages x the micro-batches."""
    seconds = compute_seconds(cfg, facts, peak, gpus)
    if seconds is None:
        raise ConfigError("link_gbps: the plan could not measure the devices' matmul rate to estimate a step's "
                          "compute; unset link_gbps")
    return seconds


def pipeline_refusal(cfg: TrainConfig, size: ModelSize, stages: int) -> str | None:
    """Why `stages` pipeline stages cannot run this config and model (the config's refusals, and the model's: its
    type, a tied head, fewer blocks than stages), or None. Stages of unequal blocks are priced as they are
    (`pipeline_shapes`)."""
    try:
        TrainConfig(**{**cfg.model_dump(), "pipeline_parallel": stages})
    except ValidationError as exc:
        return "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
    if size.model_type not in PP_MODEL_TYPES or size.tied_embeddings or size.blocks < stages:
        return (f"the model ({size.model_type or 'unknown'} type, {size.blocks} blocks"
                f"{', a tied head' if size.tied_embeddings else ''}) does not split into {stages} stages")
    return None
