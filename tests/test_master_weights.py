"""master_weights: bf16 — full fine-tuning with bf16 weights, gradients and AdamW moments, updated with stochastic
rounding: each update is torch's AdamW in fp32 rounded either way, small updates survive on average, the random bits
are uniform and fixed by (seed, step, parameter, element), training tracks the fp32 path and resumes exactly. The
CUDA kernel is checked against this reference in test_cuda_paths.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import base_config, read_metrics, write_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.model.parallel import unwrap
from meshtune.train.loop import run
from ranks import run_meshtune_ranks
from meshtune.train.bf16_adamw import StochasticBf16AdamW
from meshtune.train.bf16_adamw_reference import mix32, random_16bit, round_to_bf16_stochastically, step_key


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_stochastic_rounding_keeps_updates_below_bf16_resolution():
    """Ten AdamW steps of about 1e-4 each on weights of 1.0: round-to-nearest bf16 (spacing 2^-8 above 1, 2^-9
    below) drops every one of them; stochastic rounding moves the weights by about 1e-3 on average."""
    steps, lr = 10, 1e-4
    rounded = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    stochastic = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([rounded], lr=lr, weight_decay=0.0)
    ours = StochasticBf16AdamW([{"params": [stochastic], "weight_decay": 0.0}], lr)
    for _ in range(steps):
        for p, optimizer in ((rounded, plain), (stochastic, ours)):
            p.grad = torch.ones_like(p)
            optimizer.step()
    assert torch.equal(rounded, torch.ones_like(rounded))  # every update lost
    assert stochastic.dtype == torch.bfloat16
    assert stochastic.float().mean().item() == pytest.approx(1 - steps * lr, abs=2e-4)
    assert ours.state[stochastic]["exp_avg"].dtype == torch.bfloat16  # the moments are bf16 too: 8 bytes a weight


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


def test_each_update_is_torchs_adamw_in_fp32_rounded_to_a_neighbouring_bf16():
    """Three steps with weight decay, from bf16 weights: after each, every weight is one of the two bf16 values
    around what torch's AdamW computes in fp32 from the same weights, gradients and (bf16) moments."""
    torch.manual_seed(0)
    ours_p = torch.nn.Parameter((torch.randn(64, 33) * 0.02).bfloat16())
    ours = StochasticBf16AdamW([{"params": [ours_p], "weight_decay": 0.1}], lr=1e-3, seed=3)
    for _ in range(3):
        ours_p.grad = (torch.randn(64, 33) * 1e-2).bfloat16()
        ref_p = torch.nn.Parameter(ours_p.detach().float().clone())
        ref_p.grad = ours_p.grad.float()
        ref = torch.optim.AdamW([ref_p], lr=1e-3, weight_decay=0.1, foreach=False)
        if ours_p in ours.state:  # the moments ours kept, in fp32, and its step count
            state = ours.state[ours_p]
            ref.state[ref_p] = dict(step=state["step"].clone(), exp_avg=state["exp_avg"].float(),
                                    exp_avg_sq=state["exp_avg_sq"].float())
        ref.step()
        ours.step()
        toward_zero = ref_p.detach().view(torch.int32) & -0x10000  # the bf16 neighbours of the exact value
        neighbours = (toward_zero.view(torch.float32), (toward_zero + 0x10000).view(torch.float32))
        assert ((ours_p.float() == neighbours[0]) | (ours_p.float() == neighbours[1])).all()
        assert torch.equal(ours.state[ours_p]["exp_avg"], ref.state[ref_p]["exp_avg"].bfloat16())
        assert torch.equal(ours.state[ours_p]["exp_avg_sq"], ref.state[ref_p]["exp_avg_sq"].bfloat16())


def test_a_large_parameter_updated_in_pieces_is_the_update_at_once(monkeypatch):
    """The reference path steps a parameter over PIECE elements a piece at a time (its fp32 and int64 temporaries a
    piece's, not a whole embedding's): the weights and moments bit for bit those of the update at once, a
    non-contiguous one (a transposed view) at once."""
    from meshtune.train import bf16_adamw_reference

    def stepped(piece: int, transpose: bool = False):
        monkeypatch.setattr(bf16_adamw_reference, "PIECE", piece)
        torch.manual_seed(0)
        weight = (torch.randn(257, 129) * 0.02).bfloat16()
        p = torch.nn.Parameter(weight.t() if transpose else weight)
        opt = StochasticBf16AdamW([{"params": [p], "weight_decay": 0.1}], lr=1e-3, seed=5, kernel=False)
        for _ in range(3):
            p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-2).bfloat16()
            opt.step()
        return p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()

    whole = stepped(1 << 30)
    for piece in (1000, 4096, 257 * 129 - 1):
        assert all(torch.equal(a, b) for a, b in zip(stepped(piece), whole)), piece
    assert all(torch.equal(a, b) for a, b in zip(stepped(1000, transpose=True), stepped(1 << 30, transpose=True)))


def test_the_rounding_bits_are_uniform_and_fixed_by_their_key():
    bits = random_16bit(1 << 16, step_key(7), torch.device("cpu"))
    assert torch.equal(bits, random_16bit(1 << 16, step_key(7), torch.device("cpu")))
    assert not torch.equal(bits, random_16bit(1 << 16, step_key(8), torch.device("cpu")))
    assert bits.min() >= 0 and bits.max() < 1 << 16
    counts = torch.bincount(bits >> 12, minlength=16).float()  # 16 bins of 4,096 expected each
    assert (counts - 4096).abs().max() < 4 * 64  # 4 standard deviations
    assert mix32(0) == 0 and mix32(1) != mix32(2)


def test_stochastic_rounding_rounds_up_with_the_probability_of_the_dropped_fraction():
    value = torch.full((1 << 16,), 1.0 + 2 ** -7 * 0.25)  # a quarter of the way from 1.0 to the next bf16
    rounded = round_to_bf16_stochastically(value, key=12345)
    up = (rounded == torch.tensor(1.0 + 2 ** -7, dtype=torch.bfloat16)).float().mean().item()
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert up == pytest.approx(0.25, abs=0.01)
    negative = round_to_bf16_stochastically(-value, key=12345)
    assert torch.equal(negative, -rounded)  # away from zero, the same draws


@pytest.mark.slow
def test_bf16_master_weights_step_fsdp2_shards_and_track_one_process(tmp_path, tiny_model_dir, tiny_dataset):
    """zero3 on 2 processes: the optimizer updates each rank's local shards (DTensor) and keys each shard's random
    bits by its own element index, so the losses track the one-process run within bf16 rounding, not exactly."""
    common = dict(finetuning_type="full", learning_rate=1e-3, max_steps=4, master_weights="bf16",
                  per_device_train_batch_size=1)
    one = run(build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "one", gradient_accumulation_steps=4,
                                       **common)))
    out = tmp_path / "zero3"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, out, parallel="zero3",
                                                  nproc_per_node=2, gradient_accumulation_steps=2, **common))
    result = run_meshtune_ranks(["train", str(config)], 2, tmp_path / "ranks")
    assert result.returncode == 0, result.stdout[-3000:]
    sharded = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert sharded == pytest.approx([r["loss"] for r in one.records], rel=2e-2)
    assert json.loads((out / "run_plan.json").read_text())["bf16_weights"] is True


def test_bf16_master_weights_are_for_full_fine_tuning(tmp_path):
    with pytest.raises(ConfigError, match="master_weights: bf16 is for full fine-tuning"):
        build_config(dict(model_name_or_path="m", dataset=["d.json"], finetuning_type="lora", master_weights="bf16"))
