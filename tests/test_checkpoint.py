"""Checkpoints through real DCP and real process groups: a group of one in this process, and two gloo ranks forked from
a process with torch imported (tests/ranks.py) for FSDP2 resharding (2 ranks -> 1 and 1 -> 2) and async saves."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from conftest import base_config, heavy_imports_of, read_metrics, write_config
from meshtune.checkpoint import (CheckpointError, CheckpointManager, TrainerState, TrainingProgress, format_listing,
                                 list_checkpoints, select_resume, training_state, verify)
from meshtune.config import build_config
from meshtune.logs import RankWarning
from meshtune.plan import resume_request
from ranks import run_ranks, run_workers

INFO = {"epoch": 0, "world_size": 1, "parallel": "zero3", "config_hash": "abc"}


def checkpoint_asked_for(resume: str) -> tuple[bool, Path | None]:
    """What a run with resume_from_checkpoint `resume` asks the checkpoint manager for (the run plan's request)."""
    return resume_request(build_config({"model_name_or_path": "m", "dataset": "d", "resume_from_checkpoint": resume}),
                          shared=True)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Tiny(nn.Module):
    """Two blocks and a head of 3 rows, so 2 FSDP2 shards are uneven."""

    def __init__(self, seed: int, width: int = 6):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def setup(seed: int, fsdp: bool = False, freeze_first_block: bool = False):
    """Model, AdamW and LambdaLR: with the loop's TrainingProgress, the state the loop checkpoints."""
    model = Tiny(seed)
    if freeze_first_block:
        model.blocks[0].requires_grad_(False)
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in flatten(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree.clone() if torch.is_tensor(tree) else tree}


def full_state(model, optimizer) -> dict:
    """Full (unsharded) model and optimizer state, keyed by name; collective, complete on rank 0."""
    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return flatten({"model": model_sd, "optim": optim_sd})


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save_steps(output_dir: Path, steps, limit=None) -> None:
    model, optimizer, scheduler = setup(0)
    manager = CheckpointManager(output_dir, limit, False, 0, 1)
    for step in steps:
        train_step(model, optimizer, scheduler, step)
        manager.save(step, training_state(model, optimizer, scheduler, TrainingProgress(step=step), 0, False),
                     {**INFO, "step": step})
    manager.close()


def test_round_trip_restores_model_optimizer_scheduler_progress_and_rng(tmp_path, world_of_one):
    model, optimizer, scheduler = setup(0)
    train_step(model, optimizer, scheduler, 1)
    progress = TrainingProgress(step=1, epoch=0, nonfinite_skipped=[1], loss_scale={"scale": 8.0})
    manager = CheckpointManager(tmp_path, None, False, 0, 1)
    manager.save(1, training_state(model, optimizer, scheduler, progress, 0, False), INFO)
    saved, saved_scheduler, after_save = full_state(model, optimizer), scheduler.state_dict(), draws()
    manifest = json.loads((tmp_path / "checkpoint-1" / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["config_hash"] == "abc"
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    timing = manifest["save_seconds"]  # a sync save blocks training until it is written: publishing takes longer
    assert 0 < timing["blocked_s"] <= timing["published_s"] < 60

    model, optimizer, scheduler = setup(5)
    loaded_progress = TrainingProgress()
    state = training_state(model, optimizer, scheduler, loaded_progress, 0, False)
    random.seed(99)
    assert manager.load(tmp_path / "checkpoint-1", state)["step"] == 1
    assert_same(full_state(model, optimizer), saved)
    assert scheduler.state_dict() == saved_scheduler and optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert loaded_progress == progress
    assert state["rng"].restored and draws() == after_save


def test_ddp_checkpoint_loads_into_a_bare_module(tmp_path, world_of_one):
    model, optimizer, scheduler = setup(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    train_step(ddp, optimizer, scheduler, 1)
    manager = CheckpointManager(tmp_path, None, False, 0, 1)
    manager.save(1, training_state(ddp, optimizer, scheduler, TrainingProgress(step=1), 0, False), INFO)
    keys = FileSystemReader(str(tmp_path / "checkpoint-1")).read_metadata().state_dict_metadata
    assert "model_optim.model.head.weight" in keys  # no DDP "module." prefix: any wrapper can load it

    bare, bare_optimizer, bare_scheduler = setup(5)
    state = training_state(bare, bare_optimizer, bare_scheduler, TrainingProgress(), 0, False)
    manager.load(tmp_path / "checkpoint-1", state)
    assert_same(full_state(bare, bare_optimizer), full_state(model, optimizer))


def test_fsdp2_checkpoint_loads_into_a_bare_module(tmp_path, world_of_one):
    """`parallel: auto` trains full fine-tuning with zero2 on several GPUs and without a wrapper on one: a job
    resumed on one GPU loads the sharded checkpoint into the bare model."""
    model, optimizer, scheduler = setup(0, fsdp=True)
    train_step(model, optimizer, scheduler, 1)
    manager = CheckpointManager(tmp_path, None, False, 0, 1)
    manager.save(1, training_state(model, optimizer, scheduler, TrainingProgress(step=1), 0, False), INFO)

    bare, bare_optimizer, bare_scheduler = setup(5)
    state = training_state(bare, bare_optimizer, bare_scheduler, TrainingProgress(), 0, False)
    manager.load(tmp_path / "checkpoint-1", state)
    assert_same(full_state(bare, bare_optimizer), full_state(model, optimizer))


def test_tmp_never_selected_missing_complete_skipped_and_steps_sorted_as_numbers(tmp_path, world_of_one):
    save_steps(tmp_path, [9, 10, 12])
    (tmp_path / "checkpoint-12" / "COMPLETE").unlink()
    shutil.copytree(tmp_path / "checkpoint-10", tmp_path / "checkpoint-13.tmp")  # looks finished, is not published

    assert [(c.step, c.complete) for c in list_checkpoints(tmp_path)] == [(9, True), (10, True), (12, False),
                                                                        (13, False)]
    path, skipped = select_resume(tmp_path, None)
    assert path == tmp_path / "checkpoint-10"
    assert skipped == [(tmp_path / "checkpoint-13.tmp", ".tmp: being written or interrupted"),
                       (tmp_path / "checkpoint-12", "no COMPLETE marker (interrupted while saving)")]
    assert checkpoint_asked_for("none") == (False, None)  # none looks for no checkpoint
    assert select_resume(tmp_path / "empty", None) == (None, [])
    listing = format_listing(tmp_path)
    assert "checkpoint-13.tmp" in listing and "no COMPLETE marker" in listing


@pytest.mark.slow
def test_ckpt_list_reads_the_checkpoints_without_importing_torch_or_transformers(tmp_path, world_of_one):
    """`meshtune ckpt list` answers in a fraction of a second: manifests and markers are JSON and files."""
    save_steps(tmp_path, [1, 2])
    process, imported = heavy_imports_of(["ckpt", "list", str(tmp_path)])
    assert process.returncode == 0, process.stderr[-3000:]
    lines = process.stdout.splitlines()
    assert [line.split()[:3] for line in lines[1:3]] == [["1", "checkpoint-1", "complete"],
                                                         ["2", "checkpoint-2", "complete"]]
    assert imported == []


def test_flipped_byte_fails_verify_and_auto_falls_back(tmp_path, world_of_one):
    save_steps(tmp_path, [1, 2])
    shard = tmp_path / "checkpoint-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)

    assert verify(tmp_path / "checkpoint-2") == ["checksum mismatch in __0_0.distcp"]
    path, skipped = select_resume(tmp_path, None)
    assert path == tmp_path / "checkpoint-1"
    assert skipped == [(tmp_path / "checkpoint-2", "checksum mismatch in __0_0.distcp")]
    with pytest.raises(CheckpointError, match="checksum mismatch in __0_0.distcp"):
        select_resume(tmp_path, tmp_path / "checkpoint-2")
    assert select_resume(tmp_path, tmp_path / "checkpoint-1") == (tmp_path / "checkpoint-1", [])


def test_when_every_checkpoint_is_damaged_the_run_stops_naming_each_and_changes_nothing(tmp_path, world_of_one):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        shard = tmp_path / f"checkpoint-{step}" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as failure:
        CheckpointManager(tmp_path, None, False, 0, 1).select_resume(None)
    message = str(failure.value)
    assert ("no checkpoint in" in message and "Nothing was changed" in message
            and "resume_from_checkpoint: none" in message)
    assert "checkpoint-2: size mismatch in __0_0.distcp" in message and "checkpoint-1: size mismatch" in message
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # untouched
    assert checkpoint_asked_for("none") == (False, None)  # none looks for no checkpoint


def test_a_damaged_checkpoint_passed_over_is_moved_aside_and_listed_as_damaged(tmp_path, world_of_one):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "checkpoint-2" / "__0_0.distcp").write_bytes(b"short")
    listing = format_listing(tmp_path)
    assert "damaged: __0_0.distcp is 5 bytes, the manifest says" in listing
    (tmp_path / "checkpoint-1" / "manifest.json").write_text("{not json")
    assert "damaged: " in format_listing(tmp_path).splitlines()[1]  # an unreadable manifest too
    save_steps(tmp_path / "again", [1, 2])
    (tmp_path / "again" / "checkpoint-2" / "__0_0.distcp").write_bytes(b"short")
    path, skipped = CheckpointManager(tmp_path / "again", None, False, 0, 1).select_resume(None)
    assert path == tmp_path / "again" / "checkpoint-1"
    assert skipped[0][1].endswith("moved aside to checkpoint-2.damaged")
    assert [c.path.name for c in list_checkpoints(tmp_path / "again")] == ["checkpoint-1"]
    assert (tmp_path / "again" / "checkpoint-2.damaged" / "__0_0.distcp").read_bytes() == b"short"


def test_verify_names_each_problem(tmp_path, world_of_one):
    save_steps(tmp_path / "out", [1])
    good = tmp_path / "out" / "checkpoint-1"
    assert verify(good) == []

    def broken(name: str, damage) -> list[str]:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy)
        return verify(copy)

    assert broken("a", lambda p: (p / "manifest.json").write_text("{")) [0].startswith("unreadable manifest.json")
    assert broken("b", lambda p: (p / "__0_0.distcp").unlink()) == ["missing file __0_0.distcp"]
    size = (good / "__0_0.distcp").stat().st_size
    assert broken("c", lambda p: (p / "__0_0.distcp").write_bytes(b"x")) == [
        f"size mismatch in __0_0.distcp: 1 bytes, manifest says {size}"]
    assert broken("d", lambda p: (p / "__1_0.distcp").write_bytes(b"x")) == ["unlisted file __1_0.distcp"]
    assert broken("e", lambda p: (p / "COMPLETE").unlink()) == ["no COMPLETE marker (interrupted while saving)"]

    def node_local(p: Path) -> None:  # rank 0 never saw another node's shard: the manifest cannot list it
        manifest = json.loads((p / "manifest.json").read_text())
        del manifest["files"]["__0_0.distcp"]
        (p / "manifest.json").write_text(json.dumps(manifest))
        (p / "__0_0.distcp").unlink()

    assert broken("f", node_local) == ["missing file __0_0.distcp (DCP .metadata needs it)"]


def test_retention_keeps_newest_complete_and_prunes_only_old_tmp(tmp_path, world_of_one):
    (tmp_path / "checkpoint-1.tmp").mkdir(parents=True)
    (tmp_path / "checkpoint-1.tmp" / "__7_0.distcp").write_bytes(b"stale shard of an interrupted save")
    (tmp_path / "checkpoint-2.tmp").mkdir()
    (tmp_path / "checkpoint-50.tmp").mkdir()  # newer than anything complete: may be in flight, kept
    save_steps(tmp_path, [1, 2, 3, 4], limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4", "checkpoint-50.tmp"]
    assert verify(tmp_path / "checkpoint-4") == []

    save_steps(tmp_path, [4, 5], limit=1)  # step 4 saved again (a resume from further back) replaces the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5", "checkpoint-50.tmp"]
    with pytest.raises(CheckpointError, match="at least 1"):
        CheckpointManager(tmp_path, 0, False, 0, 1)


def test_a_deletion_cut_short_is_finished_at_the_next_start_and_never_left_beside_newer_ones(tmp_path,
                                                                                               world_of_one,
                                                                                               monkeypatch):
    from meshtune.checkpoint import manifest

    save_steps(tmp_path, [4, 8], limit=2)
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # the process dies after removing one file of the directory
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        manifest.delete_sealed(tmp_path / "checkpoint-8")
    monkeypatch.setattr(manifest.shutil, "rmtree", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-8.deleting"]
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["checkpoint-4"]  # never taken for checkpoint-8
    assert CheckpointManager(tmp_path, 1, False, 0, 1).select_resume(None) == (tmp_path / "checkpoint-4", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]  # the next start finished the deletion

    (tmp_path / "checkpoint-4" / "COMPLETE").unlink()  # a deletion cut short that removed COMPLETE first
    next((tmp_path / "checkpoint-4").glob("*.distcp")).unlink()
    save_steps(tmp_path, [12], limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12"]


def save_one(manager: CheckpointManager, step: int) -> None:
    model, optimizer, scheduler = setup(0)
    manager.save(step, training_state(model, optimizer, scheduler, TrainingProgress(step=step), 0, False),
                 {**INFO, "step": step})


def test_retention_deletes_on_its_own_thread_in_step_order_and_close_waits_for_it(tmp_path, world_of_one,
                                                                                  monkeypatch):
    import threading

    from meshtune.checkpoint import manifest

    save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "checkpoint-0.tmp").mkdir()  # an interrupted save, older than everything
    real, started, released, deleted = shutil.rmtree, threading.Event(), threading.Event(), []

    def slow_rmtree(path, *args, **kwargs):  # a slow storage: each deletion waits until the test lets it go
        started.set()
        assert released.wait(30), "the deletion was never let go"
        deleted.append(Path(path).name)
        real(path, *args, **kwargs)

    monkeypatch.setattr(manifest.shutil, "rmtree", slow_rmtree)
    manager = CheckpointManager(tmp_path, 1, False, 0, 1)
    try:
        save_one(manager, 4)  # returns, published, while the old checkpoints wait to be deleted
        assert verify(tmp_path / "checkpoint-4") == []
        assert started.wait(30), "the thread never began deleting"  # it renames first: a busy machine may lag
        assert manager.retention._thread.is_alive() and deleted == []
        # the oldest first, sealed (renamed) before its files go; the newest complete one untouched
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0.tmp.deleting", "checkpoint-1",
                                                              "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    finally:
        released.set()
    manager.close()  # the end of training: every deletion done, save_total_limit holds
    assert deleted == [f"checkpoint-{step}{tmp}.deleting" for step, tmp in [(0, ".tmp"), (1, ""), (2, ""), (3, "")]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert manager.retention.failures == []


def test_a_deletion_failing_on_the_thread_is_logged_by_path_and_what_it_left_is_never_resumed_from(
        tmp_path, world_of_one, monkeypatch, caplog):
    from meshtune.checkpoint import manifest

    save_steps(tmp_path, [1, 2])

    def fails_midway(path, *args, **kwargs):  # a storage error after the first file went
        for shard in list(Path(path).glob("*.distcp"))[:1]:
            shard.unlink()
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(manifest.shutil, "rmtree", fails_midway)
    manager = CheckpointManager(tmp_path, 1, False, 0, 1)
    with caplog.at_level("WARNING", logger="meshtune.checkpoint.retention"):
        save_one(manager, 3)
        save_one(manager, 4)  # its retention waits for the previous deletions first: they fail in step order
        manager.close()
    # each checkpoint's failure, in step order; the next publish's retention also failed to finish the first two
    failed = [path for path, _ in manager.retention.failures]
    assert failed == [tmp_path / "checkpoint-1", tmp_path / "checkpoint-2", tmp_path, tmp_path / "checkpoint-3"]
    assert all("Permission denied" in reason for _, reason in manager.retention.failures)
    assert f"could not delete old checkpoint {tmp_path / 'checkpoint-1'}: [Errno 13] Permission denied" in caplog.text
    monkeypatch.undo()
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["checkpoint-4"]  # the half-deleted are sealed
    assert CheckpointManager(tmp_path, 1, False, 0, 1).select_resume(None) == (tmp_path / "checkpoint-4", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]  # the next start finished them


def test_async_save_snapshots_state_and_wait_publishes(tmp_path, world_of_one):
    model, optimizer, scheduler = setup(0)
    manager = CheckpointManager(tmp_path, None, True, 0, 1)
    train_step(model, optimizer, scheduler, 1)
    at_save = full_state(model, optimizer)
    manager.save(1, training_state(model, optimizer, scheduler, TrainingProgress(step=1), 0, False),
                 {**INFO, "step": 1})
    train_step(model, optimizer, scheduler, 2)  # training goes on while the save is in flight
    assert not (tmp_path / "checkpoint-1").exists()
    manager.save(2, training_state(model, optimizer, scheduler, TrainingProgress(step=2), 0, False),
                 {**INFO, "step": 2})
    assert verify(tmp_path / "checkpoint-1") == []  # the next save published the previous one first
    manager.wait()
    assert verify(tmp_path / "checkpoint-2") == []

    model, optimizer, scheduler = setup(5)
    progress = TrainingProgress()
    manager.load(tmp_path / "checkpoint-1", training_state(model, optimizer, scheduler, progress, 0, False))
    assert_same(full_state(model, optimizer), at_save)
    assert progress == TrainingProgress(step=1)
    manager.close()


def test_progress_a_checkpoint_does_not_hold_starts_from_its_default():
    """A checkpoint from before a counter existed resumes with that counter's default; one it does not know is
    left out."""
    progress = TrainingProgress(step=5, epoch=1, nonfinite_skipped=[2], loss_scale={"scale": 2.0})
    TrainerState(progress).load_state_dict({"json": json.dumps({"step": 3, "epoch": 1, "consumed_samples": 8})})
    assert progress == TrainingProgress(step=3, epoch=1)


def test_trainable_only_saves_only_trainable_parameters(tmp_path, world_of_one):
    model, optimizer, scheduler = setup(0, freeze_first_block=True)
    train_step(model, optimizer, scheduler, 1)
    manager = CheckpointManager(tmp_path, None, False, 0, 1)
    manager.save(1, training_state(model, optimizer, scheduler, TrainingProgress(step=1), 0, True), INFO)
    saved = full_state(model, optimizer)

    keys = FileSystemReader(str(tmp_path / "checkpoint-1")).read_metadata().state_dict_metadata
    weights = {k.split(".", 2)[2] for k in keys if k.startswith("model_optim.model.")}
    assert weights == {"blocks.1.linear.weight", "blocks.1.linear.bias", "head.weight", "head.bias"}
    assert not [k for k in keys if "blocks.0" in k]

    model, optimizer, scheduler = setup(0, freeze_first_block=True)  # the same frozen base, as on a resume
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    manager.load(tmp_path / "checkpoint-1", training_state(model, optimizer, scheduler, TrainingProgress(), 0, True))
    assert_same(full_state(model, optimizer), saved)


# ---- two real ranks ----------------------------------------------------------------------------------------

def two_rank_job(rank: int, world_size: int, workdir: Path) -> None:
    """Load the 1-rank checkpoint into FSDP2 on 2 ranks, async-save two checkpoints from 2 ranks, fail a third."""
    model, optimizer, scheduler = setup(1, fsdp=True)
    progress = TrainingProgress()
    state = training_state(model, optimizer, scheduler, progress, rank, False)
    manager = CheckpointManager(workdir / "two", 2, True, rank, world_size)
    if rank == 1:
        with pytest.warns(RankWarning, match="holds no random state for this rank"):
            manager.load(workdir / "one" / "checkpoint-1", state)
    else:
        manager.load(workdir / "one" / "checkpoint-1", state)
    loaded = full_state(model, optimizer)
    assert progress == TrainingProgress(step=1)
    assert state["rng"].restored == (rank == 0)
    if rank == 0:
        assert_same(loaded, torch.load(workdir / "one.pt"))

    torch.manual_seed(100 + rank)  # per-rank streams differ, as with dropout in real runs
    for step in (2, 3):
        train_step(model, optimizer, scheduler, step)
        reference = full_state(model, optimizer)
        progress.step = step
        manager.save(step, state, {**INFO, "step": step, "world_size": world_size})
        if rank == 0:
            torch.save({"state": reference, "draws": draws()}, workdir / f"two-{step}.pt")
    manager.close()
    assert manager.select_resume(None) == (workdir / "two" / "checkpoint-3", [])

    # rank 0 fails to publish: every rank raises, none is left waiting at a collective
    with pytest.raises(CheckpointError, match="publishing checkpoint-4 .* failed"):
        CheckpointManager(workdir / "two", 2, False, rank, world_size).save(4, state, {"unserialisable": object()})


@pytest.mark.slow
def test_fsdp2_checkpoint_reshards_between_one_and_two_ranks(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer, scheduler = setup(0, fsdp=True)
        train_step(model, optimizer, scheduler, 1)
        manager = CheckpointManager(tmp_path / "one", None, False, 0, 1)
        manager.save(1, training_state(model, optimizer, scheduler, TrainingProgress(step=1), 0, False), INFO)
        torch.save(full_state(model, optimizer), tmp_path / "one.pt")
    finally:
        dist.destroy_process_group()

    run_ranks(two_rank_job, 2, tmp_path)
    assert [c.path.name for c in list_checkpoints(tmp_path / "two")] == ["checkpoint-2", "checkpoint-3",
                                                                         "checkpoint-4.tmp"]
    assert verify(tmp_path / "two" / "checkpoint-2") == [] and verify(tmp_path / "two" / "checkpoint-3") == []
    assert sorted(json.loads((tmp_path / "two" / "checkpoint-3" / "manifest.json").read_text())["files"]) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer, scheduler = setup(5, fsdp=True)
        progress = TrainingProgress()
        state = training_state(model, optimizer, scheduler, progress, 0, False)
        CheckpointManager(tmp_path / "two", None, False, 0, 1).load(tmp_path / "two" / "checkpoint-2", state)
        expected = torch.load(tmp_path / "two-2.pt")
        assert_same(full_state(model, optimizer), expected["state"])
        assert progress == TrainingProgress(step=2) and state["rng"].restored and draws() == expected["draws"]
    finally:
        dist.destroy_process_group()


def two_rank_saves(rank: int, world_size: int, workdir: Path) -> None:
    model, optimizer, scheduler = setup(3, fsdp=True)
    manager = CheckpointManager(workdir / "out", None, False, rank, world_size)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
        manager.save(step, training_state(model, optimizer, scheduler, TrainingProgress(step=step), rank, False),
                     {**INFO, "step": step, "world_size": world_size})
    manager.close()


def two_rank_resume_selection(rank: int, world_size: int, workdir: Path) -> None:
    """Each rank records which files it hashed (and their bytes) while the ranks select the resume point."""
    from meshtune.checkpoint import manifest

    hashed, real = [], manifest.hash_file

    def counting(path: Path, fsync: bool = False) -> dict:
        digest = real(path, fsync)
        hashed.append((path.parent.name, path.name, digest["size"]))
        return digest

    manifest.hash_file = counting
    selected = CheckpointManager(workdir / "out", None, False, rank, world_size).select_resume(None)
    (workdir / f"selected-{rank}.json").write_text(json.dumps({"path": str(selected[0]),
                                                               "skipped": [[str(p), r] for p, r in selected[1]],
                                                               "hashed": hashed}))


@pytest.mark.slow
def test_resume_verification_is_split_across_ranks_and_a_byte_only_rank_1_reads_still_moves_it_aside(tmp_path):
    from meshtune.checkpoint.manifest import share

    run_ranks(two_rank_saves, 2, tmp_path)
    newest = tmp_path / "out" / "checkpoint-2"
    listed = json.loads((newest / "manifest.json").read_text())["files"]
    rank1_files = share(listed, 2)[1]
    assert rank1_files and set(rank1_files).isdisjoint(share(listed, 2)[0])
    damaged = max(rank1_files, key=lambda name: listed[name]["size"])
    data = bytearray((newest / damaged).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / damaged).write_bytes(data)

    run_ranks(two_rank_resume_selection, 2, tmp_path)
    results = [json.loads((tmp_path / f"selected-{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:  # every rank got the same answer: the previous checkpoint, the damaged one set aside
        assert result["path"] == str(tmp_path / "out" / "checkpoint-1")
        assert result["skipped"] == [[str(newest), f"checksum mismatch in {damaged}; moved aside to "
                                                   f"checkpoint-2.damaged"]]
    assert (tmp_path / "out" / "checkpoint-2.damaged" / damaged).is_file()
    for checkpoint in ("checkpoint-2", "checkpoint-1"):
        files = {"checkpoint-2": listed,
                 "checkpoint-1": json.loads((tmp_path / "out" / "checkpoint-1" / "manifest.json").read_text())["files"]}
        total = sum(entry["size"] for entry in files[checkpoint].values())
        per_rank = [{name: size for directory, name, size in result["hashed"] if directory == checkpoint}
                    for result in results]
        assert set(per_rank[0]).isdisjoint(per_rank[1]), per_rank  # each file hashed once
        assert set(per_rank[0]) | set(per_rank[1]) == set(files[checkpoint])  # and every file hashed
        assert all(0 < sum(part.values()) < total for part in per_rank), per_rank
    assert damaged in {name for directory, name, _ in results[1]["hashed"] if directory == "checkpoint-2"}


def final_weights(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((output / "final").glob("*.safetensors"))}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("parallel", ["ddp", "zero2", "zero3"])
def test_a_run_resumed_on_four_ranks_goes_on_bit_for_bit(tmp_path, tiny_model_dir, tiny_dataset, method, parallel):
    """3 steps on 4 forked ranks, then the same run again from its checkpoint-1: the losses of steps 2 and 3 and the
    final weights are the run's own, bit for bit. Four ranks, as a sum over two is the same in any order; over four,
    a gradient's rounding depends on where it sits in the buffer reduced (DDP's buckets)."""
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=3,
                                                  save_steps=1, gradient_accumulation_steps=1, nproc_per_node=4,
                                                  finetuning_type=method, parallel=parallel))
    codes, output = run_workers(["train", str(config)], 4, tmp_path / "through", timeout=180)
    assert codes == [0] * 4, output[-6000:]
    through, weights = read_metrics(tmp_path / "out"), final_weights(tmp_path / "out")
    for later in ("checkpoint-2", "checkpoint-3", "final"):
        shutil.rmtree(tmp_path / "out" / later)
    codes, output = run_workers(["train", str(config)], 4, tmp_path / "resumed", timeout=180)
    assert codes == [0] * 4 and "resumed from" in output, output[-6000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "out")] == [r["loss"] for r in through]
    assert final_weights(tmp_path / "out") == weights


def test_a_write_failing_on_read_only_storage_names_the_cause_a_restart_cannot_fix(tmp_path, world_of_one):
    """The OSError from a rank's writer, alone or inside DCP's CheckpointException: the message says the storage is
    read-only and that a restart cannot fix it, as the job's other storage errors do."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    manager = CheckpointManager(tmp_path, 1, False, 0, 1)
    tmp = tmp_path / "checkpoint-4.tmp"
    read_only = OSError(errno.EROFS, "Read-only file system", str(tmp))
    for error in (read_only, CheckpointException("save failed", {0: (read_only, None)})):
        message = manager._write_failure(tmp, error)
        assert message.startswith(f"writing {tmp} failed (") and "it is not published" in message
        assert "the file system is read-only" in message and "a restart cannot fix this" in message
    assert "restart cannot fix" not in manager._write_failure(tmp, OSError(errno.EIO, "I/O error", str(tmp)))
    manager.close()
