"""Checkpoints in an object store, against a real S3 server process (moto's server mode on 127.0.0.1): the same
promises as on a file system where there is no rename. Every test here shares one server (module-scoped)."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import sys

import pytest

from conftest import base_config, run_cli_here, write_config
from s3_server import S3Server
from meshtune.checkpoint import CheckpointManager, list_checkpoints, verify
from meshtune.checkpoint.object_store import DELETING_MARKER, open_store
from meshtune.cli import main
from meshtune.config import build_config
from meshtune.train.loop import run
from ranks import free_port, run_meshtune_ranks

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
    stored = {**values, "checkpoint_dir": url, "output_dir": str(root / "node-a"), "report_to": ["tensorboard"]}
    config = write_config(root / "config", **stored)
    # the rank torchrun would start, forked (tests/ranks.py): what is killed is the training process, not a launcher;
    # the store's variables passed on, as the forkserver may have started before this module set them
    killed = run_meshtune_ranks(["train", str(config)], 1, root / "ranks", env={**s3.env, "MESHTUNE_FAULT": "save:3:0"})
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
    assert sorted(p.name for p in store.iterdir()) == ["checkpoint-3", "checkpoint-4", "final", "trackers.json"]
    # the fresh node continued the tracker run the lost one started: trackers.json came from the store
    first, fresh = (json.loads((runs["root"] / node / "trackers.json").read_text()) for node in ("node-a", "node-b"))
    assert fresh["tensorboard"] == first["tensorboard"]
    manifest = json.loads((store / "checkpoint-4" / "manifest.json").read_text())
    assert set(manifest["save_seconds"]) == {"blocked_s", "published_s"}
    assert manifest["save_seconds"]["blocked_s"] <= manifest["save_seconds"]["published_s"]
    # each tensor an object of its own: none is a rank's whole state
    shards = [name for name in manifest["files"] if name.endswith(".distcp")]
    assert len(shards) > 2 and max(manifest["files"][name]["size"] for name in shards) < 0.6 * sum(
        manifest["files"][name]["size"] for name in shards), manifest["files"]


def test_ckpt_verify_of_a_damaged_final_in_the_store_reports_it_invalid_as_a_local_one(
        killed_upload_then_fresh_resume, capfd, tmp_path):
    runs = killed_upload_then_fresh_resume
    damaged = open_store(runs["url"]).parent / "damaged-final"
    (open_store(runs["url"]) / "final").copy_to(damaged / "final")
    adapter = damaged / "final" / ADAPTER
    data = bytearray(adapter.read_bytes())
    data[len(data) // 2] ^= 1
    adapter.write_bytes(bytes(data))
    checked = run_cli_here(["ckpt", "verify", f"{damaged}/final"], capfd)
    assert checked.returncode == 1, checked.stdout
    assert f"{damaged}/final: a final export (PEFT adapter), not a checkpoint: INVALID" in checked.stdout
    assert f"checksum mismatch in {ADAPTER}" in checked.stdout and "error" not in checked.stdout, checked.stdout
    missing = run_cli_here(["ckpt", "verify", f"{damaged}/nothing/final"], capfd)
    assert missing.returncode == 1 and "INVALID" in missing.stdout and "not a directory" in missing.stdout
    refused = run_cli_here(["export", f"{damaged}/final", "--output", str(tmp_path / "out")], capfd)
    assert refused.returncode == 1 and f"cannot be used: checksum mismatch in {ADAPTER}" in refused.stdout
    # from the run's location: the damaged final/ is passed over for the newest intact checkpoint, and its copy,
    # which failed the check, is not left beside it
    from meshtune.checkpoint.fetch import local_copy

    nothing_else = run_cli_here(["export", str(damaged), "--output", str(tmp_path / "out")], capfd)
    assert nothing_else.returncode == 1 and (f"holds no intact sealed final/ and no complete checkpoint (final: "
                                             f"checksum mismatch in {ADAPTER})") in nothing_else.stdout
    (open_store(runs["url"]) / "checkpoint-4").copy_to(damaged / "checkpoint-4")
    copy = local_copy(str(damaged), tmp_path / "copy")
    assert sorted(p.name for p in copy.iterdir()) == ["checkpoint-4"]
    assert verify(copy / "checkpoint-4") == [] and not (tmp_path / "out").exists()


def test_ckpt_list_verify_export_and_chat_take_the_url(killed_upload_then_fresh_resume, s3, tmp_path, capfd,
                                                       monkeypatch):
    """Export and chat read a store's final/ through a local copy checked against its manifest, each object read
    from the store once, the manifest too (a verify in the store and then a download would read each twice)."""
    runs = killed_upload_then_fresh_resume
    listing = run_cli_here(["ckpt", "list", runs["url"]], capfd)
    assert listing.returncode == 0 and "checkpoint-4" in listing.stdout and "complete" in listing.stdout
    checked = run_cli_here(["ckpt", "verify", f"{runs['url']}/checkpoint-4"], capfd)
    assert checked.returncode == 0 and "valid" in checked.stdout, checked.stdout
    final = f"{runs['url'].removeprefix('s3://')}/final"
    before = s3.object_reads(final)
    exported = run_cli_here(["export", runs["url"], "--output", str(tmp_path / "adapter")], capfd)
    assert exported.returncode == 0, exported.stdout[-3000:]
    assert digest(tmp_path / "adapter" / ADAPTER) == digest(runs["local"].final_dir / ADAPTER)
    reads = s3.object_reads(final) - before
    listed = json.loads((runs["local"].final_dir / "manifest.json").read_text())["files"]
    assert ADAPTER in listed and {name: reads[name] for name in listed} == dict.fromkeys(listed, 1), reads
    assert reads["manifest.json"] == 1, reads  # and its manifest: verified and kept as read
    # chat from the store's final/ answers as from the local run's, greedy
    answers = [chat([source, "--max-new-tokens", "6"], "hello there\n", capfd, monkeypatch)
               for source in (f"{runs['url']}/final", str(runs["local"].final_dir))]
    assert answers[0] == answers[1] and answers[0][0] == 0 and answers[0][1].strip(), answers


def chat(args: list[str], stdin: str, capfd, monkeypatch) -> tuple[int, str]:
    """`meshtune chat ARGS` in this process with `stdin` piped in: exit code and stdout."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capfd.readouterr()
    code = main(["chat", *args])
    return code, capfd.readouterr().out


def tiny_state(step: int) -> dict:
    import torch

    from meshtune.checkpoint import TrainerState, TrainingProgress

    return {"weights": torch.arange(64, dtype=torch.float32) * step, "trainer": TrainerState(TrainingProgress(step))}


def saved(url: str, steps: range, limit: int | None = None) -> CheckpointManager:
    manager = CheckpointManager(url, limit, async_save=False, rank=0, world_size=1)
    for step in steps:
        manager.save(step, tiny_state(step), {"world_size": 1})
    manager.wait()
    manager.retention.join()  # the deletions of the last publish done, as the job's end waits for them
    return manager


def test_a_flipped_byte_in_an_object_is_a_checksum_mismatch_and_resume_falls_back_moving_it_aside(s3, capfd,
                                                                                                   tmp_path):
    url = f"s3://{BUCKET}/flipped"
    manager = saved(url, range(1, 3))
    shard = open_store(url) / "checkpoint-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    checked = run_cli_here(["ckpt", "verify", f"{url}/checkpoint-2"], capfd)
    assert checked.returncode == 1 and "checksum mismatch in __0_0.distcp" in checked.stdout, checked.stdout
    refused = run_cli_here(["export", f"{url}/checkpoint-2", "--output", str(tmp_path / "out")], capfd)
    assert refused.returncode == 1 and "cannot be used: checksum mismatch in __0_0.distcp" in refused.stdout
    assert not (tmp_path / "out").exists()  # nothing is exported from a checkpoint that fails its check
    path, _, notes = manager.find_resume(None, {})
    assert path.name == "checkpoint-1"
    assert any("checksum mismatch" in note and "moved aside to checkpoint-2.damaged" in note for note in notes), notes
    names = sorted(p.name for p in open_store(url).iterdir())
    assert names == ["checkpoint-1", "checkpoint-2.damaged"]
    assert verify(open_store(url) / "checkpoint-2.damaged") == ["checksum mismatch in __0_0.distcp"]  # as it was


def test_a_resume_from_the_store_reads_each_object_once_and_loads_the_copy_it_checked(s3, tmp_path):
    url = f"s3://{BUCKET}/read-once"
    saved(url, range(1, 3))
    before = s3.object_reads(f"{BUCKET}/read-once/checkpoint-2")
    manager = CheckpointManager(url, None, async_save=False, rank=0, world_size=1, staging=tmp_path / "copies")
    path, manifest, _ = manager.find_resume(None, {})
    state = tiny_state(0)
    manager.load(path, state)
    reads = s3.object_reads(f"{BUCKET}/read-once/checkpoint-2") - before
    assert path.name == "checkpoint-2" and state["trainer"].progress.step == 2
    assert state["weights"].tolist() == tiny_state(2)["weights"].tolist()
    assert {name: reads[name] for name in manifest["files"]} == dict.fromkeys(manifest["files"], 1), reads
    assert not list((tmp_path / "copies").rglob("*.distcp"))  # the node's copy is gone once loaded


def test_the_plan_names_the_store_a_resume_looks_in(s3, tmp_path, tiny_model_dir, tiny_dataset):
    from meshtune.plan import resume_reason

    url = f"s3://{BUCKET}/plan"
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", checkpoint_dir=url))
    assert resume_reason(cfg, True, None) == f"auto: no complete checkpoint in {url}"
    found = resume_reason(cfg, True, open_store(url) / "checkpoint-4")
    assert found == f"auto: the newest complete, verified checkpoint in {url}"
    local = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out"))
    assert resume_reason(local, True, None) == "auto: no complete checkpoint in output_dir"


def test_retention_deletes_whole_prefixes_and_a_half_deleted_one_is_finished_at_the_next_start(s3):
    url = f"s3://{BUCKET}/retention"
    saved(url, range(1, 4), limit=2)
    store = open_store(url)
    assert sorted(p.name for p in store.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    # a kill during the deletion of checkpoint-2, right after its marker and COMPLETE went: its shards are left
    (store / "checkpoint-2" / DELETING_MARKER).write_text("being deleted\n")
    (store / "checkpoint-2" / "COMPLETE").unlink()
    assert [c.complete for c in list_checkpoints(url)] == [False, True]  # never resumed from, even so
    path, _, _ = CheckpointManager(url, 2, async_save=False, rank=0, world_size=1).find_resume(None, {})
    assert path.name == "checkpoint-3"
    assert sorted(p.name for p in store.iterdir()) == ["checkpoint-3"]


def two_nodes_save_while_the_store_is_unreachable(env: dict[str, str], url: str, dead: str, rank: int,
                                                  world_size: int, workdir) -> None:
    """Two nodes of one process each (gloo ranks): checkpoint-1 saved into the store, then checkpoint-2 while
    nothing answers at its endpoint; each rank writes down what the failed save told it."""
    from meshtune.checkpoint import CheckpointError, RNGState

    os.environ.update(env)
    manager = CheckpointManager(url, None, async_save=False, rank=rank, world_size=world_size, local_rank=0,
                                local_world_size=1)
    state = {**tiny_state(1), "rng": RNGState(rank)}  # a shard of each rank's own: every node uploads
    manager.save(1, state, {"world_size": world_size})
    manager.wait()
    os.environ.update({"AWS_ENDPOINT_URL": dead, "AWS_MAX_ATTEMPTS": "1"})  # botocore's retries: the same, sooner
    try:  # a save that must publish (a run's last): the first failure stops the job
        manager.save(2, {**tiny_state(2), "rng": RNGState(rank)}, {"world_size": world_size}, must_publish=True)
        manager.wait(must_publish=True)  # a store's save runs in the background: its outcome comes here
        told = "saved"
    except CheckpointError as error:
        told = str(error)
    finally:
        manager.close()
    (workdir / f"told-{rank}.txt").write_text(told)


def test_a_store_unreachable_during_a_save_publishes_nothing_and_every_node_names_the_cause(s3, tmp_path):
    from ranks import run_ranks

    url = f"s3://{BUCKET}/unreachable"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run_ranks(functools.partial(two_nodes_save_while_the_store_is_unreachable, s3.env, url, dead), 2, tmp_path)
    told = [(tmp_path / f"told-{rank}.txt").read_text() for rank in (0, 1)]
    assert told[0] == told[1], told  # every node raises rank 0's verdict, which names each rank's cause
    message = told[0]
    assert "checkpoint-2 was not saved" in message and "checkpoint-1 stays the resume point" in message, message
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: .*({re.escape(dead)}|[Cc]onnect)", message), message
    assert [(c.path.name, c.complete) for c in list_checkpoints(url)] == [("checkpoint-1", True)]


def test_a_brief_store_outage_skips_saves_training_goes_on_and_a_third_failure_in_a_row_stops_it(
        s3, monkeypatch, caplog):
    """Saves into an unreachable store are skipped twice in a row (rank 0 warns, checkpoint-1 stays the resume
    point, a stop's save at that step would not be taken for written); the third stops the job naming how many
    failed; once the store answers again a save publishes and the count starts over."""
    import logging

    from meshtune.checkpoint import CheckpointError

    url = f"s3://{BUCKET}/outage"
    manager = CheckpointManager(url, None, async_save=False, rank=0, world_size=1)
    manager.save(1, tiny_state(1), {"world_size": 1})
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with caplog.at_level(logging.WARNING, logger="meshtune.checkpoint.manager"):
        for step, left in ((2, 2), (3, 1)):
            manager.save(step, tiny_state(step), {"world_size": 1})
            manager.wait()  # what the next save does first (a store's saves run in the background)
            assert manager.last_step == 1 and manager.failed_in_row == step - 1
            warning = caplog.records[-1].getMessage()
            assert f"checkpoint-{step}" in warning and "checkpoint-1 stays the resume point" in warning, warning
            assert f"the next save tries again; {left} more failures in a row stop the job" in warning, warning
    with pytest.raises(CheckpointError, match=r"checkpoint-1 stays the resume point.*\(3 saves in a row failed\)"):
        manager.save(4, tiny_state(4), {"world_size": 1})
        manager.wait()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.env["AWS_ENDPOINT_URL"])
    manager.save(5, tiny_state(5), {"world_size": 1})
    manager.wait()
    assert (manager.last_step, manager.published_step, manager.failed_in_row) == (5, 5, 0)
    manager.close()
    assert [c.path.name for c in list_checkpoints(url) if c.complete] == ["checkpoint-1", "checkpoint-5"]


@pytest.mark.parametrize("credentials", ["missing", "wrong"])
def test_credentials_missing_or_wrong_are_named_before_any_process_group(s3, tmp_path, tiny_model_dir,
                                                                        tiny_dataset, monkeypatch, capfd,
                                                                        credentials):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    if credentials == "missing":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        server = None
    else:  # a server that checks them: the dummy keys are unknown to it
        server = S3Server(tmp_path / "moto-auth.log", check_credentials=True)
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    try:
        url = f"s3://{BUCKET}/credentials"
        config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out",
                                                      nproc_per_node=2, checkpoint_dir=url))
        result = run_cli_here(["train", str(config)], capfd)
    finally:
        if server:
            server.stop()
    assert result.returncode == 1, result.stdout[-3000:]
    cause = "NoCredentialsError" if credentials == "missing" else "Forbidden"
    assert f"checkpoint_dir {url}: cannot list under {url}" in result.stdout and cause in result.stdout, result.stdout
    assert "AWS_ACCESS_KEY_ID" in result.stdout  # what to check
    assert "Traceback" not in result.stdout and "torch.distributed" not in result.stdout  # no worker started


@pytest.mark.parametrize("url, package, extra, credentials", [
    ("gs://bucket/run", "gcsfs", "gcs", "GOOGLE_APPLICATION_CREDENTIALS"),
    ("az://container/run", "adlfs", "azure", "AZURE_STORAGE_ANON=false")])
def test_a_store_whose_package_is_missing_is_named_with_the_pip_command_and_what_it_reads(monkeypatch, url, package,
                                                                                           extra, credentials):
    from meshtune.checkpoint.object_store import StoreError, check_store
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(StoreError, match=rf"needs the {package} package .* pip install 'meshtune\[{extra}\]'"):
        open_store(url)
    with pytest.raises(StoreError) as raised:  # the launcher's check, before any process group
        check_store(url, " (node 1)")
    message = str(raised.value)
    assert message.startswith(f"checkpoint_dir {url} (node 1): ") and f"pip install 'meshtune[{extra}]'" in message
    assert credentials in message and "AWS_" not in message, message  # what this store's client reads


def test_the_doctor_names_the_node_that_cannot_use_the_store_with_the_stores_error(s3, tmp_path, tiny_model_dir,
                                                                                   tiny_dataset):
    from test_doctor import row, run_nodes

    url = f"s3://{BUCKET}/doctor"
    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "output", checkpoint_dir=url)
    del values["nproc_per_node"]
    config = write_config(tmp_path, **values)
    # node 1 has no credentials; each node's output_dir is its own local folder: with a store that is fine
    (code0, out0), (code1, out1) = run_nodes(config, [
        {"NODE_RANK": "0"},
        {"NODE_RANK": "1", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
         "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
         "args": [f"output_dir={tmp_path / 'node1-output'}"]}])
    assert code0 == 1 and code1 == 1, out0
    store = row(out0, "checkpoint_dir: the store lists, writes, reads, deletes")
    assert store.count("✔") == 1 and "✘" in store and "NoCredentialsError" in store, out0
    assert "✘" not in row(out0, "output_dir: writable, shared, space"), out0
    assert "AWS_ACCESS_KEY_ID" in out1  # the fix, on the node that needs it
    assert not [p for p in open_store(url).parent.iterdir() if p.name.startswith(".meshtune-probe")]
