"""Retention counts back from the checkpoint just written: higher steps left by another timeline (a run that
went further, or a corrupt checkpoint resume skipped) never make it delete the new ones."""

from __future__ import annotations

import json

import pytest

from conftest import base_config
from meshtune.checkpoint import CheckpointError, verify
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.train.loop import run


def test_resume_below_a_corrupt_newer_checkpoint_keeps_the_new_checkpoints(tmp_path, tiny_model_dir, tiny_dataset):
    out = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, out, max_steps=6, save_steps=2)
    run(build_config(values))
    shard = next((out / "checkpoint-6").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    (out / "checkpoint-4").rename(out / "checkpoint-4-kept")  # resume from 2, the older valid one
    run(build_config({**values, "max_steps": 5, "save_steps": 1, "save_total_limit": 1,
                      "resume_allow_changed": ["max_steps"]}))
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert "checkpoint-5" in names, names  # the newest of this run survives its own retention
    assert "checkpoint-3" not in names and "checkpoint-4" not in names  # older ones of this run are pruned
    assert "checkpoint-6" not in names and "checkpoint-6.damaged" in names  # moved aside for a human to judge
    assert verify(out / "checkpoint-6.damaged") == [f"checksum mismatch in {shard.name}"]  # as it was
    manifest = json.loads((out / "checkpoint-5" / "manifest.json").read_text())
    assert manifest["step"] == 5


def test_resuming_under_another_math_is_an_error_naming_the_keys_unless_allowed(tmp_path, tiny_model_dir,
                                                                                tiny_dataset):
    out = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, out, max_steps=2, save_steps=2, save_final=False)
    run(build_config(values))
    changed = {**values, "max_steps": 4, "learning_rate": 1e-3}
    with pytest.raises(CheckpointError) as failure:
        run(build_config(changed))
    message = str(failure.value)
    assert "max_steps: 2 -> 4" in message and "learning_rate: 0.005 -> 0.001" in message
    assert "resume_allow_changed: [learning_rate, max_steps]" in message
    assert json.loads((out / "checkpoint-2" / "manifest.json").read_text())["config"]["max_steps"] == 2
    records = run(build_config({**changed, "resume_allow_changed": ["max_steps", "learning_rate"]})).records
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # resumed at 2, trained to 4
    with pytest.raises(ConfigError, match="resume_allow_changed: save_steps is not a key of the run's math"):
        build_config({**values, "resume_allow_changed": ["save_steps"]})


def test_a_checkpoint_from_before_a_new_key_resumes_when_the_key_is_at_its_default(tmp_path, tiny_model_dir,
                                                                                   tiny_dataset):
    """A checkpoint whose config predates a math key (here `stage`) computed what the key's default computes."""
    out = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, out, max_steps=2, save_steps=2, save_final=False)
    run(build_config(values))
    manifest_path = out / "checkpoint-2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["config"]["stage"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"stage: None -> 'pt'"):  # not the default: a change
        run(build_config({**values, "max_steps": 3, "stage": "pt", "resume_allow_changed": ["max_steps"]}))
    records = run(build_config({**values, "max_steps": 3, "resume_allow_changed": ["max_steps"]})).records
    assert [r["step"] for r in records] == [1, 2, 3]
