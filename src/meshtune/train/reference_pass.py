"""`precompute_ref_log_probs` (stage: dpo): every pair's reference log-probs computed once, before the first step,
then read by each step in place of the reference's forward.

The pass runs the reference the step would run (model/reference.py: the policy with its adapters off, or the frozen
copy placed as the policy is) through the step's own arithmetic (`pair_loss.reference_logps`), in the step's
precision, over the training pairs and the held-out ones. The pairs are sorted by length and cut into batches of
per_device_train_batch_size pairs, dealt round-robin to every data rank of every node (under tensor_parallel a tp
group is one: its processes run each batch together, their rows padded as the step pads them); each rank runs as
many forwards (FSDP2 gathers in each), and one all-reduce of a (pairs, 2) array, where each value has one
contributor, gives every rank every value exactly.

The values are kept beside the tokenized cache (data/reference_logps.py), keyed by the pairs' cache key and the
reference's identity: its model folder's files, the adapters merged into it or the adapter the run starts from, the
precision. A later run, a resumed one or another node reads them instead of computing them: every rank reads its
node's copy, the ranks compare what they read, and where some node's copy is missing or damaged, the values of the
lowest rank that has them are sent to all and that node writes them again; where no rank has them, they are
computed. Under full fine-tuning the frozen copy is built for the pass only and freed before the policy is placed,
or never built when the values are read.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from meshtune.checksums import folder_checksum
from meshtune.config import TrainConfig
from meshtune.data.pipeline import cache_dir
from meshtune.data.reference_logps import WithReference, digest_of, read, values_folder, write
from meshtune.data.split import Subset
from meshtune.distributed import DistEnv, all_reduce_sum, broadcast_from_rank0
from meshtune.model.reference import AdaptersOff, Reference, trainable_flags_kept
from meshtune.plan import RunPlan
from meshtune.train.objectives.pair_loss import collate_pairs, reference_logps
from meshtune.train.sequence_split import row_multiple
from meshtune.units import byte_size

logger = logging.getLogger(__name__)


def reference_is_policy(cfg: TrainConfig) -> bool:
    """LoRA and Q-LoRA without ref_model: the reference is the policy with its adapters off, so the pass needs the
    policy built; otherwise it runs on a frozen copy before the policy exists."""
    return cfg.is_lora and not cfg.ref_model


def reference_identity(cfg: TrainConfig, plan: RunPlan) -> dict:
    """Everything that changes the reference's log-probs of given tokens."""
    identity = {"precision": {"load_dtype": str(plan.load_dtype), "bf16": plan.bf16, "fp16": plan.fp16,
                              "autocast_bf16": plan.autocast_bf16, "fused_loss": plan.fused_loss,
                              "padding_free": plan.padding_free}}
    if reference_is_policy(cfg):
        identity.update(reference="the model with its adapters off", model=str(cfg.model_name_or_path),
                        model_files=folder_checksum(Path(cfg.model_name_or_path)),
                        base_quantized=cfg.finetuning_type == "qlora")
        if cfg.adapter_name_or_path:  # turned off with the run's adapters; kept in the key all the same
            identity.update(adapter_start=cfg.adapter_name_or_path,
                            adapter_start_files=folder_checksum(Path(cfg.adapter_name_or_path)))
        return identity
    folder = cfg.ref_model or cfg.model_name_or_path
    identity.update(reference="a frozen copy", model=str(folder), model_files=folder_checksum(Path(folder)))
    if cfg.ref_model_adapters:
        identity.update(ref_model_adapters=cfg.ref_model_adapters,
                        ref_model_adapters_files=folder_checksum(Path(cfg.ref_model_adapters)))
    return identity


def full_pairs(dataset):
    """The whole tokenized pair set a training or held-out view is part of."""
    return dataset.dataset if isinstance(dataset, Subset) else dataset


@dataclass
class Precomputed:
    """The values of each pair set (by its cache key), and what the run plan says of them."""

    values: dict[str, np.ndarray]
    reason: str

    def attach(self, dataset):
        """The view with its pairs' values (None stays None)."""
        if dataset is None:
            return None
        values = self.values[full_pairs(dataset).cache_key]
        return WithReference(dataset, values[dataset.indices] if isinstance(dataset, Subset) else values)


def gathered(obj) -> list:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def broadcast_values(values: np.ndarray | None, pairs: int, src: int, env: DistEnv) -> np.ndarray:
    tensor = (torch.from_numpy(values).to(env.device) if env.rank == src else
              torch.zeros((pairs, 2), dtype=torch.float32, device=env.device))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src)
    return tensor.cpu().numpy()


def precompute_reference(cfg: TrainConfig, plan: RunPlan, env: DistEnv, pad_id: int, datasets: list,
                         make_reference: Callable[[], Reference], show_progress: bool) -> Precomputed:
    """The reference log-probs of every pair of `datasets` (training and held-out views), read where kept, else
    computed with the reference `make_reference` builds (called once, and only then), and kept."""
    sets = {}
    for dataset in datasets:
        if dataset is not None:
            pairs = full_pairs(dataset)
            sets[pairs.cache_key] = pairs
    identity = broadcast_from_rank0(reference_identity(cfg, plan) if env.is_main else None)
    about = {"reference": identity}
    folders = {key: values_folder(cache_dir(cfg), key, json.dumps(identity, sort_keys=True)) for key in sets}
    values: dict[str, np.ndarray] = {}
    missing: list[str] = []
    notes: list[str] = []
    for key, pairs in sets.items():
        mine, problem = read(folders[key], len(pairs))
        seen = gathered((None if mine is None else digest_of(mine), problem))
        digests = [digest for digest, _ in seen]
        damaged = sorted({f"rank {rank}: {problem}" for rank, (_, problem) in enumerate(seen)
                          if problem and problem != "absent"})
        if all(digest is not None and digest == digests[0] for digest in digests):
            values[key] = mine
            notes.append(f"read from {folders[key]}")
            continue
        if all(digest is None for digest in digests):
            missing.append(key)
            if damaged:
                logger.warning(f"precompute_ref_log_probs: {folders[key]} is damaged ({'; '.join(damaged)}); "
                               f"computing the reference's log-probs again")
            continue
        src = 0 if digests[0] is not None else next(rank for rank, digest in enumerate(digests) if digest)
        values[key] = broadcast_values(mine, len(pairs), src, env)
        if env.is_local_main and digests[env.rank] != digests[src]:
            write(folders[key], values[key], about)
        logger.warning(f"precompute_ref_log_probs: {folders[key]} differs between the nodes or is missing on some "
                       f"({'; '.join(damaged) or 'absent'}); every rank takes rank {src}'s values, and the nodes "
                       f"without them write them again")
        notes.append(f"read from {folders[key]} (rank {src}'s copy)")
    computed = bool(missing)
    if missing:
        began = time.monotonic()
        reference = make_reference()
        for key in missing:
            pairs = sets[key]
            values[key] = reference_pass(reference, pairs, plan, env, pad_id, cfg.per_device_train_batch_size,
                                         show_progress)
            if env.is_local_main:
                write(folders[key], values[key], about)
            notes.append(f"computed for {len(pairs):,} pairs into {folders[key]} ({byte_size(values[key].nbytes)})")
        seconds = time.monotonic() - began
        del reference
        release_memory(env.device)
        logger.info(f"precompute_ref_log_probs: the reference's log-probs of {sum(len(sets[k]) for k in missing):,} "
                    f"pairs computed in {seconds:.1f} s on {env.world_size} process(es)")
    return Precomputed(values, reason(cfg, notes, computed))


def reason(cfg: TrainConfig, notes: list[str], computed: bool) -> str:
    """plan.why's "reference": what was precomputed, where it is kept and what the step holds."""
    if reference_is_policy(cfg):
        held = "the model itself with its adapters off, no copy"
    elif computed:
        held = "the frozen copy was placed for the pass only and freed before the policy: training holds none"
    else:
        held = "no frozen copy is ever placed: the values were read"
    return f"precomputed before the first step ({'; '.join(notes)}); each step reads them; {held}"


@torch.no_grad()
def reference_pass(reference: Reference, pairs, plan: RunPlan, env: DistEnv, pad_id: int, batch_size: int,
                   show_progress: bool) -> np.ndarray:
    """(pairs, 2) float32: each pair's chosen and rejected log-prob sums under `reference`, every data rank's share
    of the batches summed into one array (a value has exactly one contributor, so the sum is exact). Under
    tensor_parallel a tp group's processes run the same batches together, and its first process contributes."""
    order = np.argsort(-np.asarray(pairs.lengths), kind="stable")  # the longest first: memory is found short at once
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    out = torch.zeros((len(pairs), 2), dtype=torch.float32, device=env.device)
    model = reference.policy if isinstance(reference, AdaptersOff) else getattr(reference, "model", None)
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    try:
        with trainable_flags_kept(model) if isinstance(reference, AdaptersOff) else nullcontext():
            forwards(reference, pairs, plan, env, pad_id, chunks, out, show_progress)
    finally:
        if model is not None:
            model.train(was_training)
    contributes = plan.dims(env).counts_batch  # one process of each data rank: its cp x tp group's first
    return all_reduce_sum(out * float(contributes)).cpu().numpy()


def forwards(reference: Reference, pairs, plan: RunPlan, env: DistEnv, pad_id: int, chunks: list[np.ndarray],
             out: torch.Tensor, show_progress: bool) -> None:
    """This data rank's share of the batches: round k takes batch k x data ranks + data rank."""
    data = plan.data_env(env)
    pad_to_multiple = row_multiple(plan.context_parallel, plan.tensor_parallel)
    rounds = -(-len(chunks) // data.world_size)
    for k in tqdm(range(rounds), desc="reference log-probs", unit="batch", disable=not show_progress):
        c = k * data.world_size + data.rank
        mine = chunks[min(c, len(chunks) - 1)]  # past the end: a forward like the others', its values unused
        batch = collate_pairs([[int(i)] for i in mine], pairs, pad_id, plan.padding_free,
                              pad_to_multiple).to(env.device)
        logps = reference_logps(reference, batch, env.device, plan.autocast_bf16, plan.fp16, plan.fused_loss)
        if c < len(chunks):
            index = torch.from_numpy(np.asarray(mine, dtype=np.int64)).to(env.device)
            out[index, 0] = logps[:len(mine)]
            out[index, 1] = logps[len(mine):]


def release_memory(device: torch.device) -> None:
    """The pass's reference and its activations gone before the policy (or its optimizer) takes the memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
