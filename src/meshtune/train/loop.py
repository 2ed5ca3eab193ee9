"""The training loop, written out in one place: setup -> train -> save.

Loss of an optimizer step = sum of token losses over its whole global batch / global count of target tokens.
Each micro-step's backward uses that global count (all-reduced before the first forward), times the
data-parallel size because DDP and FSDP2 average gradients. So the split of a global batch across processes
and micro-steps does not change the math.
"""

from __future__ import annotations

import gc
import random
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F

from meshtune.agreement import check_agreement, package_versions
from meshtune.checkpoint import CheckpointManager, read_manifest, training_state
from meshtune.config import TrainConfig
from meshtune.errors import ConfigError
from meshtune.data.collate import IGNORE, collate, to_device
from meshtune.data.pipeline import plan_steps, prepare_datasets
from meshtune.distributed import DistEnv, all_reduce_sum, barrier, init_distributed, shutdown, use_expandable_segments
from meshtune.model.attention import use_varlen, varlen_available
from meshtune.model.export import save_final
from meshtune.model.loading import check_model_dir, count_parameters, load_model, load_tokenizer, model_skeleton
from meshtune.model.lora import add_lora
from meshtune.model.loss_head import install_loss_head, targets_for
from meshtune.model.parallel import (choose_parallel, finish_gradient_sync, gradient_sync, transformer_blocks, unwrap,
                                     wrap_model)
from meshtune.model.qlora import quantize_frozen_linears
from meshtune.model.rank0_weights import check_same_model, full_state, receive_replicated, receive_shards
from meshtune.storage import check_shared_output_dir
from meshtune.train.collection import StepGarbageCollection, default_interval
from meshtune.train.metrics import MetricsLog, peak_memory_gib, plot_losses, summary
from meshtune.train.profiling import StepProfiler
from meshtune.train.schedule import build_scheduler, warmup_steps
from meshtune.train.throughput import FlopCounter, measure_peak_flops


@dataclass
class TrainResult:
    model: torch.nn.Module | None  # the wrapped (DDP / FSDP2) model after the last step, if kept
    records: list[dict]  # what metrics.jsonl holds (rank 0; empty elsewhere)
    final_dir: Path | None  # None with save_final: false


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over target tokens, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def use_bf16(cfg: TrainConfig, env: DistEnv) -> bool:
    if env.device.type != "cuda":
        return False
    return cfg.bf16 if cfg.bf16 is not None else torch.cuda.is_bf16_supported()


def forward_loss(model, batch, env: DistEnv, autocast_bf16: bool, fused_loss: bool) -> torch.Tensor:
    """Summed token loss of one micro-batch; with `fused_loss` the model's head computes it (model/loss_head.py)."""
    with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        if fused_loss:
            with targets_for(unwrap(model), batch.target_positions, batch.target_ids):
                return model(**batch.model_inputs(), use_cache=False).logits
        logits = model(**batch.model_inputs(), use_cache=False).logits
    return token_loss_sum(logits, batch.targets)


@dataclass(frozen=True)
class FastPath:
    """The speed levers this run uses, resolved from the config and the hardware."""

    padding_free: bool
    fused_loss: bool
    autocast_bf16: bool

    def collate(self, rows, dataset, pad_id: int, packed: bool):
        return collate(rows, dataset, pad_id, packed, padding_free=self.padding_free)

    def loss(self, model, batch, env: DistEnv) -> torch.Tensor:
        return forward_loss(model, batch, env, self.autocast_bf16, self.fused_loss)


@torch.no_grad()
def evaluate(model, dataset, cfg: TrainConfig, env: DistEnv, pad_id: int, fast: FastPath) -> float:
    """Exact mean token loss over the whole eval set, each rank taking its share.

    Every rank runs the same number of forwards (FSDP2 gathers parameters collectively); a rank with nothing
    left runs a batch whose targets are all ignored.
    """
    model.eval()
    per_round = cfg.per_device_eval_batch_size * env.world_size
    sums = torch.zeros(2, dtype=torch.float64, device=env.device)
    for start in range(0, len(dataset), per_round):
        first = start + env.rank * cfg.per_device_eval_batch_size
        mine = list(range(first, min(first + cfg.per_device_eval_batch_size, len(dataset))))
        batch = fast.collate([[i] for i in mine] or [[0]], dataset, pad_id, packed=False)
        if not mine:
            batch.ignore_all()
        loss = fast.loss(model, batch.to(env.device), env)
        sums += torch.stack([loss.double(), torch.tensor(float(batch.num_targets), dtype=torch.float64, device=env.device)])
    all_reduce_sum(sums)
    model.train()
    return (sums[0] / sums[1].clamp(min=1)).item()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor shards included), clipping when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def enable_checkpointing(model: torch.nn.Module, ratio: float = 1.0) -> None:
    """Non-reentrant activation checkpointing of a `ratio` of the blocks, spread evenly (selective by layer, as
    torchtitan): recomputing fewer blocks costs memory and saves time. transformers >= 5.2x renamed the method."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = transformer_blocks(model)
    chosen = {int(i / ratio) for i in range(round(len(blocks) * ratio))}
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i in chosen


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile (dynamo frames, with their inductor compiles)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


class CompileWatch:
    """Says when a step after the first spent real time in torch.compile (a sample length or code path the
    compiled graphs had not met): such a step is slow once, and tokens/s over it is not the steady speed."""

    def __init__(self, seconds=compile_seconds, threshold: float = 0.5, limit: int = 5):
        self.seconds, self.threshold, self.left = seconds, threshold, limit
        self.seen = seconds()

    def after_step(self, step: int) -> str | None:
        now = self.seconds()
        spent, self.seen = now - self.seen, now
        if step <= 1 or spent < self.threshold or not self.left:
            return None
        self.left -= 1
        more = "" if self.left else " (no further notes of this kind)"
        return (f"note: step {step} spent {spent:.1f} s compiling (a new sample length or code path for the compiled "
                f"blocks); its tokens/s is not the steady speed{more}")


def keep_one_graph_for_all_lengths() -> None:
    """Inductor's mix-order reduction (the fused RMSNorm backward that computes the input and weight gradients in one
    kernel, GPU only) decides whether to fuse by the token count with guards: >= 4096 rows, >= 5 MiB, rows >= 2 x
    hidden. Where the norm weights train (full fine-tuning), a step whose token count lands on the other side of one
    of these recompiles the blocks, and the 28 layers' shared frame can reach dynamo's recompile limit and run
    uncompiled from then on. Non-strict mode skips those checks, so no guard is added; the fusion stays."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    # one frame serves every layer: checkpointed forward, recompute, plain forward and eval are separate entries
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 32))


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each transformer block in place (one graph reused by every layer; sample lengths vary,
    so shapes are marked dynamic from the start instead of recompiling).

    Dynamo's DDPOptimizer is switched off: under DDP's forward it would cut every block's graph at DDP's bucket
    boundaries (25 MB, the first 1 MB) and compile the pieces apart. A block is already a natural bucket
    boundary: its backward returns all its gradients at once, and DDP all-reduces them while earlier blocks
    run their backward."""
    torch._dynamo.config.optimize_ddp = False
    keep_one_graph_for_all_lengths()
    for block in transformer_blocks(model):
        block.compile(dynamic=True)


def place_and_wrap(model: torch.nn.Module, cfg: TrainConfig, parallel: str, env: DistEnv, bf16: bool,
                   from_rank0: bool) -> torch.nn.Module:
    """The model on this process's device inside its data-parallel wrapper, holding rank 0's weights where only
    rank 0 read them (the others built it empty)."""
    if from_rank0:
        check_same_model(model, env)
    wrap = partial(wrap_model, parallel=parallel, env=env, bf16=bf16, hsdp_shard_size=cfg.hsdp_shard_size,
                   prefetch=cfg.fsdp_prefetch, grad_sync=cfg.grad_sync, reduce_bf16=cfg.grad_reduce_dtype == "bf16",
                   blocks_per_unit=cfg.fsdp_blocks_per_unit)
    if parallel == "ddp":
        if from_rank0:
            receive_replicated(model, env)
        else:
            model.to(env.device)
        return wrap(model, in_sync=from_rank0)
    # fully_shard moves each block to the GPU as it shards it: the whole model is never on one GPU
    state = full_state(model, env) if from_rank0 else None
    model = wrap(model)
    if from_rank0:
        receive_shards(model, state, env)
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, env: DistEnv):
    """AdamW; like HF, no weight decay on biases and norm weights (1-D tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = cfg.optim == "adamw_torch_fused" or (cfg.optim == "auto" and env.device.type == "cuda")
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)
    return optimizer, params


def quiet_other_ranks(env: DistEnv) -> None:
    """Only global rank 0 prints: library warnings are silenced elsewhere."""
    if not env.is_main:
        import transformers

        warnings.filterwarnings("ignore")
        transformers.logging.set_verbosity_error()


def keep_global_batch(cfg: TrainConfig, manifest: dict, world_size: int, log) -> None:
    """Resuming on another world size: the same global batch (so the same data order and math) through another
    gradient accumulation, or a clear error when no whole number of micro-steps gives it."""
    saved = manifest.get("global_batch")
    if not saved:
        return
    per_step = cfg.per_device_train_batch_size * world_size
    if per_step * cfg.gradient_accumulation_steps == saved:
        return
    if saved % per_step:
        raise ConfigError(
            f"the checkpoint was trained with a global batch of {saved}, which {world_size} processes x "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} cannot make up; choose a process count "
            f"or batch size that divides {saved}, or resume_from_checkpoint: none to start over")
    accumulation = saved // per_step
    log(f"resuming on {world_size} processes: gradient_accumulation_steps {cfg.gradient_accumulation_steps} -> "
        f"{accumulation} keeps the checkpoint's global batch of {saved}")
    cfg.gradient_accumulation_steps = accumulation


def checkpoint_info(cfg: TrainConfig, env: DistEnv, parallel: str, plan, epoch: int, config_hash: str) -> dict:
    """What manifest.json records besides the files: enough to judge a resume before loading anything."""
    return {"epoch": epoch, "world_size": env.world_size, "processes_per_node": env.local_world_size,
            "parallel": parallel, "finetuning_type": cfg.finetuning_type, "global_batch": plan.global_batch,
            "config_hash": config_hash, "versions": package_versions()}


def train(cfg: TrainConfig) -> TrainResult:
    use_expandable_segments(cfg.expandable_segments)  # before the first CUDA allocation
    env = init_distributed(cfg.ddp_timeout)
    quiet_other_ranks(env)
    check_agreement(cfg, env)  # config, versions, data, node ranks: identical everywhere, or stop now
    log = print if env.is_main else (lambda *_: None)
    output_dir = Path(cfg.output_dir)
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        cfg.write_yaml(output_dir / "config.yaml")
        if cfg.bf16 and env.device.type != "cuda":
            log("note: bf16 is ignored on CPU; training in fp32")
    seed_everything(cfg.seed)
    config_hash = cfg.hash()  # before a resume on another world size adjusts the accumulation
    shared = check_shared_output_dir(output_dir, env, cfg.allow_local_checkpoints)
    save_steps = cfg.save_steps if shared else 0
    checkpoints = CheckpointManager(output_dir, cfg.save_total_limit, cfg.async_save, env.rank, env.world_size)
    resume_path, skipped = checkpoints.select_resume(cfg.resume_from_checkpoint if shared else "none")
    for path, reason in skipped:
        log(f"warning: not resuming from {path.name}: {reason}")
    if resume_path:
        manifest = read_manifest(resume_path)
        if manifest.get("config_hash") != config_hash:
            log(f"warning: {resume_path.name} was written with another config (hash {manifest.get('config_hash')}, "
                f"now {config_hash}); resuming anyway. For a new experiment use another output_dir or "
                f"resume_from_checkpoint: none")
        keep_global_batch(cfg, manifest, env.world_size, log)

    # data: tokenized once into the shared cache (other processes wait on its file lock)
    model_dir = check_model_dir(cfg.model_name_or_path)
    tokenizer = load_tokenizer(model_dir)
    train_data, eval_data = prepare_datasets(cfg, tokenizer, show_progress=env.is_main, log=log)
    padding_free = cfg.padding_free if cfg.padding_free is not None else varlen_available(env.device)
    plan, total_steps = plan_steps(cfg, train_data, env.world_size, padding_free)

    # model: fp32 master weights, LoRA (init seeded identically on every rank), then the parallel wrapper
    parallel, why = choose_parallel(cfg.parallel, cfg.is_lora, env, lambda: count_parameters(model_dir))
    if cfg.parallel == "auto":
        log(f"parallel auto: {parallel} ({why})")
    bf16 = use_bf16(cfg, env)
    # LoRA under DDP: frozen base weights in bf16 (only the fp32 adapters are master weights), as PEFT users do
    frozen_bf16 = bf16 and cfg.is_lora and parallel == "ddp"
    dtype = torch.bfloat16 if frozen_bf16 else torch.float32
    # the others build it without weights; Q-LoRA quantizes what each rank loads itself (4-bit weights: no broadcast)
    from_rank0 = env.world_size > 1 and cfg.load_weights_on == "rank0" and cfg.finetuning_type != "qlora"
    model = model_skeleton(model_dir, dtype) if from_rank0 and not env.is_main else load_model(model_dir, dtype)
    flops = FlopCounter.of(model)
    if padding_free:
        use_varlen(model)
    # compiled blocks made Q-LoRA 7B 2.35x faster on an H100 (NF4 dequantization fused into the block's graph)
    compiled = cfg.torch_compile if cfg.torch_compile is not None else env.device.type == "cuda"
    fused_loss = cfg.fused_loss and install_loss_head(model, compiled)
    torch.manual_seed(cfg.seed)
    if cfg.is_lora:
        model = add_lora(model, cfg)
    if cfg.finetuning_type == "qlora":
        count, before, after = quantize_frozen_linears(model, env.device)
        log(f"qlora: {count} frozen linear weights of the transformer blocks in 4-bit NF4 (torchao), "
            f"{before / 2**20:,.1f} MiB -> {after / 2**20:,.1f} MiB" if count else
            "warning: qlora quantized no weight: no block linear layer holds whole NF4 scale groups (64 x 256 "
            "values); this trains as plain LoRA")
    if cfg.gradient_checkpointing:
        enable_checkpointing(model, cfg.gradient_checkpointing_ratio)
    if compiled:
        compile_blocks(model)
    model.config.use_cache = False
    model = place_and_wrap(model, cfg, parallel, env, bf16, from_rank0)
    optimizer, params = build_optimizer(model, cfg, env)
    n_trainable = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    warmup = warmup_steps(total_steps, cfg.warmup_ratio, cfg.warmup_steps)
    scheduler = build_scheduler(optimizer, total_steps, warmup, cfg.lr_scheduler_type)
    fast = FastPath(padding_free, fused_loss, autocast_bf16=bf16 and parallel == "ddp")  # FSDP2 casts itself
    pad_id = tokenizer.pad_token_id
    log(f"{cfg.finetuning_type} on {env.world_size} process(es), {parallel}, {env.device.type}"
        f"{' bf16' if bf16 else ' fp32'}: {total_steps} steps x global batch {plan.global_batch}"
        f"{' packed rows' if cfg.packing else ''}; trainable parameters {n_trainable:,} of "
        f"{n_total:,}")
    levers = [name for name, on in (("padding-free varlen attention", padding_free), ("fused loss", fused_loss),
                                    ("compiled blocks", compiled)) if on]
    log(f"speed levers: {', '.join(levers) or 'none'}")
    peak_flops = measure_peak_flops(env.device) if env.is_main else None
    if peak_flops:
        log(f"MFU is counted against {peak_flops / 1e12:.0f} TFLOP/s, a bf16 matmul measured on this card")

    trainer = {"step": 0}
    state = training_state(model, optimizer, scheduler, trainer, env.rank, trainable_only=cfg.is_lora)
    if resume_path:
        checkpoints.load(resume_path, state)
        log(f"resumed from {resume_path} at step {trainer['step']} of {total_steps}")
    start_step = trainer["step"]

    metrics = MetricsLog(output_dir / "metrics.jsonl", total_steps, True, start_step) if env.is_main else None
    started = time.perf_counter()
    interval_start, interval_tokens, interval_flops, interval_losses = started, 0, 0.0, []
    total_tokens = 0
    model.train()
    profiler = StepProfiler(cfg.profile_steps, output_dir, env.rank, env.device)
    compile_watch = CompileWatch() if compiled and metrics else None  # rank 0 writes the notes
    with StepGarbageCollection(default_interval(cfg.gc_interval, env.world_size)) as collection:
        for step in range(start_step, total_steps):
            profiler.begin(step + 1)
            epoch, step_in_epoch = plan.position(step)
            batches = [fast.collate(rows, train_data, pad_id, cfg.packing)
                       for rows in plan.micro_batches(epoch, step_in_epoch, env.rank)]
            counts = to_device(torch.tensor([sum(b.num_targets for b in batches), sum(b.num_tokens for b in batches),
                                             sum(flops.batch_flops(b.sample_lengths) for b in batches)],
                                            dtype=torch.float64), env.device)
            all_reduce_sum(counts)
            loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
            for m, batch in enumerate(batches):
                with gradient_sync(model, sync=m == len(batches) - 1):
                    loss = fast.loss(model, batch.to(env.device), env)
                    (loss * env.world_size / counts[0]).backward()
                loss_sum += loss.detach().double()
            finish_gradient_sync(model)
            grad_norm = clip_gradients(params, cfg.max_grad_norm)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            interval_losses.append(all_reduce_sum(loss_sum) / counts[0])
            interval_tokens += counts[1]
            interval_flops += counts[2]

            done = step + 1
            log_now = done % cfg.logging_steps == 0 or done == total_steps
            eval_now = eval_data is not None and (done == total_steps or (cfg.eval_steps and done % cfg.eval_steps == 0))
            record = {}
            if log_now:
                tokens = int(interval_tokens)
                seconds = time.perf_counter() - interval_start
                flops_per_gpu = float(interval_flops) / max(seconds, 1e-9) / env.world_size  # FLOP/s
                record = {"step": done, "epoch": round(epoch + (step_in_epoch + 1) / plan.steps_in_epoch(epoch), 4),
                          "loss": torch.stack(interval_losses).mean().item(), "grad_norm": float(grad_norm),
                          "lr": lr,
                          "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                          "tflops_per_gpu": float(f"{flops_per_gpu / 1e12:.4g}"),
                          "peak_mem_gib": round(peak_memory_gib(env.device), 3)}
                if env.device.type == "cuda":  # the caching allocator freed everything and retried: fragmentation
                    record["alloc_retries"] = torch.cuda.memory_stats(env.device).get("num_alloc_retries", 0)
                if compiled:  # seconds spent compiling so far: a step that compiled shows up as a jump
                    record["compile_s"] = round(compile_seconds(), 2)
                if peak_flops:
                    record["mfu"] = round(flops_per_gpu / peak_flops, 4)
                total_tokens += tokens
                interval_start, interval_tokens, interval_flops, interval_losses = time.perf_counter(), 0, 0.0, []
            if eval_now:
                record.setdefault("step", done)
                record["eval_loss"] = evaluate(model, eval_data, cfg, env, pad_id, fast)
            if metrics:
                if record:
                    metrics.write(record)
                note = compile_watch.after_step(done) if compile_watch else None
                if note:
                    metrics.note(note)
                metrics.advance()
            if save_steps and (done % save_steps == 0 or done == total_steps):
                trainer.update(step=done, epoch=epoch)
                checkpoints.save(done, state, checkpoint_info(cfg, env, parallel, plan, epoch, config_hash))
            collection.after_step(done)
            profiler.end(done, last=done == total_steps)
    profiler.close()
    checkpoints.close()
    seconds = time.perf_counter() - started
    if metrics:
        metrics.close()

    final_dir = (save_final(model, tokenizer, output_dir / "final", cfg.is_lora, env)
                 if cfg.save_final else None)
    records = metrics.records if metrics else []
    if env.is_main:
        plot_losses(records, output_dir / "loss.png")
        log(summary(records, seconds, total_tokens, final_dir, env.world_size))
    return TrainResult(model, records, final_dir)


def run(cfg: TrainConfig, keep_model: bool = False) -> TrainResult:
    """`meshtune train` inside one worker process, closing the process group on the way out.

    The wrapped model, its optimizer and FSDP2's mesh hold references to the process group: they are freed
    while the group is alive, and all ranks leave together, so no gloo thread is torn down at interpreter exit
    (before this, 2 of 15 CPU zero2 runs aborted 'terminate called without an active exception'; after, 0 of 20;
    a worker started by the CLI also skips interpreter finalisation, see launch/supervise.leave_worker).
    """
    try:
        result = train(cfg)
        if not keep_model:
            result.model = None
        gc.collect()
        barrier()
        return result
    finally:
        shutdown()
