"""Retention counts back from the checkpoint just written: higher steps left by another timeline (a run that
went further, or a corrupt checkpoint resume skipped) never make it delete the new ones."""

from __future__ import annotations

import json

from conftest import base_config
from meshtune.config import build_config
from meshtune.train.loop import run


def test_resume_below_a_corrupt_newer_checkpoint_keeps_the_new_checkpoints(tmp_path, tiny_model_dir, tiny_dataset):
    out = tmp_path / "out"
    values = base_config(tiny_model_dir, tiny_dataset, out, max_steps=6, save_steps=2)
    run(build_config(values))
    shard = next((out / "checkpoint-6").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    (out / "checkpoint-4").rename(out / "checkpoint-4-kept")  # resume from 2, the older valid one
    run(build_config({**values, "max_steps": 5, "save_steps": 1, "save_total_limit": 1}))
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert "checkpoint-5" in names, names  # the newest of this run survives its own retention
    assert "checkpoint-3" not in names and "checkpoint-4" not in names  # older ones of this run are pruned
    assert "checkpoint-6" in names  # the other timeline's checkpoint is left for a human to judge
    manifest = json.loads((out / "checkpoint-5" / "manifest.json").read_text())
    assert manifest["step"] == 5
