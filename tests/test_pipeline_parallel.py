"""Pipeline parallelism: the run plan's mesh, stages and schedule and its refusals (no processes), a stage's blocks
and names (one process), and on gloo ranks the losses and gradient norms of one process, full and LoRA, under pp 2
and pp 2 x dp 2; a pp 2 checkpoint resumed on one process and one process's on pp 2, and final/ the whole model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_config, read_metrics, write_config
from meshtune.cli import main
from ranks import run_workers


class Jobs:
    """The module's training runs, each run once and shared by the tests that read it."""

    def __init__(self, workdir, model_dir, dataset):
        self.workdir, self.model_dir, self.dataset = workdir, model_dir, dataset
        self.done: dict[str, dict] = {}

    def run(self, name: str, method: str, nproc: int, pp: int, accumulation: int, **extra) -> dict:
        """A run of 4 steps at global batch 8 (2 rows a micro-step): its losses, grad norms, output_dir and plan."""
        if name in self.done:
            return self.done[name]
        out = self.workdir / name
        out.mkdir()
        values = base_config(self.model_dir, self.dataset, out / "output", finetuning_type=method, parallel="ddp",
                             nproc_per_node=nproc, pipeline_parallel=pp, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, tokenized_path=str(self.workdir / "tokenized"),
                             learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, save_final=False,
                             max_grad_norm=0.5)
        values.update(extra)
        config = str(write_config(out, **values))
        if nproc == 1:
            assert main(["train", config]) == 0
        else:
            codes, output = run_workers(["train", config], nproc, out / "ranks", timeout=240)
            assert codes == [0] * nproc, output[-6000:]
        records = read_metrics(out / "output")
        self.done[name] = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                           "output": out / "output", "plan": json.loads((out / "output" / "run_plan.json").read_text())}
        return self.done[name]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_model_dir, tiny_dataset) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("pipeline"), tiny_model_dir, tiny_dataset)


def assert_same(values: list[float], reference: list[float], what: str) -> None:
    assert len(values) == len(reference), f"{what}: {values} vs {reference}"
    for step, (got, want) in enumerate(zip(values, reference), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step}: {got} vs one process {want}"


SAVED = dict(save_steps=2, save_final=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_pp2_gives_the_losses_and_grad_norms_of_one_process(jobs, method):
    one = jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)
    assert one["losses"][-1] < one["losses"][0], one["losses"]
    pp2 = jobs.run(f"pp2-{method}", method, 2, 2, 4, **SAVED)
    assert pp2["plan"]["mesh"]["pp"] == 2 and pp2["plan"]["pipeline_schedule"] == "1f1b", pp2["plan"]
    assert_same(pp2["losses"], one["losses"], f"{method} pp 2 loss")
    # clipped at 0.5: the norm is the whole model's, every stage's gradients in it
    assert_same(pp2["norms"], one["norms"], f"{method} pp 2 grad norm")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_pp2_x_dp2_gives_the_losses_and_grad_norms_of_one_process(jobs, method):
    """4 processes: 2 stages of 2 replicas each, 2 micro-batches a step on each replica (global batch 8)."""
    one = jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)
    pp2_dp2 = jobs.run(f"pp2-dp2-{method}", method, 4, 2, 2)
    plan = pp2_dp2["plan"]
    assert plan["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}, plan["mesh"]
    assert plan["grad_sync"] == "flat" and plan["gradient_accumulation_steps"] == 2
    assert_same(pp2_dp2["losses"], one["losses"], f"{method} pp 2 x dp 2 loss")
    assert_same(pp2_dp2["norms"], one["norms"], f"{method} pp 2 x dp 2 grad norm")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_final_of_pp2_holds_the_whole_model_and_the_adapter_by_their_names(jobs):
    for method, weights in (("full", "model.safetensors"), ("lora", "adapter_model.safetensors")):
        one = load_file(str(jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)["output"] / "final" / weights))
        pp2 = load_file(str(jobs.run(f"pp2-{method}", method, 2, 2, 4, **SAVED)["output"] / "final" / weights))
        assert pp2.keys() == one.keys(), f"{method}: {sorted(set(pp2) ^ set(one))}"
        for name, tensor in one.items():
            torch.testing.assert_close(pp2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pp2_checkpoint_resumes_on_one_process_and_one_process_s_on_pp2(jobs):
    one = jobs.run("one-full", "full", 1, 1, 4, **SAVED)
    pp2 = jobs.run("pp2-full", "full", 2, 2, 4, **SAVED)
    from_pp2 = jobs.run("one-from-pp2", "full", 1, 1, 4, resume_from_checkpoint=str(pp2["output"] / "checkpoint-2"))
    assert from_pp2["plan"]["resumed_from"].endswith("checkpoint-2")
    assert_same(from_pp2["losses"], one["losses"][2:], "pp 2 -> 1 process")
    to_pp2 = jobs.run("pp2-from-one", "full", 2, 2, 4, resume_from_checkpoint=str(one["output"] / "checkpoint-2"))
    assert_same(to_pp2["losses"], one["losses"][2:], "1 process -> pp 2")
