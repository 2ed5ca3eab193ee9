"""The resume resolver: which checkpoint the run continues, and the accumulation that keeps its global batch on
another world size."""

from __future__ import annotations

from pathlib import Path

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.plan.run_plan import Layout


def resolve_resume(cfg: TrainConfig, env: DistEnv, layout: Layout, manifest: dict | None, resumed_from: Path | None,
                   shared: bool, why: dict[str, str]) -> dict:
    """The checkpoint continued (`resumed_from`, its manifest `manifest`) and the step's accumulation: the config's,
    x the stages of a pipeline the link chose, or what keeps the checkpoint's global batch; checked against
    train_batch_size."""
    dp, pp = layout.dp.world_size, layout.pp
    configured = cfg.gradient_accumulation_steps * (pp if layout.link else 1)
    accumulation = keep_global_batch(cfg, manifest, dp, why, configured)
    if layout.link and pp > 1 and "gradient_accumulation_steps" not in why:
        why["gradient_accumulation_steps"] = (
            f"{cfg.gradient_accumulation_steps} x {pp}: the stages across the nodes leave {dp} pipelines of the "
            f"{env.world_size} processes, each taking {pp} times the micro-batches, so the global batch stays "
            f"{cfg.per_device_train_batch_size * accumulation * dp}")
    check_train_batch_size(cfg, accumulation, dp)
    if reason := resume_reason(cfg, shared, resumed_from):
        why["resume_from_checkpoint"] = reason
    return dict(gradient_accumulation_steps=accumulation, resumed_from=str(resumed_from) if resumed_from else None)


def resume_request(cfg: TrainConfig, shared: bool) -> tuple[bool, Path | None]:
    """Whether the run looks for a checkpoint to continue, and the one it names (None: the newest complete, verified
    one in output_dir, as `auto` asks). Asked before `resolve`: the plan depends on the checkpoint found."""
    if not shared or cfg.resume_from_checkpoint == "none":
        return False, None
    return True, None if cfg.resume_from_checkpoint == "auto" else Path(cfg.resume_from_checkpoint)


def resume_reason(cfg: TrainConfig, shared: bool, resumed_from: Path | None) -> str | None:
    """Why the run continues the checkpoint it does, or none, where meshtune chose it."""
    if not shared:
        return "output_dir is not shared by all nodes (allow_local_checkpoints): no resume"
    if cfg.resume_from_checkpoint != "auto":
        return None
    place = cfg.checkpoint_dir or "output_dir"  # where the checkpoints are: a store's URL names itself
    return (f"auto: the newest complete, verified checkpoint in {place}" if resumed_from else
            f"auto: no complete checkpoint in {place}")


def check_train_batch_size(cfg: TrainConfig, accumulation: int, world_size: int) -> None:
    """`train_batch_size` (DeepSpeed's) is what the user expects the global batch to be: a different one is an error
    before the first step, not a run with another learning dynamic."""
    actual = cfg.per_device_train_batch_size * accumulation * world_size
    if cfg.train_batch_size is not None and cfg.train_batch_size != actual:
        raise ConfigError(
            f"train_batch_size {cfg.train_batch_size} is not the global batch this job makes: "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{accumulation} x {world_size} processes = {actual}; change one of them, or set train_batch_size to "
            f"{actual} (\"auto\" in a DeepSpeed JSON)")


def keep_global_batch(cfg: TrainConfig, manifest: dict | None, world_size: int, why: dict[str, str],
                      configured: int | None = None) -> int:
    """Resuming on another world size: the same global batch (so the same data order and math) through another
    gradient accumulation, or a clear error when no whole number of micro-steps gives it. `configured`: the
    accumulation the plan runs without a checkpoint (default: the config's)."""
    configured = configured or cfg.gradient_accumulation_steps
    saved = (manifest or {}).get("global_batch")
    per_step = cfg.per_device_train_batch_size * world_size
    if not saved or per_step * configured == saved:
        return configured
    if saved % per_step:
        raise ConfigError(
            f"the checkpoint was trained with a global batch of {saved}, which {world_size} processes x "
            f"per_device_train_batch_size {cfg.per_device_train_batch_size} cannot make up; choose a process count "
            f"or batch size that divides {saved}, or resume_from_checkpoint: none to start over")
    accumulation = saved // per_step
    why["gradient_accumulation_steps"] = (
        f"resuming on {world_size} processes: gradient_accumulation_steps {configured} -> {accumulation} "
        f"keeps the checkpoint's global batch of {saved}")
    return accumulation
