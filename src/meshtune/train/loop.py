"""`meshtune train` in one worker process: setup, the step loop, the final save.

Loss of an optimizer step = the objective's loss summed over its whole global batch / its normaliser summed over
every rank (train/objectives: for SFT, the global count of target tokens). Each micro-step's backward uses that
global normaliser (all-reduced before the first forward), times the data-parallel size because DDP and FSDP2
average gradients. So the split of a global batch across processes and micro-steps does not change the math.
"""

from __future__ import annotations

import gc
import logging
import random
import signal
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from meshtune import faults
from meshtune.checkpoint import CheckpointManager, TrainingProgress, publish_final, training_state
from meshtune.checkpoint.manager import RESUME_COPY
from meshtune.checkpoint.object_store import StorePath, is_url, location
from meshtune.config import TrainConfig
from meshtune.cpu_affinity import apply_cpu_affinity
from meshtune.data.chat_template import serving_chat_template
from meshtune.data.collate import Batch
from meshtune.data.pipeline import plan_steps, prepare_datasets
from meshtune.data.sampler import GlobalBatchPlan
from meshtune.distributed import DistEnv, all_reduce_sum, barrier, init_distributed, shutdown, use_expandable_segments
from meshtune.hardware import limit_gpu_memory, measure_peak_flops
from meshtune.mailbox import Mailbox
from meshtune.mesh import ParallelDims
from meshtune.model.build import BuiltModel, build_model
from meshtune.model.final_weights import gather_state_dict, save_final
from meshtune.model.loading import model_size
from meshtune.model.model_dir import check_model_dir, load_tokenizer
from meshtune.model.reference import build_reference
from meshtune.model.pipeline_parallel import gather_stage_weights, whole_model
from meshtune.model.parallel import settle_gradient_buckets
from meshtune.plan import MEASURE, RunPlan, resolve, resume_request
from meshtune.train.agreement import check_agreement, package_versions
from meshtune.train.evaluation import Evaluator
from meshtune.train.garbage_collection import StepGarbageCollection, libraries_frozen
from meshtune.train.hang_watchdog import HangWatchdog, enable_flight_recorder
from meshtune.train.loss_scale import LossScaler
from meshtune.train.memory_fit import fit_run_to_memory, largest_micro_batch
from meshtune.train.metrics import MetricsLog, StepMeter, plot_losses, summary
from meshtune.train.nonfinite import NonFiniteSteps, sample_ids
from meshtune.train.objectives import normalised
from meshtune.train.objectives.by_stage import build_objective
from meshtune.train.optimizer import build_optimizer
from meshtune.train.pipeline_step import PipelineStep, Stagger
from meshtune.train.preemption import StopRequest
from meshtune.train.reference_pass import precompute_reference, reference_is_policy
from meshtune.train.profiling import StepProfiler
from meshtune.train.schedule import build_scheduler, describe_schedule, warmup_steps
from meshtune.train.sequence_split import SequenceSplit, row_multiple
from meshtune.train.step import StepDone, StepParts, optimizer_step
from meshtune.train.storage import check_shared_output_dir, ensure_writable_dir
from meshtune.train.stragglers import Place, StepTimes
from meshtune.train.trackers import open_trackers

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    model: torch.nn.Module | None  # the wrapped (DDP / FSDP2) model after the last step, if kept
    records: list[dict]  # what metrics.jsonl holds (rank 0; empty elsewhere)
    final_dir: Path | None  # None with save_final: false
    stopped_by: int | None = None  # the signal that stopped the run before its last step (train/preemption.py)


@dataclass
class RunData:
    """The run's tokenizer, its data and the global batches it deals them in."""
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None  # saved with final/ and in every checkpoint
    train: object  # the training set (with the reference's log-probs attached, where precomputed)
    eval: object | None  # the held-out set
    dims: ParallelDims  # the run's mesh: which ranks share this process's data
    data_env: DistEnv  # a cp x tp group's, a pipeline's processes take the same micro-batches
    batches: GlobalBatchPlan
    total_steps: int
    epoch_ends: frozenset[int]  # the steps that end an epoch, where saving or evaluating goes by epoch


@dataclass
class Run:
    """What the run holds before its first step: what the step, what follows it and the end share."""
    cfg: TrainConfig
    env: DistEnv
    plan: RunPlan  # as built and measured: what the model could not do is off, with why
    places: list[Place]  # each rank's node and host, for the straggler and hang reports
    output_dir: Path
    where: Path | StorePath  # where checkpoints go
    shared: bool  # that place is one storage for every node
    checkpoints: CheckpointManager
    data: RunData
    built: BuiltModel
    progress: TrainingProgress  # the steps done, checkpointed with the model
    state: dict  # what a checkpoint holds
    peak_flops: float | None  # rank 0's measured bf16 matmul rate, for MFU
    step: StepParts


@dataclass
class Watch:
    """What follows each step: evaluation, the step's metrics and their log, profiling, step times and stragglers,
    the hang watchdog, non-finite steps."""
    evaluator: Evaluator
    meter: StepMeter
    metrics: MetricsLog
    profiler: StepProfiler
    run_info: dict  # what each checkpoint's manifest records
    times: StepTimes
    hang: HangWatchdog
    nonfinite: NonFiniteSteps
    # a cp group's processes each hold the loss of their share of the positions; a tensor-parallel peer, a copy
    own_loss: float


def train(cfg: TrainConfig) -> TrainResult:
    use_expandable_segments(cfg.expandable_segments)  # before the first CUDA allocation
    if cfg.hang_timeout != 0:
        enable_flight_recorder()  # before the NCCL process group exists
    env = init_distributed(cfg.ddp_timeout)
    if not env.is_main:
        quiet_other_ranks()
    # threads started from here on inherit the pinning
    pinned = apply_cpu_affinity(cfg.cpu_pinning, env.local_rank, env.local_world_size)
    if pinned:
        logger.info(f"{pinned} (rank 0)")
    if limit_gpu_memory(env.device, cfg.gpu_memory_limit):
        logger.info(f"gpu_memory_limit: each process allocates at most {cfg.gpu_memory_limit:g} GiB of its GPU")
    with StopRequest(Mailbox.of_launcher()) as stop:
        return train_until_done_or_stopped(cfg, env, stop)


def train_until_done_or_stopped(cfg: TrainConfig, env: DistEnv, stop: StopRequest) -> TrainResult:
    """The set-up, the steps, what follows each, and the end.

    Collective order: every rank calls the same collectives in the same order, as these lines decide it: set_up's
    (in the order of its lines), set_up_watch's, then for each step optimizer_step's (train/step.py) and
    after_step's, then finish's. A stop request is agreed in a step's first all-reduce (its counts), so every rank
    leaves the loop before the same step."""
    run = set_up(cfg, env)
    watch = set_up_watch(run)
    started = time.perf_counter()
    stopped_by = 0  # the signal that ends the loop early, if one comes
    with StepGarbageCollection(run.plan.gc_interval) as collection, watch.hang:
        for step in range(run.progress.step, run.data.total_steps):
            if stopped_by := stop.due():  # a rank was signalled during the previous step
                break
            watch.times.begin()
            watch.hang.at(step + 1, "preparing the batch")
            watch.profiler.begin(step + 1)
            done = optimizer_step(run.step, step, stop, watch.times, watch.hang, watch.nonfinite)
            after_step(run, watch, done, step + 1)
            collection.after_step(step + 1)
            watch.profiler.end(step + 1, last=step + 1 == run.data.total_steps)
            watch.hang.step_done()
    return finish(run, watch, stop, stopped_by, started)


# -- set-up: what the run holds before its first step -------------------------------------------------------------

def set_up(cfg: TrainConfig, env: DistEnv) -> Run:
    """The run's parts, built in the same order on every rank: the collectives inside (the agreement's all-gather,
    the storage check, the resume's verification, the reference pass, the model's broadcasts and sharding, the
    memory fit, DDP's settling backward) come in the order of these lines."""
    places = [Place(node, host) for node, host in check_agreement(cfg, env)]  # config, versions, data, node ranks:
    # identical everywhere, or stop now
    output_dir = Path(cfg.output_dir)
    if env.is_main:
        ensure_writable_dir(output_dir, "output_dir")
    seed_everything(cfg.seed)
    where, shared, checkpoints = open_checkpoints(cfg, env, output_dir)
    resume_path, manifest, verify_s = find_resume(cfg, checkpoints, shared)
    model_dir = check_model_dir(cfg.model_name_or_path)
    plan = resolve(cfg, env, manifest, lambda: model_size(model_dir), resumed_from=resume_path, shared=shared)
    data = set_up_data(cfg, env, plan, model_dir)
    if shared and cfg.save_strategy == "epoch":
        checkpoints.save_at(data.epoch_ends)
    built, plan, data = set_up_model(cfg, env, plan, data)
    logger.info(plan.describe())
    optimizer, params, scheduler = set_up_optimizer(cfg, plan, built.model, data.total_steps)
    progress = TrainingProgress()
    state = training_state(built.model, optimizer, scheduler, progress, env.rank, trainable_only=cfg.is_lora,
                           optimizer_by_name=built.pipeline is not None)  # each stage's groups name other weights
    if resume_path:
        load_began = time.monotonic()
        checkpoints.load(resume_path, state)
        logger.info(f"resumed from {resume_path} at step {progress.step} of {data.total_steps} "
                    f"(verified in {verify_s:.1f} s, loaded in {time.monotonic() - load_began:.1f} s)")
    scaler = LossScaler(plan.fp16, plan.parallel != "ddp", env.device, progress)  # fp16's loss scale; else no-op
    logger.info(describe_size(cfg, env, data, params, built.model))
    peak_flops = peak_flops_of_this_card(env)
    parts = set_up_step(cfg, env, plan, built, data, optimizer, params, scheduler, scaler)
    plan = fit_to_memory(cfg, plan, parts, progress.step, data.total_steps)
    if progress.step < data.total_steps:  # DDP: the first step reduces as every later one does (a resume stays exact)
        first = data.batches.micro_batches(*data.batches.position(progress.step), data.data_env.rank)[0]
        settle_gradient_buckets(parts.model,
                                lambda: parts.objective.loss_sum(parts.rows_to_batch(first).to(env.device)))
    if env.is_main:  # nothing above refused the run: from here on it trains, and output_dir describes it
        describe_run(cfg, plan, output_dir)
    return Run(cfg, env, plan, places, output_dir, where, shared, checkpoints, data, built, progress, state,
               peak_flops, parts)


def open_checkpoints(cfg: TrainConfig, env: DistEnv, output_dir: Path,
                     ) -> tuple[Path | StorePath, bool, CheckpointManager]:
    """Where checkpoints go, whether every node shares that place (else no checkpoints, with a warning, where
    allow_local_checkpoints allows it), and the manager that saves them on the run's schedule."""
    where = location(cfg.checkpoint_dir or output_dir)  # an object store is shared by every node by its nature
    shared = isinstance(where, StorePath) or check_shared_output_dir(where, env, cfg.allow_local_checkpoints)
    checkpoints = CheckpointManager(where, cfg.save_total_limit, cfg.async_save, env.rank, env.world_size,
                                    save_steps=cfg.save_steps if shared and cfg.save_strategy == "steps" else 0,
                                    local_rank=env.local_rank, local_world_size=env.local_world_size,
                                    staging=output_dir / RESUME_COPY)  # a resume from a store: the node's copy
    return where, shared, checkpoints


def find_resume(cfg: TrainConfig, checkpoints: CheckpointManager,
                shared: bool) -> tuple[Path | None, dict | None, float]:
    """The checkpoint the run resumes from (auto: the newest complete, verified one), its manifest and the seconds
    its verification took; (None, None, ...) for a fresh start."""
    wanted, named = resume_request(cfg, shared)
    if wanted and is_url(cfg.resume_from_checkpoint):
        named = cfg.resume_from_checkpoint
    verify_began = time.monotonic()
    resume_path, manifest, notes = (checkpoints.find_resume(named, cfg.math(), cfg.resume_allow_changed) if wanted
                                    else (None, None, []))
    verify_s = time.monotonic() - verify_began
    for note in notes:
        logger.info(note)
    return resume_path, manifest, verify_s


def set_up_data(cfg: TrainConfig, env: DistEnv, plan: RunPlan, model_dir: Path) -> RunData:
    """The tokenizer and the data, tokenized once into the shared cache (other processes wait on its file lock),
    and the run's global batches over the data's ranks."""
    tokenizer = load_tokenizer(model_dir)
    chat_template = serving_chat_template(tokenizer, cfg.named_template, cfg.default_system)
    train_data, eval_data = prepare_datasets(cfg, tokenizer, show_progress=env.is_main)
    dims = plan.dims(env)
    data_env = dims.data_env()
    batches, total_steps = plan_steps(cfg, train_data, data_env.world_size, plan.gradient_accumulation_steps,
                                      plan.padding_free, report=True)
    by_epoch = "epoch" in (cfg.save_strategy, cfg.eval_strategy)
    epoch_ends = batches.epoch_ends(total_steps) if by_epoch else frozenset()
    return RunData(tokenizer, chat_template, train_data, eval_data, dims, data_env, batches, total_steps, epoch_ends)


def set_up_model(cfg: TrainConfig, env: DistEnv, plan: RunPlan,
                 data: RunData) -> tuple[BuiltModel, RunPlan, RunData]:
    """The policy, built and wrapped (model/build.py), and with precompute_ref_log_probs the reference's log-probs
    attached to the data; the plan as built (what the model could not do is off, with why)."""
    precompute = partial(precompute_reference, cfg, plan, env, data.tokenizer.pad_token_id, [data.train, data.eval],
                         show_progress=env.is_main)
    # a frozen copy's log-probs before the policy exists: the copy is freed before the policy takes the memory
    precomputed = (precompute(lambda: build_reference(cfg, plan, env, data.dims, None))
                   if plan.precompute_ref_log_probs and not reference_is_policy(cfg) else None)
    built = build_model(cfg, plan, env, data.dims)
    plan = built.plan
    if plan.precompute_ref_log_probs and reference_is_policy(cfg):  # the policy with its adapters off
        precomputed = precompute(lambda: build_reference(cfg, plan, env, data.dims, built.model))
    if precomputed:
        data = replace(data, train=precomputed.attach(data.train), eval=precomputed.attach(data.eval))
        plan = plan.amended("reference", precomputed.reason)
    return built, plan, data


def set_up_optimizer(cfg: TrainConfig, plan: RunPlan, model: torch.nn.Module, total_steps: int,
                     ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and the learning-rate schedule over the run's steps."""
    optimizer, params = build_optimizer(model, cfg, plan.fused_adamw)
    warmup = warmup_steps(total_steps, cfg.warmup_ratio, cfg.warmup_steps)
    schedule = (total_steps, warmup, cfg.lr_scheduler_type, cfg.warmup_type, cfg.cos_min_ratio)
    scheduler = build_scheduler(optimizer, *schedule)
    logger.info(describe_schedule(*schedule))
    return optimizer, params, scheduler


def describe_size(cfg: TrainConfig, env: DistEnv, data: RunData, params: list[torch.nn.Parameter],
                  model: torch.nn.Module) -> str:
    """The run's size in one line: processes, steps, the global batch, the trainable parameters."""
    return (f"{cfg.finetuning_type} on {env.world_size} process(es): {data.total_steps} steps x global batch "
            f"{data.batches.global_batch}{' packed rows' if cfg.packing else ''}{last_step(data.batches)}; "
            f"trainable parameters {sum(p.numel() for p in params):,} of "
            f"{sum(p.numel() for p in model.parameters()):,}")


def peak_flops_of_this_card(env: DistEnv) -> float | None:
    """Rank 0's measured bf16 matmul rate, the MFU's denominator (None elsewhere, and where nothing measures)."""
    peak_flops = measure_peak_flops(env.device) if env.is_main else None
    if peak_flops:
        logger.info(f"MFU is counted against {peak_flops / 1e12:.0f} TFLOP/s, a bf16 matmul measured on this card")
    return peak_flops


def set_up_step(cfg: TrainConfig, env: DistEnv, plan: RunPlan, built: BuiltModel, data: RunData,
                optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: LossScaler) -> StepParts:
    """What each optimizer step uses: the stage's objective (train/objectives/by_stage.py), how rows become a
    micro-batch, the context-parallel split and the pipeline schedule, with the optimizer, its trainable
    parameters, the schedule and the loss scaler; the model in training mode."""
    pad_id = data.tokenizer.pad_token_id
    # tensor and context parallel: every process holds an equal share of a row's positions
    row_length_multiple = row_multiple(plan.context_parallel, plan.tensor_parallel)
    objective = build_objective(cfg, plan, env, data.dims, built.model, pad_id, row_length_multiple)
    collate_rows = partial(objective.collate, dataset=data.train, packed=cfg.packing)
    # an empty share of a last partial step: the shortest sample, trained on nothing
    filler_rows = [[int(np.argmin(data.train.lengths))]]

    def rows_to_batch(rows: list[list[int]]) -> Batch:
        return collate_rows(rows) if rows else collate_rows(filler_rows).ignore_all()

    split = SequenceSplit(data.dims)  # context parallel: each process's share of the positions
    # pipeline_parallel: this process's stage and torch's schedule over the step's micro-batches
    pipeline = (PipelineStep(built.stages, built.held, built.pipeline, plan, env.device, pad_id, cfg.cutoff_len,
                             Stagger.of(plan, data.data_env, built.stages[0].get_base_model().config.hidden_size))
                if built.pipeline is not None else None)
    stages = built.pipeline["pp"].get_group() if built.pipeline is not None else None
    built.model.train()
    return StepParts(env=env, model=built.model, objective=objective, optimizer=optimizer, scheduler=scheduler,
                     params=params, scaler=scaler, max_grad_norm=cfg.max_grad_norm,
                     gradient_reduction=plan.gradient_reduction,
                     keep_gathered=plan.reshard_after_forward is False, fp16=plan.fp16, batches=data.batches,
                     dataset=data.train, data_rank=data.data_env.rank, rows_to_batch=rows_to_batch,
                     flops=built.flops, split=split, pipeline=pipeline, stages=stages,
                     own=float(data.dims.counts_batch), reducing=data.dims.reducing)


def fit_to_memory(cfg: TrainConfig, plan: RunPlan, parts: StepParts, start_step: int, total_steps: int) -> RunPlan:
    """gradient_checkpointing_ratio: auto: the share of blocks recomputed, measured on the largest micro-batch
    before the step meter starts (train/memory_fit.py); the plan as measured. Any other plan as it is."""
    if plan.recompute != MEASURE:
        return plan
    largest = partial(largest_micro_batch, parts.batches, start_step, total_steps, parts.data_rank, plan.padding_free)
    ratio, measured = fit_run_to_memory(parts.model, parts.objective, parts.params, parts.optimizer, largest,
                                        parts.rows_to_batch, cfg.memory_budget, cfg.gpu_memory_limit,
                                        parts.env.device, parts.split,
                                        more_room=more_room(cfg, plan))
    logger.info(measured)
    return plan.amended("gradient_checkpointing", measured, recompute=ratio)


def set_up_watch(run: Run) -> Watch:
    """Evaluation, metrics, trackers, profiling, the straggler and hang watches and the non-finite check, each
    started where the run resumes."""
    cfg, env, plan, data, parts = run.cfg, run.env, run.plan, run.data, run.step
    objective, pipeline, start = parts.objective, parts.pipeline, run.progress.step
    # under pipeline_parallel the last stage holds the loss, and each stage counts the targets: 1 / pp of them each
    evaluator = Evaluator(data.eval, cfg.per_device_eval_batch_size,
                          cfg.eval_steps if cfg.eval_strategy == "steps" else None, data.total_steps, data.data_env,
                          partial(objective.collate, dataset=data.eval, packed=False),
                          pipeline.eval_loss if pipeline is not None else parts.split.around(objective.loss_sum),
                          objective.count,
                          also_at=data.epoch_ends if cfg.eval_strategy == "epoch" else frozenset(),
                          target_share=1 / (plan.context_parallel * plan.pipeline_parallel),
                          metric_names=objective.metric_names,
                          metric_sums=objective.metric_sums, metrics=objective.metrics,
                          prepare=partial(objective.prepare_step, dataset=data.eval))
    meter = StepMeter(cfg.logging_steps, data.total_steps, env, run.peak_flops, plan.compile)
    store = run.where if isinstance(run.where, StorePath) else None
    metrics = MetricsLog(run.output_dir / "metrics.jsonl", data.total_steps, env.is_main, start, plan.compile,
                         open_trackers(cfg, plan, start, env.is_main, store))  # report_to's, on rank 0
    run.checkpoints.on_published = metrics.trackers.checkpoint_published
    profiler = StepProfiler(cfg.profile_steps, run.output_dir, env.rank, env.device)
    run_info = checkpoint_info(cfg, env, plan, data.batches, data.chat_template)
    times = StepTimes(env, run.places, cfg.straggler_threshold, cfg.straggler_intervals)
    hang = HangWatchdog(cfg.hang_timeout, cfg.ddp_timeout, run.output_dir, env, run.places, start_step=start)
    nonfinite = NonFiniteSteps(cfg.on_nonfinite, cfg.max_nonfinite_skips, env, run.places,
                               sample_ids(data.batches, data.train, data.dims.data_rank_of),
                               run.progress.nonfinite_skipped, run.checkpoints.close)
    return Watch(evaluator, meter, metrics, profiler, run_info, times, hang, nonfinite, float(data.dims.owns_loss))


# -- after the step: metrics, logs, evaluation, the checkpoint schedule, the stragglers' and hang watches ----------

def after_step(run: Run, watch: Watch, step: StepDone, done: int) -> None:
    """What follows optimizer step `done` (1-based). Collective order, the same on every rank: the loss's all-reduce,
    at a logging interval the step times' and non-finite marks' all-gathers, evaluation where due, the checkpoint
    where due."""
    faults.after_step(done, run.env.rank)
    watch.hang.at(done, "summing the step's loss (all-reduce)")
    sums = watch.times.line_up(lambda: all_reduce_sum(torch.cat([step.loss_sum.view(1), step.reported])
                                                      * watch.own_loss))
    watch.meter.add(normalised(sums[0], step.targets), step.tokens, step.flops, counted=step.updated,
                    reported=run.step.objective.metrics(sums[1:], step.targets))
    watch.times.end()
    record = interval_record(run, watch, step, done)
    if watch.evaluator.due(done):
        with watch.hang.paused(f"step {done}: evaluation"):
            record = {"step": done, **record, **watch.evaluator.run(run.step.model)}
    watch.metrics.after_step(done, record)
    run.progress.step, run.progress.epoch = done, step.epoch
    with watch.hang.paused(f"step {done}: checkpoint"):
        run.checkpoints.maybe_save(done, run.state, {**watch.run_info, "epoch": step.epoch},
                                   last=done == run.data.total_steps, before=watch.nonfinite.check)


def interval_record(run: Run, watch: Watch, step: StepDone, done: int) -> dict:
    """The logging interval's record, where step `done` ends one (else empty): the meter's means, the ranks' step
    times compared and their non-finite marks checked (small all-gathers), the steps skipped since the last."""
    batches = run.data.batches
    epoch = step.epoch + (step.step_in_epoch + 1) / batches.steps_in_epoch(step.epoch)
    record = watch.meter.record(done, epoch, step.grad_norm, step.lr)
    if record:
        watch.hang.at(done, "comparing step times (all-gather)")
        watch.nonfinite.check()
        fields, warning = watch.times.interval()
        record.update(fields)
        watch.metrics.note(warning)
        if skipped := watch.nonfinite.skipped_since_record():
            record["nonfinite_skipped"] = skipped
    return record


# -- the end: the last checks, a stop's checkpoint, final/, the summary ------------------------------------------

def finish(run: Run, watch: Watch, stop: StopRequest, stopped_by: int, started: float) -> TrainResult:
    """After the last step, or the step a stop came before: nothing after a non-finite step is saved; a stopped run
    saves what fits its grace period and ends there; a finished one writes final/ (a collective) and its summary."""
    watch.profiler.close()
    watch.nonfinite.check()  # nothing after a non-finite step is saved: no checkpoint, no final/
    if stopped_by:
        save_before_stopping(run, stop, watch.run_info)
    run.checkpoints.close()
    watch.metrics.close()
    if stopped_by:
        return TrainResult(run.step.model, watch.metrics.records, None, stopped_by=stopped_by)
    seconds = time.perf_counter() - started
    final_dir = publish_trained_model(run, watch.run_info) if run.cfg.save_final else None
    if run.env.is_main:
        if run.cfg.plot_loss:
            plot_losses(watch.metrics.records, run.output_dir / "loss.png")
        logger.info(summary(watch.metrics.records, seconds, watch.meter.total_tokens, final_dir, run.env.world_size))
    return TrainResult(run.step.model, watch.metrics.records, final_dir)


def publish_trained_model(run: Run, run_info: dict) -> Path:
    """final/: the trained weights gathered (a collective: full tensors on rank 0, from every stage under
    pipeline_parallel), written by rank 0 and published whole."""
    cfg, env, model, mesh = run.cfg, run.env, run.step.model, run.built.pipeline
    weights = (gather_state_dict(model, trainable_only=cfg.is_lora) if mesh is None else
               gather_stage_weights(model, mesh, trainable_only=cfg.is_lora))
    # under pipeline_parallel rank 0 holds the first stage: the whole model's modules name the tensors
    saving = whole_model(cfg, run.plan) if mesh is not None and env.is_main else model
    store = run.where if isinstance(run.where, StorePath) else None
    return publish_final(run.output_dir, {**run_info, "step": run.progress.step, "epoch": run.progress.epoch},
                         env.rank, lambda staged: save_final(saving, weights, run.data.tokenizer, staged,
                                                             run.data.chat_template),
                         store=store)


BF16_STATE_ROOM = ("; or, for full fine-tuning, master_weights: bf16 (bf16 weights and AdamW moments: 8 bytes a "
                   "parameter of state instead of 16)")
# DPO LoRA 7B on one H100, every block recomputed: a step's peak 18.79 GiB with counter masks, 18.06 with torch's;
# the blocks save the same activations either way (tests/test_cuda_paths.py), so the extra is held while one runs
TORCH_MASKS_ROOM = ("; or lora_dropout_masks: torch (lora_dropout's masks drawn by torch, the recomputed blocks "
                    "checkpointed outside their compiled graph: slower, and a lower peak than counter masks)")


def more_room(cfg: TrainConfig, plan: RunPlan) -> str:
    """What else than the batch, the length and the sharding would make room where the memory fit finds none."""
    room = BF16_STATE_ROOM if fp32_state(cfg) else ""
    if plan.lora_dropout_masks == "counter":
        room += TORCH_MASKS_ROOM
    return room


def fp32_state(cfg: TrainConfig) -> bool:
    """Full fine-tuning with fp32 master weights: its state could take half the memory in bf16."""
    return cfg.finetuning_type == "full" and cfg.master_weights != "bf16"


def last_step(batches: GlobalBatchPlan) -> str:
    """What an epoch's last step trains, when it is not a whole global batch."""
    rows = len(batches.rows(0))
    left = rows % batches.global_batch
    if not left:
        return ""
    if batches.drop_last:
        return f" ({left} of the first epoch's {rows} rows left out: dataloader_drop_last)"
    return f" (the first epoch's last step: the {left} rows left over)"


def save_before_stopping(run: Run, stop: StopRequest, run_info: dict) -> None:
    """Signalled: keep the steps done since the last checkpoint if the grace period leaves time to save them."""
    checkpoints, cfg, progress, total_steps = run.checkpoints, run.cfg, run.progress, run.data.total_steps
    checkpoints.wait()  # an async save in flight is published first
    step, name = progress.step, signal.Signals(stop.signum).name
    if checkpoints.last_step == step:
        fits, saved = False, f"checkpoint-{step} was just written"
    elif not run.shared:
        fits, saved = False, "no checkpoint: output_dir is not shared by all nodes"
    else:
        fits, why = stop.save_fits(cfg.stop_grace_period, checkpoints.last_save_s, run.env.device)
        saved = f"writing checkpoint-{step} ({why})" if fits else f"no checkpoint: {why}"
    logger.info(f"{name} received: stopping after step {step} of {total_steps}; {saved}")
    if fits:
        checkpoints.save(step, run.state, {**run_info, "epoch": progress.epoch}, must_publish=True)
        checkpoints.wait(must_publish=True)
    logger.info(f"stopped by {name} at step {step} of {total_steps}; the same command resumes from the newest "
                f"checkpoint")


def checkpoint_info(cfg: TrainConfig, env: DistEnv, plan: RunPlan, batches: GlobalBatchPlan,
                    chat_template: str | None) -> dict:
    """What manifest.json records besides the files and the epoch: enough to judge a resume before loading, and
    the chat template trained with (None: the tokenizer's own), which `meshtune export` writes with the model."""
    return {"world_size": env.world_size, "processes_per_node": env.local_world_size, "parallel": plan.parallel,
            "finetuning_type": cfg.finetuning_type, "global_batch": batches.global_batch,
            "config_hash": cfg.hash(), "config": cfg.math(), "versions": package_versions(),
            "chat_template": chat_template}


def describe_run(cfg: TrainConfig, plan: RunPlan, output_dir: Path) -> None:
    """config.yaml (the config as given) and run_plan.json (the plan as the run trains with it: built, and measured
    where it measures), written once the run is accepted: a run refused at start (a resume with other values,
    missing data, a bad model, a step that does not fit memory) leaves them describing the run whose checkpoints
    and final/ are there."""
    cfg.write_yaml(output_dir / "config.yaml")
    plan.write(output_dir / "run_plan.json")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_other_ranks() -> None:
    """transformers logs through its own handler, the same lines on every rank: rank 0's stand for them. (meshtune's
    own records and Python warnings reach the console through meshtune.logs' rank filter.)"""
    import transformers

    transformers.logging.set_verbosity_error()


def run(cfg: TrainConfig, keep_model: bool = False) -> TrainResult:
    """`meshtune train` inside one worker process, closing the process group on the way out.

    The wrapped model, its optimizer and FSDP2's mesh hold references to the process group: they are freed while
    the group is alive, and all ranks leave together, so no gloo thread is torn down at interpreter exit (a worker
    started by the CLI also skips interpreter finalisation, see launch/supervise.leave_worker).
    """
    try:
        with libraries_frozen():
            result = train(cfg)
            if not keep_model:
                result.model = None
            gc.collect()
        barrier()
        return result
    finally:
        shutdown()
