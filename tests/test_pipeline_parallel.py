"""Pipeline parallelism: the run plan's mesh, stages and schedule and its refusals (no processes), a stage's blocks
and names (one process), and on gloo ranks the losses of one process, full and LoRA, under pp 2 and pp 2 x dp 2;
checkpoints of pp 2 resumed on one process and the reverse, and final/ the whole model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import base_config, read_metrics, write_config
from meshtune.cli import main
from ranks import run_workers

RUNS: dict[tuple, dict] = {}


def train(workdir, model_dir, dataset, method: str, nproc: int, pp: int, accumulation: int, name: str,
          **extra) -> dict:
    """A run of 4 steps at global batch 8 (2 rows a micro-step); its records, output_dir and plan."""
    out = workdir / name
    out.mkdir()
    values = base_config(model_dir, dataset, out / "output", finetuning_type=method, parallel="ddp",
                         nproc_per_node=nproc, pipeline_parallel=pp, per_device_train_batch_size=2,
                         gradient_accumulation_steps=accumulation, tokenized_path=str(workdir / "tokenized"),
                         learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, save_final=False,
                         max_grad_norm=0.5)
    values.update(extra)
    config = str(write_config(out, **values))
    if nproc == 1:
        assert main(["train", config]) == 0
    else:
        codes, output = run_workers(["train", config], nproc, out / "ranks", timeout=240)
        assert codes == [0] * nproc, output[-6000:]
    plan = json.loads((out / "output" / "run_plan.json").read_text())
    records = read_metrics(out / "output")
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "output": out / "output", "plan": plan}


def assert_same(values: list[float], reference: list[float], what: str) -> None:
    assert len(values) == len(reference), f"{what}: {values} vs {reference}"
    for step, (got, want) in enumerate(zip(values, reference), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step}: {got} vs one process {want}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_pp2_gives_the_losses_and_grad_norms_of_one_process(tmp_path, tiny_model_dir, tiny_dataset, method):
    one = train(tmp_path, tiny_model_dir, tiny_dataset, method, 1, 1, 4, "one")
    assert one["losses"][-1] < one["losses"][0], one["losses"]
    pp2 = train(tmp_path, tiny_model_dir, tiny_dataset, method, 2, 2, 4, "pp2")
    assert pp2["plan"]["mesh"]["pp"] == 2 and pp2["plan"]["pipeline_schedule"] == "1f1b", pp2["plan"]
    assert_same(pp2["losses"], one["losses"], f"{method} pp 2 loss")
    assert_same(pp2["norms"], one["norms"], f"{method} pp 2 grad norm")
