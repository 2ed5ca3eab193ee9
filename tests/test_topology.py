"""Topology does not change the math: the same global batch split as 1x4, 2x2 and 4x1 (processes x
accumulation) under ddp, zero2 and zero3 (and hsdp on a 2x2 mesh, ddp with the flat gradient sync, and
padding-free token-balanced micro-batches), full and LoRA, gives the same losses, through the real CLI and
torchrun."""

from __future__ import annotations

import pytest

from conftest import base_config, read_metrics, run_cli, write_config

LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # (nproc_per_node, gradient_accumulation_steps): global batch 8


RUNS: dict[tuple, list[float]] = {}  # a layout two tests compare against runs once per session


def train_losses(tmp_path, model_dir, dataset, method, parallel, nproc, accumulation, **extra) -> list[float]:
    """Per-step losses, then the final eval loss (6 held-out samples: with 4 ranks, three evaluate padding only).
    No final/ is written: only the metrics are compared (test_export checks final/)."""
    key = (str(model_dir), str(dataset), method, parallel, nproc, accumulation, tuple(sorted(extra.items())))
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
                         per_device_eval_batch_size=2, save_final=False, **extra)
    result, _ = run_cli(["train", str(write_config(out, **values))], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    records = read_metrics(out / "output")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    return [r["loss"] for r in records] + [records[-1]["eval_loss"]]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_same_losses_for_every_layout_and_mode(tmp_path, tiny_model_dir, tiny_dataset, method):
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, "ddp", 1, 4)
    assert reference[4] < reference[0], f"the loss should fall over 5 steps: {reference}"
    for parallel in ["ddp", "zero2", "zero3"]:
        for nproc, accumulation in LAYOUTS:
            if (parallel, nproc) == ("ddp", 1):
                continue
            losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, parallel, nproc, accumulation)
            assert_close(losses, reference, f"{method} {parallel} {nproc}x{accumulation}")
    # hsdp: 4 processes as 2 replicas x 2 shards (what 2 nodes x 2 GPUs would be)
    losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, "hsdp", 4, 1, hsdp_shard_size=2)
    assert_close(losses, reference, f"{method} hsdp 2x2 mesh")
    # the speed levers across processes: token-balanced padding-free micro-batches, and ddp's flat gradient sync
    losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, "ddp", 2, 2, grad_sync="flat",
                          padding_free=True)
    assert_close(losses, reference, f"{method} ddp 2x2 flat gradient sync, padding-free")
    losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, method, "zero3", 4, 1, padding_free=True)
    assert_close(losses, reference, f"{method} zero3 4x1 padding-free")


def assert_close(losses: list[float], reference: list[float], what: str) -> None:
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        name = f"step {step} loss" if step <= 5 else "final eval loss"
        assert abs(got - want) / abs(want) < 1e-4, f"{what}: {name} {got} vs 1x4 ddp {want}"


@pytest.mark.slow
def test_bf16_gradient_reduction_stays_close_to_fp32_and_is_not_a_no_op(tmp_path, tiny_model_dir, tiny_dataset):
    """grad_reduce_dtype: bf16 under ddp (torch's bf16 compression hook), the flat sync and FSDP2's reduce-scatter:
    the losses follow the fp32 reduction's closely, and differ from them (the gradients did travel in bf16)."""
    reference = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", "ddp", 2, 2)
    for parallel, extra in (("ddp", {}), ("ddp", {"grad_sync": "flat"}), ("zero2", {})):
        losses = train_losses(tmp_path, tiny_model_dir, tiny_dataset, "full", parallel, 2, 2,
                              grad_reduce_dtype="bf16", **extra)
        what = f"{parallel} {extra} bf16 reduce"
        assert losses[0] == reference[0], f"{what}: step 1 runs before any reduction"
        assert all(abs(a - b) / abs(b) < 2e-2 for a, b in zip(losses, reference)), f"{what}: {losses} vs {reference}"
        assert losses[1:] != reference[1:], f"{what}: identical to the fp32 reduction"
