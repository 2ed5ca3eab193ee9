"""pipeline_parallel: the stage count checked against the job and the model, the schedule, and each stage's blocks
balanced by cost."""

from __future__ import annotations

import math
from collections.abc import Callable

from meshtune.config import TrainConfig
from meshtune.crossing import MULTI_STAGE_SCHEDULES as MULTI_STAGE
from meshtune.crossing import ModelFacts, ModelSize, PipelineShape, full_model_facts, stage_costs, stage_ranks
from meshtune.crossing import stages_a_process as virtual_stages
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.plan.run_plan import PIPELINE_KEYS, LinkChoice

# decoders whose blocks, embedding, norm and head model/pipeline_parallel.py splits
PP_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def pipeline_parallel_size(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize]) -> int:
    """`pipeline_parallel`, checked against the job and the model: the stages are outermost in the mesh (rank r is
    on stage r // (world_size / pp)), so with the processes of one node a stage only activations cross nodes. What
    the config alone refuses, config/ does."""
    pp = cfg.pipeline_parallel
    if pp == 1:
        return 1
    if env.world_size % pp:
        working = [d for d in range(1, env.world_size + 1) if env.world_size % d == 0]
        raise ConfigError(f"pipeline_parallel: {pp} does not divide the job's {env.world_size} processes; counts "
                          f"that work here: {', '.join(map(str, working))}")
    refuse_unsplit_model(f"pipeline_parallel: {pp}", cfg.model_name_or_path, model_size(), PP_MODEL_TYPES,
                         "the decoders of {} models into stages",
                         "one weight the first and the last stage would both train; set pipeline_parallel: 1 (such "
                         "models are small enough for parallel: zero3)")
    return pp


def refuse_unsplit_model(setting: str, path: str, size: ModelSize, model_types: tuple[str, ...], splits: str,
                         tied: str) -> None:
    """`setting` (e.g. "tensor_parallel: 2") refused for a model meshtune does not split so: a model_type outside
    `model_types` (`splits` says what it splits, {} the types), or an output head tied to the input embedding."""
    if size.model_type not in model_types:
        key = setting.split(":")[0]
        raise ConfigError(f"{setting}: meshtune splits {splits.format(', '.join(model_types))}, not model_type "
                          f"{size.model_type or 'unknown'} of {path}; set {key}: 1")
    if size.tied_embeddings:
        raise ConfigError(f"{setting}: {path} ties its output head to the input embedding (tie_word_embeddings), "
                          f"{tied}")


EMPTY_ENDS = ", the first and the last, several a process under ddp, may hold only the embedding or the head"


def ends_may_be_empty(virtual: int, parallel: str) -> bool:
    """Whether the first and the last stage may hold no block: where a process holds several stages and they are
    not FSDP2's (with one a process, a stage with no block would leave its process nothing to train under LoRA;
    FSDP2 shards a stage by its blocks)."""
    return virtual > 1 and parallel == "ddp"


def check_stage_blocks(cfg: TrainConfig, env: DistEnv, pp: int, parallel: str, blocks: int) -> None:
    """The model's blocks against the stages: a block a stage, or but for the ends (`ends_may_be_empty`)."""
    virtual = virtual_stages(cfg)

    def least(d: int) -> int:
        return d * virtual - 2 if ends_may_be_empty(virtual, parallel) else d * virtual

    if blocks < least(pp):
        working = [d for d in range(1, env.world_size + 1) if env.world_size % d == 0 and least(d) <= blocks]
        raise ConfigError(f"pipeline_parallel: {pp}: {pp * virtual} stages need at least {least(pp)} blocks (a block "
                          f"a stage{EMPTY_ENDS if virtual > 1 else ''}), and the model has {blocks}; counts that "
                          f"work here: {', '.join(map(str, working))}")


def interleaved_counts(pp: int, limit: int) -> list[int]:
    """The micro-batch counts up to `limit` torch's ScheduleInterleaved1F1B runs on `pp` processes: a whole number
    of rounds of max(1, n // pp) each."""
    return [n for n in range(1, limit + 1) if n % max(1, n // pp) == 0]


def unused_pipeline_keys(cfg: TrainConfig, why: dict[str, str]) -> None:
    """The pipeline's keys the config sets where the run has no pipeline: each named in the plan, not silently
    dropped."""
    chosen_by = " (and auto by the link chose none)" if cfg.link_gbps is not None and cfg.parallel == "auto" else ""
    for key, unset in PIPELINE_KEYS.items():
        if getattr(cfg, key) != unset:
            why[key] = f"not used: the run has no pipeline (pipeline_parallel 1{chosen_by})"


def pipeline_choice(cfg: TrainConfig, env: DistEnv, pp: int, parallel: str, micro_batches: int,
                    model_size: Callable[[], ModelSize], why: dict[str, str], link: LinkChoice | None = None) -> dict:
    """The schedule and the stages' blocks under pipeline_parallel (nothing without it). A step's micro-batches
    (gradient_accumulation_steps) are the schedule's: 1F1B, which holds at most pp micro-batches' activations
    on a stage, needs at least pp of them to fill the pipeline; GPipe runs any number; Interleaved1F1B a whole
    number of rounds; ZBV any number. With pipeline_row_micro_batches each row of them is one of the schedule's.
    Where the link chose the pipeline (`link`), its schedule and split. Without a pipeline the keys that shape one,
    where set, are named as unused."""
    if pp == 1:
        unused_pipeline_keys(cfg, why)
        return {}
    if link is not None and link.schedule is not None:
        return link_pipeline(cfg, link, micro_batches, model_size(), parallel, why)
    one_row = bool(cfg.pipeline_row_micro_batches)
    micro_batches *= cfg.per_device_train_batch_size if one_row else 1
    counted = "gradient_accumulation_steps" + (" x per_device_train_batch_size" if one_row else "")
    schedule = cfg.pipeline_schedule
    if schedule == "1f1b" and micro_batches < pp:
        raise ConfigError(f"pipeline_schedule: 1f1b needs at least pipeline_parallel ({pp}) micro-batches a step, "
                          f"and the step has {micro_batches} ({counted}): raise "
                          f"gradient_accumulation_steps to {pp}, or use pipeline_schedule: gpipe")
    if schedule == "interleaved_1f1b" and micro_batches % max(1, micro_batches // pp):
        raise ConfigError(f"pipeline_schedule: interleaved_1f1b runs the micro-batches in rounds of "
                          f"max(1, micro-batches // pipeline_parallel), a whole number of them, and the step's "
                          f"{micro_batches} ({counted}) are not; counts that work on {pp} stages: "
                          f"{', '.join(map(str, interleaved_counts(pp, max(micro_batches, 4 * pp))))}")
    if schedule not in ("gpipe", "1f1b", *MULTI_STAGE):
        schedule = "1f1b" if micro_batches >= pp else "gpipe"
        why["pipeline_schedule"] = (f"auto: 1f1b, {micro_batches} micro-batches a step fill {pp} stages, and a stage "
                                    f"holds at most {pp} micro-batches' activations" if schedule == "1f1b" else
                                    f"auto: gpipe, {micro_batches} micro-batches a step are fewer than the {pp} "
                                    f"stages 1f1b needs")
    virtual = virtual_stages(cfg)
    size = model_size()
    check_stage_blocks(cfg, env, pp, parallel, size.blocks)
    stages = run_stages(size, schedule, pp, virtual, parallel)
    why["pipeline_stages"] = stages_reason(stages, size.blocks, head_worth(size), pp, schedule)
    return {"pipeline_schedule": schedule, "pipeline_virtual_stages": virtual, "pipeline_stages": stages,
            "pipeline_one_row": one_row}


def pipeline_shapes(cfg: TrainConfig, size: ModelSize, pp: int, micro: int,
                    parallel: str) -> dict[tuple[str, bool], PipelineShape]:
    """The pipelines of `pp` stages the link choice weighs, by (schedule, one row a micro-batch): the step's
    `micro` micro-batches as the config has them, and (per_device_train_batch_size above 1) each row one, unless
    pipeline_row_micro_batches names one; under each, pipeline_schedule where the config names one, else 1f1b
    (gpipe where the micro-batches are fewer than the stages), interleaved_1f1b (2 stages a process; where its rounds
    divide the micro-batches) and zbv, each where the blocks give every stage one (`check_stage_blocks`). Each stage
    costs what its blocks (and the last stage's head) cost (crossing.stage_costs), the stages balanced as the run
    builds them (`run_stages`)."""
    rows = cfg.per_device_train_batch_size
    named = cfg.pipeline_schedule if cfg.pipeline_schedule != "auto" else None
    splits = [False, True] if cfg.pipeline_row_micro_batches is None and rows > 1 else [
        bool(cfg.pipeline_row_micro_batches)]
    facts = full_model_facts(size)
    shapes = {}
    for one_row, m in ((split, micro * rows if split else micro) for split in splits):
        for schedule in [named] if named else ["1f1b" if m >= pp else "gpipe", "interleaved_1f1b", "zbv"]:
            virtual = virtual_stages(cfg, schedule)
            empty_ends = ends_may_be_empty(virtual, parallel)
            if (schedule == "1f1b" and m < pp or schedule == "interleaved_1f1b" and m % max(1, m // pp)
                    or size.blocks < pp * virtual - (2 if empty_ends else 0)):
                continue  # what pipeline_choice and check_stage_blocks refuse
            stages = run_stages(size, schedule, pp, virtual, parallel)
            shapes[schedule, one_row] = pipeline_shape(cfg, facts, schedule, virtual, m, stages)
    return shapes


def pipeline_shape(cfg: TrainConfig, facts: ModelFacts, schedule: str, virtual: int, micro: int,
                   stages: list[tuple[int, int]]) -> PipelineShape:
    """A pipeline of `stages` under `schedule` over `micro` micro-batches a step, each stage costing its blocks'
    FLOPs (and the last the head's) for a row of cutoff_len tokens (crossing.stage_costs), recomputation counted as
    the config names it."""
    recompute = (cfg.named_recompute_ratio or 0.0) if cfg.gradient_checkpointing else 0.0
    return PipelineShape(schedule, virtual, micro, stage_costs(facts, stages, cfg.is_lora, recompute, cfg.cutoff_len))


def link_pipeline(cfg: TrainConfig, link: LinkChoice, micro_batches: int, size: ModelSize, parallel: str,
                  why: dict[str, str]) -> dict:
    """The pipeline the link chose (`pipeline_shapes`): its schedule, stages and split, and why."""
    virtual = virtual_stages(cfg, link.schedule)
    stages = run_stages(size, link.schedule, link.pipeline, virtual, parallel)
    why["pipeline_stages"] = stages_reason(stages, size.blocks, head_worth(size), link.pipeline, link.schedule)
    if cfg.pipeline_schedule == "auto" or cfg.pipeline_row_micro_batches is None:
        count = micro_batches * (cfg.per_device_train_batch_size if link.one_row else 1)
        rows = "one row" if link.one_row else f"{cfg.per_device_train_batch_size} rows"
        why["pipeline_schedule"] = (f"auto by the link: {link.schedule} over {count} micro-batches of {rows}, the "
                                    f"shortest predicted step of the pipelines weighed (see parallel)")
    return {"pipeline_schedule": link.schedule, "pipeline_virtual_stages": virtual, "pipeline_stages": stages,
            "pipeline_one_row": link.one_row}


def head_worth(size: ModelSize) -> float:
    """The output head's cost in blocks: its matmul's FLOPs a token (2 x vocabulary x hidden, forward) against a
    block's (2 x its parameters); 0 where the head is unknown. The embedding is a lookup and counts as nothing."""
    return size.head_parameters / size.block_parameters if size.block_parameters else 0.0


def run_stages(size: ModelSize, schedule: str, pp: int, virtual: int, parallel: str) -> list[tuple[int, int]]:
    """The stages' blocks the run builds for `schedule` on `pp` processes of `virtual` stages each: balanced for
    the processes torch places them on (crossing.stage_ranks)."""
    return balanced_stages(size.blocks, pp * virtual, head_worth(size), ends_may_be_empty(virtual, parallel),
                           stage_ranks(schedule, pp, virtual))


def balanced_stages(blocks: int, stages: int, head: float, empty_ends: bool = False,
                    ranks: list[int] | None = None) -> list[tuple[int, int]]:
    """Consecutive blocks [first, end) for each of `stages` stages, `ranks` the process of each (unset: a stage a
    process). A stage costs its blocks, the last one `head` blocks more, and a process its stages' costs: the step
    waits on the busiest process, so it is as light as it can be (`process_caps`); among such splits the stages are
    the most even (the smallest sum of squared costs: each block goes to the cheapest stage whose process has room,
    which is exact for a sum of convex costs under such caps), a later stage first where they tie (1F1B's earlier
    stages hold more micro-batches' activations). Every stage holds a block, but with `empty_ends` the first and
    the last may hold none (the embedding alone, the head alone)."""
    ranks = ranks if ranks is not None else list(range(stages))
    least = [0 if empty_ends and stage in (0, stages - 1) else 1 for stage in range(stages)]
    room = process_caps(blocks, ranks, head, least)
    for stage, rank in enumerate(ranks):
        room[rank] -= least[stage]
    held = list(least)
    for _ in range(blocks - sum(least)):
        stage = min((s for s in range(stages) if room[ranks[s]] > 0),
                    key=lambda s: (held[s] + (head if s == stages - 1 else 0.0), -s))
        held[stage] += 1
        room[ranks[stage]] -= 1
    bounds, first = [], 0
    for count in held:
        bounds.append((first, first + count))
        first += count
    return bounds


def process_caps(blocks: int, ranks: list[int], head: float, least: list[int]) -> list[int]:
    """The most blocks each process may hold with the busiest process's cost the least it can be: the smallest
    bound (a whole number of blocks, or that and the head) under which the processes hold every block between
    them, each at least its stages' `least`. Stages are consecutive blocks in order whatever their counts, so
    any counts within these caps are a split."""
    processes = max(ranks) + 1
    heads = [head if rank == ranks[-1] else 0.0 for rank in range(processes)]
    fewest = [sum(n for n, rank in zip(least, ranks) if rank == p) for p in range(processes)]
    for bound in sorted({whole + extra for whole in range(blocks + 1) for extra in (0.0, head)}):
        caps = [math.floor(bound - extra + 1e-9) for extra in heads]
        if sum(caps) >= blocks and all(cap >= n for cap, n in zip(caps, fewest)):
            return caps
    raise ValueError(f"{len(ranks)} stages cannot hold {blocks} blocks")  # check_stage_blocks refuses it first


def stages_reason(stages: list[tuple[int, int]], blocks: int, head: float, pp: int, schedule: str) -> str:
    """Why the stages hold the blocks they do, for run_plan.json: where several are a process's, each process's
    share of the cost."""
    held = ", ".join(str(end - first) for first, end in stages)
    costs = (f"the head (vocabulary x hidden) costs {head:.2f} blocks' FLOPs and the embedding, a lookup, none"
             if head else "the head's size unknown, each stage costs its blocks")
    ends = "the embedding on the first stage, the final norm and head on the last"
    if len(stages) == pp:
        return (f"{held} of the {blocks} blocks in the {len(stages)} stages (a stage a process): the slowest stage "
                f"as fast as it can be, as {costs}; {ends}")
    where = f"rank r holding stages r and {2 * pp - 1} - r" if schedule == "zbv" else (
        f"rank r holding stages r, r + {pp}, ...")
    ranks = stage_ranks(schedule, pp, len(stages) // pp)
    shares = [0.0] * pp
    for stage, (first, end) in enumerate(stages):
        shares[ranks[stage]] += end - first + (head if stage == len(stages) - 1 else 0.0)
    each = ", ".join(f"rank {rank} {share / sum(shares):.1%}" for rank, share in enumerate(shares))
    return (f"{held} of the {blocks} blocks in the {len(stages)} stages ({where}): the busiest process as light as "
            f"it can be, then the stages as even as they can be, as {costs}; each process's share of the cost: "
            f"{each}; {ends}")
