"""Options that must not change the math: gradient checkpointing and length grouping give the losses of the
plain run; packing trains on rows of several samples; checkpoints and evaluations at the ends of epochs."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import base_config, read_metrics
from meshtune.config import build_config
from meshtune.model.loading import load_model
from meshtune.model.loss_head import LossHead, output_head
from meshtune.train.loop import run


def losses(tmp_path, model_dir, dataset, name, method, **extra) -> list[float]:
    cfg = build_config(base_config(model_dir, dataset, tmp_path / name, finetuning_type=method, learning_rate=1e-3,
                                   max_steps=4, **extra))
    return [r["loss"] for r in run(cfg).records]


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("option", [{"gradient_checkpointing": True}, {"group_by_length": True}])
def test_option_keeps_the_losses(tmp_path, tiny_model_dir, tiny_dataset, method, option):
    plain = losses(tmp_path, tiny_model_dir, tiny_dataset, "plain", method)
    changed = losses(tmp_path, tiny_model_dir, tiny_dataset, "changed", method, **option)
    assert changed == pytest.approx(plain, rel=1e-5)


def test_lora_on_the_output_head_trains_with_the_plain_loss(tmp_path, tiny_model_dir, tiny_dataset, capsys):
    """LoRA on lm_head: peft adds the adapter's logits to the head's output, which the fused loss head would have
    replaced by a scalar loss ('grad can be implicitly created only for scalar outputs'). The head keeps its
    logits, and the run trains as with fused_loss: false."""
    adapted = losses(tmp_path, tiny_model_dir, tiny_dataset, "head", "lora", lora_target=["lm_head", "q_proj"])
    assert "fused_loss: off, lora_target adapts the output head (lm_head)" in capsys.readouterr().out
    plan = json.loads((tmp_path / "head" / "run_plan.json").read_text())  # the plan the run trained with
    assert plan["fused_loss"] is False and "adapts the output head (lm_head)" in plan["why"]["fused_loss"]
    plain = losses(tmp_path, tiny_model_dir, tiny_dataset, "plain", "lora", lora_target=["lm_head", "q_proj"],
                   fused_loss=False)
    assert adapted == pytest.approx(plain, rel=1e-6) and len(adapted) == 4


def test_a_head_the_loss_cannot_fuse_trains_the_plain_loss_and_run_plan_json_says_why(
        monkeypatch, tmp_path, tiny_model_dir, tiny_dataset, capsys):
    """An output head with a bias computes no fused loss: the builder turns fused_loss off once it has the model,
    and run_plan.json (written once the run is accepted) and the plan logged after the build record it, with why."""
    from meshtune.model import build

    def with_biased_head(model_dir, dtype):
        model = load_model(model_dir, dtype)
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
        return model

    monkeypatch.setattr(build, "load_model", with_biased_head)
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=1, save_final=False))
    assert cfg.fused_loss
    result = run(cfg, keep_model=True)
    assert not isinstance(output_head(result.model), LossHead)
    plan = json.loads((tmp_path / "out" / "run_plan.json").read_text())
    assert plan["fused_loss"] is False
    assert plan["why"]["fused_loss"].startswith("the output head is a Linear with a bias, not the bias-free linear")
    assert "fused_loss                   off  (the output head is a Linear with a bias" in capsys.readouterr().out


def test_packing_trains_on_packed_rows(tmp_path, tiny_model_dir, tiny_dataset):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "packed", packing=True, cutoff_len=128,
                                   per_device_train_batch_size=1, max_steps=-1, num_train_epochs=1))
    result = run(cfg)
    tokens = sum(r["tokens"] for r in result.records)
    steps = result.records[-1]["step"]
    # 64 samples of ~55 tokens packed into rows of <=128 tokens: far fewer steps than samples, ~2 samples a row
    assert steps < 64 / 2 * 1.2 and tokens / (steps * 2) > 64, (steps, tokens)
    assert result.records[-1]["loss"] < result.records[0]["loss"]


def test_profile_steps_write_a_trace_and_a_summary(tmp_path, tiny_model_dir, tiny_dataset):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=4, profile_steps="2-9"))
    run(cfg)
    profile = tmp_path / "out" / "profile"
    trace = (profile / "rank0.json").read_text()
    assert '"traceEvents"' in trace and "aten::" in trace
    summary = (profile / "summary.txt").read_text()
    assert summary.startswith("optimizer steps 2-4") and "aten::" in summary  # the window ends with the run


@pytest.mark.parametrize("enabled,user_env,cuda,expected", [
    (True, None, True, ["expandable_segments:True"]),
    (True, "PYTORCH_CUDA_ALLOC_CONF", True, []),  # the user's own allocator settings win
    (True, "PYTORCH_ALLOC_CONF", True, []),
    (False, None, True, []),
    (True, None, False, []),
])
def test_expandable_segments_are_set_unless_turned_off_or_set_by_the_user(monkeypatch, enabled, user_env, cuda,
                                                                           expected):
    import torch

    from meshtune.distributed import ALLOC_CONF_VARS, use_expandable_segments
    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    if user_env:
        monkeypatch.setenv(user_env, "max_split_size_mb:512")
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert use_expandable_segments(enabled) is bool(expected)
    assert calls == expected


def test_save_and_eval_strategy_epoch_act_at_the_end_of_every_epoch(tmp_path, tiny_model_dir, tiny_dataset):
    """64 samples, a quarter held out: 48 to train on, 12 steps an epoch at a global batch of 4; 1.5 epochs end at
    step 18, inside the second epoch, which is saved and evaluated as the last step."""
    out = tmp_path / "out"
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, out, max_steps=-1, num_train_epochs=1.5,
                                   val_size=0.25, save_strategy="epoch", save_steps=5, eval_strategy="epoch",
                                   eval_steps=5, logging_steps=6))
    run(cfg)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-18"]
    assert [r["step"] for r in read_metrics(out) if "eval_loss" in r] == [12, 18]


def test_strategy_keys_read_as_hf_writes_them():
    from meshtune.compat.job_config import load_job_config

    values = ["model_name_or_path=m", "dataset=d.json"]
    cfg = load_job_config(None, values + ["save_strategy=no", "evaluation_strategy=EPOCH"]).config
    assert (cfg.save_strategy, cfg.eval_strategy) == ("no", "epoch")
    assert load_job_config(None, values).config.save_strategy == "steps"


def test_checkpoints_and_evaluations_are_due_at_the_steps_each_strategy_names(tmp_path):
    from meshtune.checkpoint.manager import CheckpointManager
    from meshtune.train.evaluation import Evaluator

    def saved(manager, total):
        steps = []  # (step, must_publish): only the last save may not be skipped when a store fails it
        manager.save = lambda step, state, info, must_publish=False: steps.append((step, must_publish))
        for step in range(1, total + 1):
            manager.maybe_save(step, {}, {}, last=step == total)
        return steps

    assert saved(CheckpointManager(tmp_path, None, False, 0, 1, save_steps=4), 10) == [(4, False), (8, False),
                                                                                        (10, True)]
    by_epoch = CheckpointManager(tmp_path, None, False, 0, 1)
    by_epoch.save_at(frozenset({3, 6}))
    assert saved(by_epoch, 8) == [(3, False), (6, False), (8, True)]
    assert saved(CheckpointManager(tmp_path, None, False, 0, 1), 8) == []
    evaluator = Evaluator(object(), 1, None, 8, None, None, None, None, also_at=frozenset({3, 6}))
    assert [step for step in range(1, 9) if evaluator.due(step)] == [3, 6, 8]
    assert [step for step in range(1, 9) if Evaluator(object(), 1, 4, 8, None, None, None, None).due(step)] == [4, 8]
