"""The data-parallel mode a job runs: `auto` made concrete by the rules of [Choosing `parallel`], the others passed
through but for the two that cannot do what they say; the doctor asks the same."""

from __future__ import annotations

from collections.abc import Callable

from meshtune.config import TrainConfig
from meshtune.crossing import ModelSize, qlora_weight_bytes
from meshtune.distributed import DistEnv
from meshtune.plan.memory import full_state_bytes, sharding_for_full, sharding_for_qlora
from meshtune.plan.run_plan import SHARDED

def choose_parallel(cfg: TrainConfig, env: DistEnv, model_size: Callable[[], ModelSize],
                    gpu_bytes: Callable[[], float | None], why: dict[str, str]) -> str:
    mode, reason = parallel_for(cfg, env.world_size, env.local_world_size, env.device.type == "cuda", gpu_bytes,
                                model_size)
    if reason:
        why["parallel"] = reason
    return mode


def parallel_for(cfg: TrainConfig, processes: int, per_node: int, gpus: bool, gpu_bytes: Callable[[], float | None],
                 model_size: Callable[[], ModelSize]) -> tuple[str, str | None]:
    """The parallel mode a job of `processes` (`per_node` a node) runs, and why where meshtune chose it: `auto` made
    concrete (`auto_parallel`); other values pass through, but for two that cannot do what they say, Q-LoRA sharded
    over one process and LoRA under zero2. The doctor asks the same from the nodes' facts."""
    if cfg.finetuning_type == "qlora" and processes == 1 and cfg.parallel in SHARDED:
        return "ddp", (f"{cfg.parallel} on one process: nothing to shard (and torchao's NF4 weights cannot be "
                       f"sharded over one)")
    if cfg.finetuning_type == "lora" and cfg.parallel == "zero2":
        return "ddp", ("zero2 with LoRA runs as ddp: ZeRO-2 shards gradients and optimizer state, which LoRA has "
                       "for its adapters only, and never the weights (DeepSpeed's ZeRO-2 keeps the frozen base "
                       "whole on every GPU too), while FSDP2 would gather the whole base again every step")
    if cfg.parallel != "auto":
        return cfg.parallel, None
    mode, reason = auto_parallel(cfg, processes, per_node, gpus, gpu_bytes, model_size)
    return mode, f"auto: {reason}"


def auto_parallel(cfg: TrainConfig, processes: int, per_node: int, gpus: bool, gpu_bytes: Callable[[], float],
                  model_size: Callable[[], ModelSize]) -> tuple[str, str]:
    """The mode `parallel: auto` picks, and why; the doctor asks the same from the nodes' facts.

    LoRA trains a few million parameters: ddp all-reduces only theirs and keeps the frozen base in bf16. Full
    fine-tuning on one node: zero2 reduce-scatters the gradients and steps the optimizer on a shard, at a fraction of
    ddp's memory; zero3 where zero2's whole weights would not leave room (`sharding_for_full`). Across nodes the
    network is the slow link: hsdp shards inside each node and replicates across nodes, so only the gradients'
    all-reduce crosses it, once an optimizer step, overlapping backward; zero3 over every process only when one
    node's GPUs cannot hold the model's state. Q-LoRA shards its 4-bit model only where a GPU could not hold it
    whole (`sharding_for_qlora`), inside a node first."""
    nodes = max(processes // max(per_node, 1), 1)
    if cfg.finetuning_type == "qlora" and processes > 1 and gpus:
        mode, reason = sharding_for_qlora(model_size(), processes, gpu_bytes())
        node_share = qlora_weight_bytes(model_size()) / per_node
        if mode == "zero3" and nodes > 1 and per_node > 1 and node_share <= 0.5 * gpu_bytes():
            return "hsdp", (f"{reason}; on {nodes} nodes hsdp shards it over each node's {per_node} GPUs instead, so "
                            f"only the adapters' gradients cross the network")
        return mode, reason
    if cfg.is_lora:
        return "ddp", "LoRA: only the adapters' gradients are all-reduced"
    if processes == 1:
        return "ddp", "one process"
    if not gpus:
        return "ddp", "CPU processes"
    n_params = model_size().parameters
    if nodes == 1:
        return sharding_for_full(cfg, n_params, processes, gpu_bytes())
    share = full_state_bytes(cfg, n_params, per_node, whole_weights=False)
    if per_node == 1 and share <= 0.5 * gpu_bytes():
        return "ddp", (f"full fine-tuning on {nodes} nodes of one GPU: each holds the whole model "
                       f"({share / 2**30:.1f} GiB of state of {gpu_bytes() / 2**30:.0f} GiB), so only the gradients' "
                       f"all-reduce crosses the network, overlapping backward")
    if per_node > 1 and share <= 0.5 * gpu_bytes():
        return "hsdp", (f"full fine-tuning on {nodes} nodes x {per_node} GPUs: hsdp shards the model over each node's "
                        f"GPUs ({share / 2**30:.1f} GiB of state per GPU of {gpu_bytes() / 2**30:.0f} GiB) and "
                        f"replicates it across nodes, so only the gradients' all-reduce crosses the network")
    mode, reason = sharding_for_full(cfg, n_params, processes, gpu_bytes())
    if per_node > 1:
        reason += (f"; one node's {per_node} GPUs cannot hold the model's state for hsdp "
                   f"({share / 2**30:.1f} GiB each)")
    return mode, reason
