"""Topology does not change the math: the same global batch split as 1x4, 2x2 and 4x1 (processes x
accumulation) under ddp, zero2 and zero3 (and hsdp on a 2x2 mesh, ddp with the flat gradient sync, and
padding-free token-balanced micro-batches), full and LoRA, gives the same losses, through the real CLI and
torchrun. Each run starts its own processes (most of its time), so the matrix runs each distinct combination
once (see LAYOUTS_BY_MODE)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import base_config, read_metrics, write_config
from meshtune.cli import main
from ranks import run_workers

# (parallel, nproc_per_node, gradient_accumulation_steps, extra keys) against ddp 1x4 (one process, no wrapper):
# global batch 8 in each. What a layout exercises: 1x4 FSDP2 on a one-process mesh with accumulation; 2x2 the
# gradient sync skipped on the first micro-step and done on the second, across 2 ranks; 4x1 sharding / reduction
# over 4 ranks, and an evaluation in which three ranks see padding only. zero2 and zero3 are one fully_shard call
# that differs only in reshard_after_forward (zero3 gathers every unit again for backward), so:
# - ddp runs 2x2 and 4x1 (its own bucketed all-reduce and no_sync);
# - zero3, the mode that re-gathers, runs every layout: 1x4, 2x2, and 4x1 with padding-free micro-batches;
# - zero2 runs 2x2: sharding without the re-gather, under accumulation. Its 1x4 and 4x1 would repeat what zero3's
#   1x4 and 4x1 prove about the one-process mesh and the 4-way sharding;
# - hsdp runs its 2 replicas x 2 shards mesh (4x2, one sample a micro-step);
# - under accumulation zero3 reduce-scatters every micro-step, zero2 and ddp reduce on the last only (the run plan's
#   gradient_reduction on CPU);
# - ddp 2x2 with the flat gradient sync and padding-free micro-batches.
# The padded micro-batches on 4 ranks are those of ddp 4x1 and hsdp 4x1; padding-free, those of zero3 4x1.
LAYOUTS_BY_MODE = [
    ("ddp", 2, 2, {}),
    ("ddp", 4, 1, {}),
    ("zero2", 2, 2, {}),
    ("zero3", 1, 4, {}),
    ("zero3", 2, 2, {}),
    ("zero3", 4, 1, {"padding_free": True}),
    # 4 processes as 2 replicas x 2 shards (what 2 nodes x 2 GPUs would be), under accumulation: reduce-scattered
    # inside each replica on both micro-steps, all-reduced across the replicas on the second only
    ("hsdp", 4, 2, {"hsdp_shard_size": 2, "per_device_train_batch_size": 1}),
    ("ddp", 2, 2, {"grad_sync": "flat", "padding_free": True}),  # the speed levers across processes
]


RUNS: dict[tuple, list[float]] = {}  # a layout two tests compare against runs once per session
# Runs in flight at once. Most of a run is single-threaded: the launcher's and torchrun's start-up, then each
# worker importing torch; two runs side by side keep both cores busy. Each run is its own job (own output_dir,
# free port, processes); the tokenized cache they share is built under a file lock. The losses do not depend on
# it: gloo on CPU, and each process has the intra-op threads it would have alone.
PARALLEL_RUNS = 2


def run_key(model_dir, dataset, method, parallel, nproc, accumulation, **extra) -> tuple:
    return (str(model_dir), str(dataset), method, parallel, nproc, accumulation, tuple(sorted(extra.items())))


def train_all(tmp_path, model_dir, dataset, runs: list[tuple[str, str, int, int, dict]]) -> None:
    """Runs the (method, parallel, nproc, accumulation, extra) not yet in RUNS: those that start torchrun
    PARALLEL_RUNS at a time, the ones with the most processes first; meanwhile the one-process runs here, in this
    thread (they train in this process: see _train_losses)."""
    todo = {run_key(model_dir, dataset, m, p, n, a, **e): (m, p, n, a, e) for m, p, n, a, e in runs}
    todo = sorted((spec for key, spec in todo.items() if key not in RUNS), key=lambda spec: -spec[2])
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        futures = {run_key(model_dir, dataset, m, p, n, a, **e): pool.submit(
            _train_losses, tmp_path, model_dir, dataset, m, p, n, a, **e) for m, p, n, a, e in todo if n > 1}
        for m, p, n, a, e in todo:
            if n == 1:
                RUNS[run_key(model_dir, dataset, m, p, n, a, **e)] = _train_losses(tmp_path, model_dir, dataset, m,
                                                                                   p, n, a, **e)
        for key, future in futures.items():
            RUNS[key] = future.result()


def train_losses(tmp_path, model_dir, dataset, method, parallel, nproc, accumulation, **extra) -> list[float]:
    """Per-step losses, then the final eval loss (6 held-out samples: with 4 ranks, three evaluate padding only).
    No final/ is written: only the metrics are compared (test_export checks final/)."""
    key = run_key(model_dir, dataset, method, parallel, nproc, accumulation, **extra)
    if key not in RUNS:
        RUNS[key] = _train_losses(tmp_path, model_dir, dataset, method, parallel, nproc, accumulation, **extra)
    return RUNS[key]


def _train_losses(tmp_path, model_dir, dataset, method, parallel, nproc, accumulation, **extra) -> list[float]:
    out = tmp_path / "-".join([method, parallel, f"{nproc}x{accumulation}", *(f"{k}{v}" for k, v in extra.items())])
    out.mkdir()
    values = base_config(model_dir, dataset, out / "output", finetuning_type=method, parallel=parallel,
                         nproc_per_node=nproc, per_device_train_batch_size=2,
                         gradient_accumulation_steps=accumulation, tokenized_path=str(tmp_path / "tokenized"),
                         learning_rate=5e-3 if method == "lora" else 1e-3, val_size=6,
                         per_device_eval_batch_size=2, save_final=False)
    values.update(extra)
    config = str(write_config(out, **values))
    if nproc == 1:  # `meshtune train` trains in its own process, which may as well be this one: no start-up
        assert main(["train", config]) == 0
    else:  # the ranks torchrun would start, forked from a process that has imported the training code
        codes, output = run_workers(["train", config], nproc, out / "ranks", timeout=300)
        assert codes == [0] * nproc, output[-6000:]
    records = read_metrics(out / "output")
    steps = values["max_steps"] if values["max_steps"] > 0 else len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return [r["loss"] for r in records] + [records[-1]["eval_loss"]]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_same_losses_for_every_layout_and_mode(tmp_path, tiny_model_dir, tiny_dataset, method):
    train_all(tmp_path, tiny_model_dir, tiny_dataset,
              [(method, "ddp", 1, 4, {}), *((method, p, n, a, e) for p, n, a, e in LAYOUTS_BY_MODE)])
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, "ddp", 1, 4)
    assert reference[4] < reference[0], f"the loss should fall over 5 steps: {reference}"
    for parallel, nproc, accumulation, extra in LAYOUTS_BY_MODE:
        losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, parallel, nproc, accumulation, **extra)
        assert_close(losses, reference, f"{method} {parallel} {nproc}x{accumulation} {extra}")


def assert_close(losses: list[float], reference: list[float], what: str) -> None:
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        name = f"step {step} loss" if step < len(reference) else "final eval loss"
        assert abs(got - want) / abs(want) < 1e-4, f"{what}: {name} {got} vs 1x4 ddp {want}"


@pytest.mark.slow
def test_bf16_gradient_reduction_stays_close_to_fp32_and_is_not_a_no_op(tmp_path, tiny_model_dir, tiny_dataset):
    """grad_reduce_dtype: bf16 under ddp (torch's bf16 compression hook), the flat sync and FSDP2's reduce-scatter:
    the losses follow the fp32 reduction's closely, and differ from them (the gradients did travel in bf16)."""
    reduced = (("ddp", {}), ("ddp", {"grad_sync": "flat"}), ("zero2", {}))
    train_all(tmp_path, tiny_model_dir, tiny_dataset, [("full", "ddp", 2, 2, {}), *(
        ("full", parallel, 2, 2, {"grad_reduce_dtype": "bf16", **extra}) for parallel, extra in reduced)])
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", "ddp", 2, 2)
    for parallel, extra in reduced:
        losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", parallel, 2, 2,
                              grad_reduce_dtype="bf16", **extra)
        what = f"{parallel} {extra} bf16 reduce"
        assert losses[0] == reference[0], f"{what}: step 1 runs before any reduction"
        assert all(abs(a - b) / abs(b) < 2e-2 for a, b in zip(losses, reference)), f"{what}: {losses} vs {reference}"
        assert losses[1:] != reference[1:], f"{what}: identical to the fp32 reduction"


@pytest.mark.slow
def test_modules_trained_in_full_keep_the_losses_across_layouts(tmp_path, tiny_model_dir, tiny_dataset):
    """additional_target: the embedding's and head's trainable copies are replicated (ddp, rank 0's broadcast) or
    sharded (zero3) like any parameter, and the fused loss trains the head's copy the same on every layout."""
    extra = {"additional_target": "embed_tokens,lm_head"}
    layouts = [("ddp", 1, 4), ("ddp", 2, 2), ("zero3", 2, 2)]
    train_all(tmp_path, tiny_model_dir, tiny_dataset, [("lora", p, n, a, extra) for p, n, a in layouts])
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "lora", "ddp", 1, 4, **extra)
    assert reference != train_losses(tmp_path, tiny_model_dir, tiny_dataset, "lora", "ddp", 1, 4)
    for parallel, nproc, accumulation in layouts[1:]:
        losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "lora", parallel, nproc, accumulation, **extra)
        assert_close(losses, reference, f"lora with additional_target {parallel} {nproc}x{accumulation}")


@pytest.mark.slow
@pytest.mark.parametrize("parallel, nproc, accumulation, extra", [
    ("hsdp", 4, 2, {"hsdp_shard_size": 2}),  # 2 nodes x 2 GPUs: 2 replicas x 2 shards
    ("ddp", 4, 2, {"padding_free": True}),  # token-balanced slots
    ("ddp", 4, 4, {"tensor_parallel": 2}),  # 2 data ranks of 2: 6 + 4 rows over 3 micro-steps, a filler on the last
])
def test_an_epochs_partial_last_batch_keeps_the_losses_of_one_process(tmp_path, tiny_model_dir, tiny_dataset,
                                                                      parallel, nproc, accumulation, extra):
    """58 samples to train on at a global batch of 16: each epoch's 4th step trains the 10 left over. On 4 ranks x
    2 micro-steps that is 4 + 4 + 2 + 0 rows (padded): the last rank runs two fillers, the second of them the
    micro-step that synchronises the gradients. The loss of the step is still its real tokens' mean, so the losses
    are one process's."""
    epochs = {"max_steps": -1, "num_train_epochs": 2}
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", "ddp", 1, 8, **epochs)
    assert len(reference) == 2 * 4 + 1  # 8 steps and the final evaluation
    losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", parallel, nproc, accumulation, **epochs,
                          **extra)
    assert_close(losses, reference, f"{parallel} {nproc}x{accumulation} {extra} with a partial last batch")


@pytest.mark.slow
def test_a_checkpoint_before_a_partial_step_resumes_on_one_process_with_its_losses(tmp_path, tiny_model_dir,
                                                                                    tiny_dataset):
    """Saved by 4 processes x 2 micro-steps after step 3 of 8, resumed by one process (accumulation 2 -> 8 keeps
    the global batch of 16): steps 4 and 8, each epoch's partial last, train the rows one process trains there."""
    epochs = {"max_steps": -1, "num_train_epochs": 2}
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", "ddp", 1, 8, **epochs)
    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "saved" / "output", finetuning_type="full",
                         nproc_per_node=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         learning_rate=1e-3, tokenized_path=str(tmp_path / "tokenized"), val_size=6,
                         per_device_eval_batch_size=2, save_final=False, save_steps=3, **epochs)
    codes, output = run_workers(["train", str(write_config(tmp_path / "saved", **values))], 4,
                                tmp_path / "saved" / "ranks", timeout=300)
    assert codes == [0] * 4, output[-6000:]
    resumed = tmp_path / "resumed" / "output"
    shutil.copytree(tmp_path / "saved" / "output" / "checkpoint-3", resumed / "checkpoint-3")
    values.update(output_dir=str(resumed), nproc_per_node=1)  # the same run from step 3, on one process
    assert main(["train", str(write_config(tmp_path / "resumed", **values))]) == 0
    first = read_metrics(tmp_path / "saved" / "output")[:3]
    records = first + read_metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert_close([r["loss"] for r in records] + [records[-1]["eval_loss"]], reference,
                 "4 x 2 until step 3, then 1 x 8")


@pytest.mark.slow
def test_two_nodes_of_two_processes_train_the_partial_last_batch_as_one_process(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset):
    """4 ranks told they are 2 nodes of 2 processes (the variables torchrun gives the workers of two nodes; forked,
    as in the tests above: the launchers of such a job are tests/test_faults.py's), under hsdp, one replica a node:
    each epoch's partial 4th step, 10 rows over 4 ranks x 2 micro-steps, gives one process's losses."""
    epochs = {"max_steps": -1, "num_train_epochs": 2}
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", "ddp", 1, 8, **epochs)
    out = tmp_path / "nodes" / "output"
    values = base_config(tiny_model_dir, tiny_dataset, out, finetuning_type="full", parallel="hsdp",
                         hsdp_shard_size=2, nproc_per_node=2, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-3, val_size=6, per_device_eval_batch_size=2,
                         save_final=False, tokenized_path=str(tmp_path / "tokenized"), **epochs)
    codes, output = run_workers(["train", str(write_config(tmp_path / "nodes", **values))], 4,
                                tmp_path / "nodes" / "ranks", timeout=300, per_node=2)
    assert codes == [0] * 4, output[-6000:]
    plan = json.loads((out / "run_plan.json").read_text())
    assert plan["mesh"]["dp_replicate"] == 2 and plan["mesh"]["dp_shard"] == 2, plan["mesh"]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert_close([r["loss"] for r in records] + [records[-1]["eval_loss"]], reference, "2 nodes x 2 processes")
