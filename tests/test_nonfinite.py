"""A step whose loss is NaN (fault injection `nan:STEP:RANK`): stopped before anything of it is saved, naming the
step, the rank, its node and the samples of its batch; or, with `on_nonfinite: skip`, passed over without an update
and listed in metrics.jsonl, up to `max_nonfinite_skips`."""

from __future__ import annotations

import math
import re
import socket

import pytest
from safetensors.torch import load_file

from conftest import base_config, read_metrics, run_cli, write_config
from meshtune.checkpoint import list_checkpoints
from meshtune.config import build_config
from meshtune.data.pipeline import plan_steps, prepare_datasets
from meshtune.model.model_dir import load_tokenizer
from meshtune.train.loop import run
from meshtune.train.nonfinite import NonFiniteError, NonFiniteSteps


def samples_of(cfg, step: int, rank: int, world_size: int) -> list[int]:
    """The samples (positions in the tokenized data) 1-based step `step` trains on `rank`, from the global batch
    plan as the run built it."""
    train_data, _ = prepare_datasets(cfg, load_tokenizer(cfg.model_name_or_path), show_progress=False)
    batches, _ = plan_steps(cfg, train_data, world_size, cfg.gradient_accumulation_steps)
    epoch, in_epoch = batches.position(step - 1)
    return sorted(i for micro in batches.micro_batches(epoch, in_epoch, rank) for row in micro for i in row)


@pytest.mark.slow
def test_a_nan_at_step_k_stops_the_job_naming_step_rank_node_and_samples_and_saves_nothing_of_it(
        tmp_path, tiny_model_dir, tiny_dataset):
    output = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, output, nproc_per_node=2, max_steps=6, save_steps=2,
                         logging_steps=5, max_restarts=1)
    result, _ = run_cli(["train", str(write_config(tmp_path, **values))], timeout=180,
                        env={"MESHTUNE_FAULT": "nan:3:1"})
    assert result.returncode == 1, result.stdout[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    samples = ", ".join(map(str, samples_of(build_config(values), 3, 1, 2)))
    assert last.startswith(f"meshtune: error: step 3: the loss was not finite on rank 1 (node 0, host "
                           f"{socket.gethostname()}) on samples {samples}. "
                           "Stopped: nothing from step 3 on was saved"), last
    assert "on_nonfinite: skip" in last
    # the check before checkpoint-4 caught it: checkpoint-2 is the newest, and nothing of a later step exists
    assert [c.path.name for c in list_checkpoints(output)] == ["checkpoint-2"]
    assert not (output / "final").exists() and not (output / "final.tmp").exists()
    assert "resumed from" not in result.stdout  # an error that repeats is not restarted


def test_a_nan_is_caught_at_the_logging_record_on_one_process(tmp_path, tiny_model_dir, tiny_dataset, monkeypatch):
    monkeypatch.setenv("MESHTUNE_FAULT", "nan:2:0")
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=6, save_steps=3))
    with pytest.raises(NonFiniteError, match=r"^step 2: the loss was not finite on rank 0 \(node 0, host .*\) on "
                                             r"samples [\d, ]+\. Stopped: nothing from step 2 on"):
        run(cfg)
    assert list_checkpoints(tmp_path / "out") == [] and not (tmp_path / "out" / "final").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]  # step 2's record was not written


def test_with_skip_a_nan_step_makes_no_update_is_listed_and_the_run_finishes(tmp_path, tiny_model_dir, tiny_dataset,
                                                                              monkeypatch, capsys):
    def train(name: str, **extra):
        cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / name, max_steps=5, **extra))
        run(cfg)
        return read_metrics(tmp_path / name), load_file(tmp_path / name / "final" / "adapter_model.safetensors")

    clean, clean_weights = train("clean")
    monkeypatch.setenv("MESHTUNE_FAULT", "nan:3:0")
    records, weights = train("skip", on_nonfinite="skip")
    assert "warning: step 3: the loss was not finite on rank 0 (node 0" in capsys.readouterr().out
    same = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [{k: r[k] for k in same} for r in records[:2]] == [{k: r[k] for k in same} for r in clean[:2]]
    skipped = records[2]
    assert skipped["step"] == 3 and skipped["nonfinite_skipped"] == [3]
    assert "loss" not in skipped and skipped["grad_norm"] is None
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != 3)
    assert records[3]["lr"] == clean[2]["lr"]  # the schedule waited a step: step 4 used step 3's rate
    assert all(bool(tensor.isfinite().all()) for tensor in weights.values())
    assert any(not bool((weights[k] == clean_weights[k]).all()) for k in weights)


def test_with_skip_more_non_finite_steps_than_allowed_stop_the_run(tmp_path, tiny_model_dir, tiny_dataset,
                                                                   monkeypatch):
    monkeypatch.setenv("MESHTUNE_FAULT", "nan:2:0,nan:4:0")
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=5, save_steps=1,
                                   on_nonfinite="skip", max_nonfinite_skips=1))
    with pytest.raises(NonFiniteError) as failure:
        run(cfg)
    assert re.match(r"step 4: the loss was not finite on rank 0 .*Stopped: max_nonfinite_skips: 1 steps were "
                    r"skipped already \(2\)", str(failure.value))
    assert [c.step for c in list_checkpoints(tmp_path / "out")] == [1, 2, 3]
    assert not (tmp_path / "out" / "final").exists()
    assert [r.get("nonfinite_skipped") for r in read_metrics(tmp_path / "out")] == [None, [2], None]


def test_a_gradient_norm_alone_not_finite_names_the_whole_batch_and_stops_at_the_next_check():
    import torch

    from meshtune.distributed import DistEnv
    from meshtune.train.stragglers import Place

    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    published = []
    steps = NonFiniteSteps("stop", 5, env, [Place(0, "h")], lambda step, rank: [step, 100 + step] if rank is None
                           else [step], [], lambda: published.append(True))
    finite = torch.tensor(2.0, dtype=torch.float64)
    assert steps.update_allowed(1, finite, torch.tensor(0.5)) and steps.update_allowed(2, finite, torch.tensor(0.7))
    steps.check()  # nothing to report
    assert steps.update_allowed(3, finite, torch.tensor(float("inf")))  # stop: the update goes on, marked
    assert steps.update_allowed(4, torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(float("nan")))
    assert published == []
    with pytest.raises(NonFiniteError, match=r"^step 3: the gradient norm was not finite while every rank's loss "
                                             r"was .*the step's samples: 3, 103\. Stopped: nothing from step 3 on"):
        steps.check()
    assert published == [True]  # the checkpoint in flight (of an earlier, checked step) published first
