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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from meshtune.checkpoint import CheckpointManager, TrainingProgress, publish_final, training_state
from meshtune.checkpoint.manager import RESUME_COPY
from meshtune.checkpoint.object_store import StorePath, is_url, location
from meshtune.config import TrainConfig
from meshtune.cpu_affinity import apply_cpu_affinity
from meshtune.data.chat_template import serving_chat_template
from meshtune.data.collate import Batch, to_device
from meshtune.data.pipeline import plan_steps, prepare_datasets
from meshtune.data.sampler import GlobalBatchPlan
from meshtune.distributed import DistEnv, all_reduce_sum, barrier, init_distributed, shutdown, use_expandable_segments
from meshtune import faults
from meshtune.hardware import limit_gpu_memory, measure_peak_flops
from meshtune.mailbox import Mailbox
from meshtune.model.build import build_model
from meshtune.model.final_weights import gather_state_dict, save_final
from meshtune.model.flops import FlopCounter
from meshtune.model.loading import model_size
from meshtune.model.model_dir import check_model_dir, load_tokenizer
from meshtune.model.reference import build_reference
from meshtune.model.pipeline_parallel import gather_stage_weights, whole_model
from meshtune.model.parallel import finish_gradient_sync, gradient_sync, settle_gradient_buckets
from meshtune.model.vocab_parallel_loss import vocab_shard
from meshtune.plan import MEASURE, RunPlan, resolve, resume_request
from meshtune.train.agreement import check_agreement, package_versions
from meshtune.train.evaluation import Evaluator
from meshtune.train.garbage_collection import StepGarbageCollection, libraries_frozen
from meshtune.train.hang_watchdog import HangWatchdog, enable_flight_recorder
from meshtune.train.loss_scale import LossScaler
from meshtune.train.memory_fit import fit_run_to_memory, largest_micro_batch
from meshtune.train.metrics import MetricsLog, StepMeter, plot_losses, summary
from meshtune.train.nonfinite import NonFiniteSteps, sample_ids
from meshtune.train.objectives import Objective, normalised
from meshtune.train.objectives.kto import KTOLoss
from meshtune.train.objectives.kto_loss import KTOSettings
from meshtune.train.objectives.pair_loss import PairLoss
from meshtune.train.objectives.preference import PreferenceSettings
from meshtune.train.objectives.token_loss import TokenLoss
from meshtune.train.optimizer import build_optimizer, clip_gradients
from meshtune.train.pipeline_step import PipelineStep
from meshtune.train.preemption import StopRequest
from meshtune.train.reference_pass import precompute_reference, reference_is_policy
from meshtune.train.profiling import StepProfiler
from meshtune.train.schedule import build_scheduler, describe_schedule, warmup_steps
from meshtune.train.sequence_split import SequenceSplit, row_multiple
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
    places = [Place(node, host) for node, host in check_agreement(cfg, env)]  # config, versions, data, node ranks:
    # identical everywhere, or stop now; each rank's node and host for the straggler and hang reports
    output_dir = Path(cfg.output_dir)
    if env.is_main:
        ensure_writable_dir(output_dir, "output_dir")
    seed_everything(cfg.seed)
    where = location(cfg.checkpoint_dir or output_dir)  # an object store is shared by every node by its nature
    shared = isinstance(where, StorePath) or check_shared_output_dir(where, env, cfg.allow_local_checkpoints)
    checkpoints = CheckpointManager(where, cfg.save_total_limit, cfg.async_save, env.rank, env.world_size,
                                    save_steps=cfg.save_steps if shared and cfg.save_strategy == "steps" else 0,
                                    local_rank=env.local_rank, local_world_size=env.local_world_size,
                                    staging=output_dir / RESUME_COPY)  # a resume from a store: the node's copy
    wanted, named = resume_request(cfg, shared)  # auto: the newest complete, verified checkpoint
    if wanted and is_url(cfg.resume_from_checkpoint):
        named = cfg.resume_from_checkpoint
    verify_began = time.monotonic()
    resume_path, manifest, notes = (checkpoints.find_resume(named, cfg.math(), cfg.resume_allow_changed) if wanted
                                    else (None, None, []))
    verify_s = time.monotonic() - verify_began
    for note in notes:
        logger.info(note)
    model_dir = check_model_dir(cfg.model_name_or_path)
    plan = resolve(cfg, env, manifest, lambda: model_size(model_dir), resumed_from=resume_path, shared=shared)

    # data: tokenized once into the shared cache (other processes wait on its file lock)
    tokenizer = load_tokenizer(model_dir)
    # saved with final/ and in every checkpoint
    chat_template = serving_chat_template(tokenizer, cfg.named_template, cfg.default_system)
    train_data, eval_data = prepare_datasets(cfg, tokenizer, show_progress=env.is_main)
    dims = plan.dims(env)  # the run's mesh: which ranks share this process's data
    data = dims.data_env()  # a cp x tp group's, a pipeline's processes take the same micro-batches
    batches, total_steps = plan_steps(cfg, train_data, data.world_size, plan.gradient_accumulation_steps,
                                      plan.padding_free, report=True)
    by_epoch = "epoch" in (cfg.save_strategy, cfg.eval_strategy)
    epoch_ends = batches.epoch_ends(total_steps) if by_epoch else frozenset()
    if shared and cfg.save_strategy == "epoch":
        checkpoints.save_at(epoch_ends)
    precompute = partial(precompute_reference, cfg, plan, env, tokenizer.pad_token_id, [train_data, eval_data],
                         show_progress=env.is_main)
    # a frozen copy's log-probs before the policy exists: the copy is freed before the policy takes the memory
    precomputed = (precompute(lambda: build_reference(cfg, plan, env, None))
                   if plan.precompute_ref_log_probs and not reference_is_policy(cfg) else None)
    built = build_model(cfg, plan, env)
    model, plan = built.model, built.plan  # the plan as built: what the model could not do is off, with why
    if plan.precompute_ref_log_probs and reference_is_policy(cfg):  # the policy with its adapters off
        precomputed = precompute(lambda: build_reference(cfg, plan, env, model))
    if precomputed:
        train_data, eval_data = precomputed.attach(train_data), precomputed.attach(eval_data)
        plan = plan.amended("reference", precomputed.reason)
    logger.info(plan.describe())
    optimizer, params = build_optimizer(model, cfg, plan.fused_adamw)
    warmup = warmup_steps(total_steps, cfg.warmup_ratio, cfg.warmup_steps)
    schedule = (total_steps, warmup, cfg.lr_scheduler_type, cfg.warmup_type, cfg.cos_min_ratio)
    scheduler = build_scheduler(optimizer, *schedule)
    logger.info(describe_schedule(*schedule))
    progress = TrainingProgress()
    state = training_state(model, optimizer, scheduler, progress, env.rank, trainable_only=cfg.is_lora,
                           optimizer_by_name=built.pipeline is not None)  # each stage's groups name other weights
    if resume_path:
        load_began = time.monotonic()
        checkpoints.load(resume_path, state)
        logger.info(f"resumed from {resume_path} at step {progress.step} of {total_steps} "
                    f"(verified in {verify_s:.1f} s, loaded in {time.monotonic() - load_began:.1f} s)")
    scaler = LossScaler(plan.fp16, plan.parallel != "ddp", env.device, progress)  # fp16's loss scale; else no-op
    logger.info(f"{cfg.finetuning_type} on {env.world_size} process(es): {total_steps} steps x global batch "
                f"{batches.global_batch}{' packed rows' if cfg.packing else ''}{last_step(batches)}; trainable "
                f"parameters {sum(p.numel() for p in params):,} of {sum(p.numel() for p in model.parameters()):,}")
    peak_flops = measure_peak_flops(env.device) if env.is_main else None
    if peak_flops:
        logger.info(f"MFU is counted against {peak_flops / 1e12:.0f} TFLOP/s, a bf16 matmul measured on this card")

    pad_id = tokenizer.pad_token_id
    # tensor and context parallel: every process holds an equal share of a row's positions
    row_length_multiple = row_multiple(plan.context_parallel, plan.tensor_parallel)
    objective = build_objective(cfg, plan, env, model, pad_id, row_length_multiple)
    collate_rows = partial(objective.collate, dataset=train_data, packed=cfg.packing)
    # an empty share of a last partial step: the shortest sample, trained on nothing
    filler_rows = [[int(np.argmin(train_data.lengths))]]

    def rows_to_batch(rows: list[list[int]]) -> Batch:
        return collate_rows(rows) if rows else collate_rows(filler_rows).ignore_all()

    split = SequenceSplit(plan.context_parallel, env)  # context parallel: each process's share of the positions
    # pipeline_parallel: this process's stage and torch's schedule over the step's micro-batches
    pipeline = (PipelineStep(built.stages, built.held, built.pipeline, plan, env.device, pad_id, cfg.cutoff_len)
                if built.pipeline is not None else None)
    stages = built.pipeline["pp"].get_group() if built.pipeline is not None else None
    model.train()
    if plan.recompute == MEASURE:  # before the step meter starts
        largest = partial(largest_micro_batch, batches, progress.step, total_steps, data.rank, plan.padding_free)
        ratio, measured = fit_run_to_memory(model, objective, params, optimizer, largest, rows_to_batch,
                                            cfg.memory_budget, cfg.gpu_memory_limit, env.device, split,
                                            more_room=BF16_STATE_ROOM if fp32_state(cfg) else "")
        logger.info(measured)
        plan = plan.amended("gradient_checkpointing", measured, recompute=ratio)
    if progress.step < total_steps:  # DDP: the first step reduces as every later one does (a resume stays exact)
        first = batches.micro_batches(*batches.position(progress.step), data.rank)[0]
        settle_gradient_buckets(model, lambda: objective.loss_sum(rows_to_batch(first).to(env.device)))
    if env.is_main:  # nothing above refused the run: from here on it trains, and output_dir describes it
        describe_run(cfg, plan, output_dir)
    # under pipeline_parallel the last stage holds the loss, and each stage counts the targets: 1 / pp of them each
    evaluator = Evaluator(eval_data, cfg.per_device_eval_batch_size,
                          cfg.eval_steps if cfg.eval_strategy == "steps" else None, total_steps, data,
                          partial(objective.collate, dataset=eval_data, packed=False),
                          pipeline.eval_loss if pipeline is not None else split.around(objective.loss_sum),
                          objective.count, also_at=epoch_ends if cfg.eval_strategy == "epoch" else frozenset(),
                          target_share=1 / (plan.context_parallel * plan.pipeline_parallel),
                          metric_names=objective.metric_names,
                          metric_sums=objective.metric_sums, metrics=objective.metrics,
                          prepare=partial(objective.prepare_step, dataset=eval_data))
    meter = StepMeter(cfg.logging_steps, total_steps, env, peak_flops, plan.compile)
    store = where if isinstance(where, StorePath) else None
    metrics = MetricsLog(output_dir / "metrics.jsonl", total_steps, env.is_main, progress.step, plan.compile,
                         open_trackers(cfg, plan, progress.step, env.is_main, store))  # report_to's, on rank 0
    checkpoints.on_published = metrics.trackers.checkpoint_published
    profiler = StepProfiler(cfg.profile_steps, output_dir, env.rank, env.device)
    run_info = checkpoint_info(cfg, env, plan, batches, chat_template)
    times = StepTimes(env, places, cfg.straggler_threshold, cfg.straggler_intervals)
    watch = HangWatchdog(cfg.hang_timeout, cfg.ddp_timeout, output_dir, env, places, start_step=progress.step)
    nonfinite = NonFiniteSteps(cfg.on_nonfinite, cfg.max_nonfinite_skips, env, places,
                               sample_ids(batches, train_data, dims.data_rank_of),
                               progress.nonfinite_skipped, checkpoints.close)
    own = float(dims.counts_batch)  # 0: another of this data rank's processes counts its batches
    # a cp group's processes each hold the loss of their share of the positions; a tensor-parallel peer, a copy
    own_loss = float(dims.owns_loss)
    # the wrapper averages gradients over data ranks x cp: each cp process's loss is a partial sum of its row's
    reducing = dims.reducing
    started = time.perf_counter()
    stopped_by = 0  # the signal that ends the loop early, if one comes
    with StepGarbageCollection(plan.gc_interval) as collection, watch:
        for step in range(progress.step, total_steps):
            if stopped_by := stop.due():  # a rank was signalled during the previous step
                break
            times.begin()
            watch.at(step + 1, "preparing the batch")
            profiler.begin(step + 1)
            epoch, step_in_epoch = batches.position(step)
            micro_rows = batches.micro_batches(epoch, step_in_epoch, data.rank)
            micro = [rows_to_batch(rows) for rows in micro_rows]
            watch.at(step + 1, "counting the step's tokens (all-reduce)")
            targets, tokens, flops, votes = times.line_up(lambda: step_counts(micro, objective, built.flops, env,
                                                                              stop.vote, own))
            stop.tally(votes)
            watch.at(step + 1, "the objective's pass over the step before its micro-batches")
            objective.prepare_step(batches.step_rows(epoch, step_in_epoch), micro_rows, train_data)
            watch.at(step + 1, "forward and backward, with the gradient reduction")
            loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
            reported = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=env.device)
            if pipeline is not None:  # the schedule runs every micro-batch's forward and backward through the stages
                loss_sum = faults.nan_loss(pipeline.step(micro, targets, reducing, scaler.scale), step + 1, env.rank)
            for m, batch in enumerate(micro if pipeline is None else []):
                with gradient_sync(model, last=m == len(micro) - 1, reduction=plan.gradient_reduction,
                                   keep_gathered=plan.reshard_after_forward is False):
                    with split(batch.to(env.device)) as local:  # forward and backward on this process's share
                        loss = faults.nan_loss(objective.loss_sum(local), step + 1, env.rank)
                        scaler.scale(normalised(loss * reducing, targets)).backward()
                        reported += objective.metric_sums(local)
                loss_sum += loss.detach().double()
            finish_gradient_sync(model)
            watch.at(step + 1, "gradient clipping and optimizer step")
            scaler.unscale(optimizer)
            grad_norm = clip_gradients(params, cfg.max_grad_norm, stages)
            lr = float(optimizer.param_groups[0]["lr"])  # the rate this step used (a tensor in torchao's AdamW)
            # fp16: gradients that overflow are the loss scale's to skip (and the scale lowers), not a fault
            checked_norm = torch.zeros_like(loss_sum) if plan.fp16 else grad_norm
            updated = nonfinite.update_allowed(step + 1, loss_sum, checked_norm)  # stop: marks kept on the device
            if updated and scaler.step(optimizer):  # fp16: not after an overflow
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            done, last = step + 1, step + 1 == total_steps
            faults.after_step(done, env.rank)
            watch.at(done, "summing the step's loss (all-reduce)")
            sums = times.line_up(lambda: all_reduce_sum(torch.cat([loss_sum.view(1), reported]) * own_loss))
            meter.add(normalised(sums[0], targets), tokens, flops, counted=updated,
                      reported=objective.metrics(sums[1:], targets))
            times.end()
            record = meter.record(done, epoch + (step_in_epoch + 1) / batches.steps_in_epoch(epoch), grad_norm, lr)
            if record:  # the ranks compare their step times and non-finite marks (small all-gathers)
                watch.at(done, "comparing step times (all-gather)")
                nonfinite.check()
                fields, warning = times.interval()
                record.update(fields)
                metrics.note(warning)
                if skipped := nonfinite.skipped_since_record():
                    record["nonfinite_skipped"] = skipped
            if evaluator.due(done):
                with watch.paused(f"step {done}: evaluation"):
                    record = {"step": done, **record, **evaluator.run(model)}
            metrics.after_step(done, record)
            progress.step, progress.epoch = done, epoch
            with watch.paused(f"step {done}: checkpoint"):
                checkpoints.maybe_save(done, state, {**run_info, "epoch": epoch}, last=last, before=nonfinite.check)
            collection.after_step(done)
            profiler.end(done, last=last)
            watch.step_done()
    profiler.close()
    nonfinite.check()  # nothing after a non-finite step is saved: no checkpoint, no final/
    if stopped_by:
        save_before_stopping(checkpoints, cfg, env, stop, progress, state, run_info, shared, total_steps)
    checkpoints.close()
    metrics.close()
    if stopped_by:
        return TrainResult(model, metrics.records, None, stopped_by=stopped_by)
    seconds = time.perf_counter() - started

    final_dir = None
    if cfg.save_final:
        # a collective: full tensors on rank 0 (from every stage under pipeline_parallel)
        weights = (gather_state_dict(model, trainable_only=cfg.is_lora) if built.pipeline is None else
                   gather_stage_weights(model, built.pipeline, trainable_only=cfg.is_lora))
        # under pipeline_parallel rank 0 holds the first stage: the whole model's modules name the tensors
        saving = whole_model(cfg, plan) if built.pipeline is not None and env.is_main else model
        final_dir = publish_final(output_dir, {**run_info, "step": progress.step, "epoch": progress.epoch},
                                  env.rank, lambda staged: save_final(saving, weights, tokenizer, staged,
                                                                      chat_template),
                                  store=store)
    if env.is_main:
        if cfg.plot_loss:
            plot_losses(metrics.records, output_dir / "loss.png")
        logger.info(summary(metrics.records, seconds, meter.total_tokens, final_dir, env.world_size))
    return TrainResult(model, metrics.records, final_dir)


BF16_STATE_ROOM = ("; or, for full fine-tuning, master_weights: bf16 (bf16 weights and AdamW moments: 8 bytes a "
                   "parameter of state instead of 16)")


def fp32_state(cfg: TrainConfig) -> bool:
    """Full fine-tuning with fp32 master weights: its state could take half the memory in bf16."""
    return cfg.finetuning_type == "full" and cfg.master_weights != "bf16"


def build_objective(cfg: TrainConfig, plan: RunPlan, env: DistEnv, model: torch.nn.Module, pad_id: int,
                    row_length_multiple: int) -> Objective:
    """What the stage optimises: token cross-entropy (sft, pt), the preference loss of pairs (dpo) or KTO's loss of
    unpaired samples (kto), the last two with their reference built here (model/reference.py), after the policy;
    none for dpo with precompute_ref_log_probs, whose batches bring the reference's log-probs."""
    if plan.precompute_ref_log_probs:
        logger.info(f"pref_loss {cfg.pref_loss}, beta {cfg.pref_beta:g}; reference: its log-probs precomputed")
        return PairLoss(model, env, pad_id, preference_settings(cfg), None, autocast_bf16=plan.autocast_bf16,
                        autocast_fp16=plan.fp16, precomputed=True, fused=plan.fused_loss, vocab=vocab_shard(model),
                        pad_to_multiple=row_length_multiple, padding_free=plan.padding_free)
    if cfg.stage in ("dpo", "kto"):
        reference = build_reference(cfg, plan, env, model)
        described = reference.description if reference else f"none ({cfg.pref_loss} has none)"
        if cfg.stage == "kto":
            logger.info(f"kto, beta {cfg.pref_beta:g}; reference: {described}")
            settings = KTOSettings(cfg.pref_beta, cfg.kto_chosen_weight, cfg.kto_rejected_weight)
            return KTOLoss(model, env, pad_id, autocast_bf16=plan.autocast_bf16, settings=settings,
                           reference=reference, cutoff_len=cfg.cutoff_len, autocast_fp16=plan.fp16,
                           padding_free=plan.padding_free, vocab=vocab_shard(model),
                           pad_to_multiple=row_length_multiple, owns_loss=plan.dims(env).owns_loss)
        logger.info(f"pref_loss {cfg.pref_loss}, beta {cfg.pref_beta:g}; reference: {described}")
        return PairLoss(model, env, pad_id, preference_settings(cfg), reference, autocast_bf16=plan.autocast_bf16,
                        autocast_fp16=plan.fp16, fused=plan.fused_loss, vocab=vocab_shard(model),
                        pad_to_multiple=row_length_multiple, padding_free=plan.padding_free)
    return TokenLoss(model, env, pad_id, autocast_bf16=plan.autocast_bf16, fused_loss=plan.fused_loss,
                     autocast_fp16=plan.fp16, vocab=vocab_shard(model), pad_to_multiple=row_length_multiple,
                     padding_free=plan.padding_free)


def preference_settings(cfg: TrainConfig) -> PreferenceSettings:
    return PreferenceSettings(cfg.pref_loss, cfg.pref_beta, cfg.dpo_label_smoothing, cfg.simpo_gamma, cfg.pref_ftx)


def step_counts(batches: list[Batch], objective: Objective, flops: FlopCounter, env: DistEnv,
                stop_vote: float = 0.0, own: float = 1.0) -> torch.Tensor:
    """The objective's normaliser, tokens, FLOPs of an optimizer step and the ranks voting to stop, summed over all
    ranks in one all-reduce. `own` 0: this rank's batches are those of the first rank of its cp x tp group, which
    counts them (its stop vote still counts)."""
    counts = torch.tensor([own * sum(objective.count(b) for b in batches), own * sum(b.num_tokens for b in batches),
                           own * sum(flops.batch_flops(b.sample_lengths) for b in batches if not b.filler),
                           stop_vote],
                          dtype=torch.float64)
    return all_reduce_sum(to_device(counts, env.device))


def last_step(batches: GlobalBatchPlan) -> str:
    """What an epoch's last step trains, when it is not a whole global batch."""
    rows = len(batches.rows(0))
    left = rows % batches.global_batch
    if not left:
        return ""
    if batches.drop_last:
        return f" ({left} of the first epoch's {rows} rows left out: dataloader_drop_last)"
    return f" (the first epoch's last step: the {left} rows left over)"


def save_before_stopping(checkpoints: CheckpointManager, cfg: TrainConfig, env: DistEnv, stop: StopRequest,
                         progress: TrainingProgress, state: dict, run_info: dict, shared: bool,
                         total_steps: int) -> None:
    """Signalled: keep the steps done since the last checkpoint if the grace period leaves time to save them."""
    checkpoints.wait()  # an async save in flight is published first
    step, name = progress.step, signal.Signals(stop.signum).name
    if checkpoints.last_step == step:
        fits, saved = False, f"checkpoint-{step} was just written"
    elif not shared:
        fits, saved = False, "no checkpoint: output_dir is not shared by all nodes"
    else:
        fits, why = stop.save_fits(cfg.stop_grace_period, checkpoints.last_save_s, env.device)
        saved = f"writing checkpoint-{step} ({why})" if fits else f"no checkpoint: {why}"
    logger.info(f"{name} received: stopping after step {step} of {total_steps}; {saved}")
    if fits:
        checkpoints.save(step, state, {**run_info, "epoch": progress.epoch})
        checkpoints.wait()
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
