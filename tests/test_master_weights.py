"""master_weights: bf16 — full fine-tuning with bf16 weights, gradients and AdamW moments, updated with stochastic
rounding: it tracks the fp32 path, keeps updates below bf16's resolution on average, and resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import base_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.model.parallel import unwrap
from meshtune.train.loop import run
from meshtune.train.optimizer import bf16_adamw

pytest.importorskip("torchao.optim")
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="torchao's AdamW compiles its step with inductor, which needs a C compiler")


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@needs_compiler
def test_stochastic_rounding_keeps_updates_below_bf16_resolution():
    """Ten AdamW steps of about 1e-4 each on weights of 1.0: round-to-nearest bf16 (spacing 2^-8 above 1, 2^-9
    below) drops every one of them; stochastic rounding moves the weights by about 1e-3 on average."""
    steps, lr = 10, 1e-4
    rounded = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    stochastic = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([rounded], lr=lr, weight_decay=0.0)
    ours = bf16_adamw([{"params": [stochastic], "weight_decay": 0.0}], lr, (0.9, 0.999), 1e-8)
    for _ in range(steps):
        for p, optimizer in ((rounded, plain), (stochastic, ours)):
            p.grad = torch.ones_like(p)
            optimizer.step()
    assert torch.equal(rounded, torch.ones_like(rounded))  # every update lost
    assert stochastic.dtype == torch.bfloat16
    assert stochastic.float().mean().item() == pytest.approx(1 - steps * lr, abs=2e-4)
    assert ours.state[stochastic]["exp_avg"].dtype == torch.bfloat16  # the moments are bf16 too: 8 bytes a weight


@needs_compiler
def test_bf16_master_weights_track_the_fp32_path_and_resume_exactly(tmp_path, tiny_model_dir, tiny_dataset):
    common = dict(finetuning_type="full", learning_rate=1e-3, max_steps=6, save_steps=3)
    fp32 = run(build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "fp32", **common)))
    out = tmp_path / "bf16"
    values = base_config(tiny_model_dir, tiny_dataset, out, master_weights="bf16", **common)
    result = run(build_config(values), keep_model=True)
    weights = [p for p in unwrap(result.model).parameters()]
    assert weights and all(p.dtype == torch.bfloat16 for p in weights)
    bf16 = losses(out)
    assert bf16 == pytest.approx([r["loss"] for r in fp32.records], rel=2e-2)  # bf16 compute and weights
    assert json.loads((out / "run_plan.json").read_text())["bf16_weights"] is True

    shutil.rmtree(out / "checkpoint-6")
    shutil.rmtree(out / "final")
    run(build_config(values))
    assert losses(out) == bf16  # steps 4-6 again from checkpoint-3: the rounding's random draws resume too


def test_bf16_master_weights_are_for_full_fine_tuning(tmp_path):
    with pytest.raises(ConfigError, match="master_weights: bf16 is for full fine-tuning"):
        build_config(dict(model_name_or_path="m", dataset=["d.json"], finetuning_type="lora", master_weights="bf16"))
