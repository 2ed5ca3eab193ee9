"""Checkpoints in an object store, against a real S3 server process (moto's server mode on 127.0.0.1): the same
promises as on a file system where there is no rename. Every test here shares one server (module-scoped)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import base_config, run_cli, run_cli_here, write_config
from s3_server import S3Server
from meshtune.checkpoint import CheckpointManager, list_checkpoints, verify
from meshtune.checkpoint.object_store import DELETING_MARKER, open_store
from meshtune.config import build_config
from meshtune.train.loop import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BUCKET = "meshtune-ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    saved = {name: os.environ.get(name) for name in server.env}
    os.environ.update(server.env)
    try:
        server.make_bucket(BUCKET)
        yield server
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def killed_upload_then_fresh_resume(s3, tmp_path_factory, tiny_model_dir, tiny_dataset):
    """An uninterrupted local run; the same run into s3:// killed (SIGKILL) after its step-3 shards were uploaded,
    before they were sealed; then the run again on a fresh output_dir with only the URL."""
    root = tmp_path_factory.mktemp("store_runs")
    values = base_config(tiny_model_dir, tiny_dataset, root / "local", max_steps=4, save_steps=1,
                         save_total_limit=2)
    local = run(build_config(values))
    url = f"s3://{BUCKET}/killed"
    stored = {**values, "checkpoint_dir": url, "output_dir": str(root / "node-a")}
    config = write_config(root / "config", **stored)
    killed, _ = run_cli(["train", str(config)], env={"MESHTUNE_FAULT": "save:3:0"})
    after_kill = {c.path.name: c.complete for c in list_checkpoints(url)}
    resumed = run(build_config({**stored, "output_dir": str(root / "node-b")}))
    return {"root": root, "url": url, "local": local, "killed": killed, "after_kill": after_kill,
            "resumed": resumed}


def test_a_kill_during_an_upload_leaves_no_complete_and_a_fresh_node_resumes_exactly_from_the_url(
        killed_upload_then_fresh_resume):
    runs = killed_upload_then_fresh_resume
    assert runs["killed"].returncode != 0 and "killing rank 0 at save of step 3" in runs["killed"].stdout
    assert runs["after_kill"] == {"checkpoint-1": True, "checkpoint-2": True, "checkpoint-3": False}
    store = open_store(runs["url"])
    assert (store / "final" / "COMPLETE").is_file() and not verify(store / "final")
    assert (store / "final" / ADAPTER).read_bytes() == (runs["local"].final_dir / ADAPTER).read_bytes()
    local_losses = [r["loss"] for r in runs["local"].records]
    assert [r["loss"] for r in runs["resumed"].records] == local_losses[2:]  # steps 3 and 4, from checkpoint-2
    # retention by the resumed run: the newest two complete prefixes, nothing else under the URL
    assert sorted(p.name for p in store.iterdir()) == ["checkpoint-3", "checkpoint-4", "final"]
    manifest = json.loads((store / "checkpoint-4" / "manifest.json").read_text())
    assert set(manifest["save_seconds"]) == {"blocked_s", "published_s"}
    assert manifest["save_seconds"]["blocked_s"] <= manifest["save_seconds"]["published_s"]
