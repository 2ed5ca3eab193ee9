"""How gradients cross the processes: DDP's buckets or one flat all-reduce, their dtype, PowerSGD, and FSDP2's
explicit prefetch."""

from __future__ import annotations

from meshtune.config import TrainConfig
from meshtune.errors import ConfigError
from meshtune.plan.levers import give_way
from meshtune.plan.run_plan import SHARDED, Layout


def resolve_sync(cfg: TrainConfig, layout: Layout, why: dict[str, str]) -> dict:
    """`grad_sync`, `grad_reduce_dtype`, `powersgd_rank` and `fsdp_prefetch` as the layout runs them."""
    grad_sync, reduce_dtype = gradient_crossing(cfg, layout.procs.world_size, layout.parallel, why)
    grad_sync = give_way("grad_sync", grad_sync, cfg, layout, why)
    powersgd = powersgd_rank(cfg, layout.parallel, layout.procs.world_size, why)
    prefetch = cfg.fsdp_prefetch if layout.parallel in SHARDED else None
    if prefetch is None and cfg.fsdp_prefetch:
        why["fsdp_prefetch"] = "ddp: no FSDP2 units to gather ahead"
    return dict(grad_sync=grad_sync, grad_reduce_dtype=reduce_dtype, powersgd_rank=powersgd, fsdp_prefetch=prefetch)


def gradient_crossing(cfg: TrainConfig, world_size: int, parallel: str, why: dict[str, str]
                      ) -> tuple[str | None, str | None]:
    """How gradients cross the processes (`grad_sync`: DDP's buckets or one flat all-reduce, for ddp; FSDP2
    reduce-scatters by itself) and in which dtype; under ddp on one process nothing crosses, so neither applies."""
    if parallel == "ddp" and world_size == 1:
        if cfg.grad_sync == "flat" or cfg.grad_reduce_dtype == "bf16":
            why["grad_sync"] = why["grad_reduce_dtype"] = "one process: no gradient crosses processes"
        return None, None
    if parallel != "ddp" and cfg.grad_sync == "flat":
        why["grad_sync"] = f"{parallel}: FSDP2 reduce-scatters the gradients itself; flat is for ddp"
    return (cfg.grad_sync if parallel == "ddp" else None), cfg.grad_reduce_dtype


def powersgd_rank(cfg: TrainConfig, parallel: str, world_size: int, why: dict[str, str]) -> int:
    """`powersgd_rank`, where DDP's buckets cross the processes: ddp on several of them."""
    if not cfg.powersgd_rank:
        return 0
    if parallel != "ddp":
        raise ConfigError(f"powersgd_rank: {cfg.powersgd_rank} compresses DDP's gradient buckets; this run is "
                          f"parallel {parallel} (FSDP2 reduce-scatters its own): set parallel: ddp, or drop "
                          f"powersgd_rank")
    if world_size == 1:
        why["powersgd_rank"] = "one process: no gradient crosses processes"
        return 0
    why["powersgd_rank"] = (f"{cfg.powersgd_rank}: DDP's buckets cross as PowerSGD's rank-{cfg.powersgd_rank} "
                            f"factors, with error feedback (approximate)")
    return cfg.powersgd_rank
