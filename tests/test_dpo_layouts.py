"""stage: dpo's math does not depend on the layout, and a resumed run goes on bit for bit: full fine-tuning (the
reference a frozen copy) as one process with 4 micro-steps a step (and padding-free, 2 micro-steps of 2 pairs),
and as 2 processes of 2 micro-steps under zero3 (the reference copy sharded by FSDP2 on the policy's mesh), 9 pairs
an epoch so the last step's single pair leaves one rank a filler micro-batch, and the held-out pairs likewise; then
the 2-process run again from its checkpoint-1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import LLAMAFACTORY_DATA, base_config, read_metrics, write_config
from meshtune.cli import main
from ranks import run_workers


def values(model_dir, out: Path, tokenized: Path, **extra) -> dict:
    extra = {"per_device_train_batch_size": 1, "precompute_ref_log_probs": False, **extra}  # the copy in the step
    return base_config(model_dir, "dpo_en_demo", out, stage="dpo", dataset_dir=str(LLAMAFACTORY_DATA),
                       finetuning_type="full", learning_rate=1e-3, cutoff_len=256, val_size=3,
                       per_device_eval_batch_size=1, max_steps=-1, num_train_epochs=1, eval_strategy="steps",
                       eval_steps=3, tokenized_path=str(tokenized), **extra)


def final_weights(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((output / "final").glob("*.safetensors"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("dpo_layouts")
    tokenized = work / "tokenized"
    one = values(tiny_model_dir, work / "one", tokenized, gradient_accumulation_steps=4, parallel="ddp",
                 nproc_per_node=1)
    assert main(["train", str(write_config(work, **one))]) == 0
    (work / "flat").mkdir()  # padding-free: a micro-batch's pairs end to end in one row, balanced by tokens
    flat = values(tiny_model_dir, work / "flat" / "out", tokenized, gradient_accumulation_steps=2, parallel="ddp",
                  nproc_per_node=1, per_device_train_batch_size=2, padding_free=True)
    assert main(["train", str(write_config(work / "flat", **flat))]) == 0
    (work / "two").mkdir()
    two = values(tiny_model_dir, work / "two" / "out", tokenized, gradient_accumulation_steps=2, parallel="zero3",
                 nproc_per_node=2, save_steps=1)
    config = write_config(work / "two", **two)
    codes, output = run_workers(["train", str(config)], 2, work / "two" / "through", timeout=240)
    assert codes == [0, 0], output[-6000:]
    through, weights = read_metrics(work / "two" / "out"), final_weights(work / "two" / "out")
    for later in ("checkpoint-2", "checkpoint-3", "final"):
        shutil.rmtree(work / "two" / "out" / later)
    codes, resumed_output = run_workers(["train", str(config)], 2, work / "two" / "resumed", timeout=240)
    assert codes == [0, 0] and "resumed from" in resumed_output, resumed_output[-6000:]
    return {"one": read_metrics(work / "one"), "flat": read_metrics(work / "flat" / "out"), "two": through,
            "two_weights": weights,
            "resumed": read_metrics(work / "two" / "out"), "resumed_weights": final_weights(work / "two" / "out"),
            "log": output}


@pytest.mark.slow
def test_two_processes_under_zero3_train_one_processs_losses_and_resume_bit_for_bit(runs):
    one, two = runs["one"], runs["two"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    assert "a frozen copy of" in runs["log"] and "placed as the policy (zero3)" in runs["log"]
    names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    for mine, other in zip(two, one):
        for name in names:
            assert mine[name] == pytest.approx(other[name], rel=1e-4, abs=1e-6), (mine["step"], name)
    assert two[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-4)
    assert two[-1]["rewards/margins"] != 0  # the policy has moved from its reference
    assert [r["loss"] for r in runs["resumed"]] == [r["loss"] for r in two]  # bit for bit
    assert runs["resumed"][-1]["eval_loss"] == two[-1]["eval_loss"]
    assert runs["resumed_weights"] == runs["two_weights"]


@pytest.mark.slow
def test_padding_free_pairs_train_the_padded_runs_losses(runs):
    """Pairs end to end in one row per micro-batch (varlen attention, each sequence's log-prob summed over its own
    span), two pairs a micro-batch: the losses, rewards and held-out loss of one pair a padded row."""
    one, flat = runs["one"], runs["flat"]
    assert [r["step"] for r in flat] == [r["step"] for r in one]
    for mine, other in zip(flat, one):
        for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
            assert mine[name] == pytest.approx(other[name], rel=1e-4, abs=1e-6), (mine["step"], name)
        assert mine["tokens"] == other["tokens"]  # no padding is counted either way
    assert flat[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-4)
