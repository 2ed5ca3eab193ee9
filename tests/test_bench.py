"""The bench scripts end to end on CPU (tiny model, short samples): every row kind the speed table prints, the
in-repo peer, the two-agent script, so a broken bench script shows up here and not on a GPU machine whose time
is counted."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}
SPEED_TABLE = str(REPO / "bench" / "speed_table.py")
SHORT = ["--steps", "6", "--minlen", "32", "--maxlen", "128"]  # the fewest steps with a timed one; short samples
LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None
BNB_INSTALLED = importlib.util.find_spec("bitsandbytes") is not None

def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A bench script, its whole process tree killed if it outlives `timeout`."""
    from processes import kill_tree

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """One speed-table run with the default (in-repo) peers into an --out folder that does not exist yet: the
    tiny LoRA row (meshtune, the plain peer, the Liger peer) and a 2-GPU row this machine cannot run. Its --work
    holds what an earlier run with checkpoints leaves in the row's output folder."""
    tmp = tmp_path_factory.mktemp("table")
    out, work = tmp / "new" / "dir", tmp / "work"
    (work / "tiny" / "out-lora-tiny-v0" / "checkpoint-3").mkdir(parents=True)
    (work / "tiny" / "out-lora-tiny-v0" / "checkpoint-3" / "COMPLETE").write_text("")
    proc = run([sys.executable, SPEED_TABLE, "--rows", "lora-tiny,lora-1.5b-2gpu", *SHORT, "--work", str(work),
                "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, work


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_speed_table_runs_meshtune_both_peers_and_lists_rows_it_cannot_run(table_run, tmp_path):
    out, work = table_run
    results = json.loads((out / "speed.json").read_text())["results"]
    ours, plain, liger, two_gpus = results
    assert ours["system"] == "meshtune" and ours["tokens_per_s"] > 0 and ours["first_loss"] > 0
    assert ours["compile_s_timed"] is None and ours["recompile_limit_hit"] is False  # no compile on CPU by default
    assert (work / "tiny" / "out-lora-tiny-v0" / "train.log").is_file()
    assert plain["system"] == "hf_trainer+peft" and plain["tokens_per_s"] > 0 and plain["step_s"] > 0
    assert plain["peak_gib"] is None and plain["mfu"] is None  # no CUDA: no peak memory, no measured peak FLOP/s
    reported = plain["reported"]  # bench/peer_hf.py's JSON line
    assert {k: reported[k] for k in ("peer", "size", "mode", "bs", "gc", "peak_gib", "gpu")} == dict(
        peer="hf_trainer+peft", size="tiny", mode="lora", bs=8, gc=1, peak_gib=None, gpu="cpu")
    assert 8 * 32 <= reported["timed_tokens"] <= 8 * 128  # the one timed step: 8 samples of 32..128 real tokens
    assert reported["tokens_per_s"] == plain["tokens_per_s"]
    assert liger["system"] == "hf_trainer+peft+liger"
    if not LIGER_INSTALLED:
        assert "liger-kernel" in liger["error"] and "pip install liger-kernel" in liger["error"], liger
    assert two_gpus["skipped"] == "needs 2 GPUs, this machine has 0"
    table = (out / "speed.md").read_text()
    assert "| vs peer | vs peer+Liger |" in table
    line = next(line for line in table.splitlines() if line.startswith("| lora-tiny | default | meshtune |"))
    assert f"| {ours['tokens_per_s'] / plain['tokens_per_s']:.2f}x |" in line, line
    assert "not run: needs 2 GPUs" in table
    if not LIGER_INSTALLED:
        assert "| hf_trainer+peft+liger | 1 | 8 | not run: peer_hf.py: --liger 1 needs the liger-kernel" in table

    from speed_table import merge

    merge([str(out / "speed.json"), str(out / "speed.json")], tmp_path)
    assert len(json.loads((tmp_path / "speed.json").read_text())["results"]) == 8
    merged = [line for line in (tmp_path / "speed.md").read_text().splitlines()
              if line.startswith("| lora-tiny | default | meshtune |")]
    assert len(merged) == 1 and ", 2 runs) |" in merged[0], merged  # one figure: the median of both runs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_in_a_work_folder_an_earlier_run_left_trains_afresh(table_run):
    """The row's output folder in --work is emptied first, so the run neither resumes nor reads the earlier run's
    files (its checkpoint-3)."""
    out, work = table_run
    ours = json.loads((out / "speed.json").read_text())["results"][0]
    assert ours["system"] == "meshtune" and ours["trained_tokens"] > 0 and ours["tokens_per_s"] > 0, ours
    row = work / "tiny" / "out-lora-tiny-v0"
    assert not (row / "checkpoint-3").exists()
    log = (row / "train.log").read_text()
    assert "training finished" in log and "resumed from" not in log and "not resuming" not in log, log[-2000:]
    assert "resume_from_checkpoint       none: from step 0" in log, log[-2000:]  # the run plan's line


def test_the_peer_counts_real_tokens_and_pads_to_the_longest_sample():
    import numpy as np

    from peer_hf import CountingCollator

    collator = CountingCollator()
    batch = collator([{"input_ids": np.array([5, 6, 7], dtype=np.int32)}, {"input_ids": np.array([8], dtype=np.int32)}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert collator.tokens == [4]


def run_here(monkeypatch, main, argv: list[str]):
    """A bench script's `main` in this process, as `python SCRIPT ARGV` calls it: the checks and messages of a run
    without its Python start-up. A SystemExit("text") is the script's last line with status 1."""
    monkeypatch.setattr(sys, "argv", [f"{main.__module__}.py", *argv])
    return main()


@pytest.mark.timeout(60)
def test_the_liger_peer_names_the_package_it_needs(monkeypatch):
    if LIGER_INSTALLED:
        pytest.skip("liger-kernel is installed here")
    from peer_hf import main

    with pytest.raises(SystemExit) as stopped:  # and no other exception, which would print a traceback
        run_here(monkeypatch, main, ["--size", "tiny", "--liger", "1"])
    assert stopped.value.code == ("peer_hf.py: --liger 1 needs the liger-kernel package (>= 0.3.0), which is not "
                                  "installed: pip install liger-kernel")


@pytest.mark.timeout(60)
def test_the_qlora_peer_names_the_package_and_the_gpu_it_needs(monkeypatch, tmp_path):
    """--mode qlora (bitsandbytes NF4) stops with one line before any model is built or written: first a missing
    bitsandbytes, with the pip command, then a machine without CUDA; --model-dir is for qlora only."""
    import peer_hf
    from workspace import model_config

    with pytest.raises(SystemExit) as stopped:
        peer_hf.parse_args(["--size", "7b", "--mode", "qlora", "--model-dir", str(tmp_path)])
    assert stopped.value.code == 2
    assert peer_hf.model_dir_problem(tmp_path, "7b") == (f"--model-dir {tmp_path}: no config.json there (a saved "
                                                         "model, as bench/workspace.py's writes)")
    model_config("1.5b").save_pretrained(tmp_path)
    assert peer_hf.model_dir_problem(tmp_path, "7b") == (
        f"--model-dir {tmp_path}: not the 7b shape: hidden_size 1536 (not 3584), intermediate_size 8960 (not "
        "18944), num_attention_heads 12 (not 28), num_key_value_heads 2 (not 4)")
    model_config("7b").save_pretrained(tmp_path)
    args = peer_hf.parse_args(["--size", "7b", "--mode", "qlora", "--bs", "4", "--model-dir", str(tmp_path)])
    assert (args.mode, args.model_dir, args.liger) == ("qlora", tmp_path, 0)
    assert peer_hf.peer_name(args) == "hf_trainer+peft+bnb"
    with pytest.raises(SystemExit) as stopped:
        peer_hf.parse_args(["--mode", "lora", "--model-dir", str(tmp_path)])
    assert stopped.value.code == 2
    if not BNB_INSTALLED:
        with pytest.raises(SystemExit) as stopped:
            run_here(monkeypatch, peer_hf.main, ["--size", "tiny", "--mode", "qlora"])
        assert stopped.value.code == ("peer_hf.py: --mode qlora needs the bitsandbytes package, which is not "
                                      "installed: pip install bitsandbytes")
    monkeypatch.setattr(peer_hf, "bitsandbytes_installed", lambda: True)
    with pytest.raises(SystemExit) as stopped:
        run_here(monkeypatch, peer_hf.main, ["--size", "tiny", "--mode", "qlora"])
    assert stopped.value.code == "peer_hf.py: --mode qlora needs a CUDA GPU (bitsandbytes' 4-bit layers)"


@pytest.mark.timeout(120)
def test_a_qlora_row_runs_the_bitsandbytes_peer_on_meshtunes_model_folder_then_meshtune_at_its_memory(tmp_path):
    """The wiring of the Q-LoRA row: its peer is bnb (whatever else --peers names), reading the model folder
    meshtune's run reads, and the run at the peer's memory follows it with recomputation chosen to fit. The peer's
    command parses as the peer's own."""
    import peer_hf
    from speed_table import (ROWS, at_peer_memory, parse_args, parse_peers, parse_variant, peer_command, row_peers,
                             row_runs)

    every = parse_peers("plain,liger,bnb", no_peer=False)
    assert parse_args(["--rows", "qlora-7b"]).peer_kinds == every  # the default
    assert row_peers(ROWS["qlora-7b"], every) == ["bnb"]
    assert row_peers(ROWS["lora-7b"], every) == ["plain", "liger"]
    assert row_peers(ROWS["qlora-7b"], ["plain", "liger"]) == [] and row_peers(ROWS["lora-1.5b-2gpu"], every) == []
    assert row_runs(ROWS["qlora-7b"], ["default"], every, True) == [
        ("meshtune", 0, "default"), ("bnb", None, None), ("at-peer-memory", None, None)]
    assert row_runs(ROWS["qlora-7b"], ["default"], every, False) == [("meshtune", 0, "default"), ("bnb", None, None)]
    assert row_runs(ROWS["qlora-7b"], ["default"], ["plain"], True) == [("meshtune", 0, "default")]
    assert row_runs(ROWS["full-1.5b"], ["default"], ["liger"], True) == [
        ("meshtune", 0, "default"), ("liger", None, None), ("at-peer-memory", None, None)]
    assert row_runs(ROWS["full-1.5b"], ["default"], ["liger"], True, only_at_peer_memory=True) == [
        ("liger", None, None), ("at-peer-memory", None, None)]  # a round: the peer, then meshtune at its memory
    assert row_runs(ROWS["lora-1.5b-2gpu"], ["default"], every, True, only_at_peer_memory=True) == [
        ("meshtune", 0, "default")]  # a row without peers runs as it would
    assert parse_args(["--rows", "qlora-7b", "--only-at-peer-memory"]).only_at_peer_memory
    for refused in (["--no-peer"], ["--no-at-peer-memory"]):
        with pytest.raises(SystemExit):
            parse_args(["--rows", "qlora-7b", "--only-at-peer-memory", *refused])

    results = [dict(row="qlora-7b", system="meshtune", peak_gib=9.12),
               dict(row="qlora-7b", system="hf_trainer+peft+bnb", peak_gib=14.5)]
    assert parse_variant(at_peer_memory(results, "qlora-7b")) == {  # the fewest recomputed blocks that fit
        "memory_budget": 14.5, "gradient_checkpointing_ratio": "auto"}
    assert {**ROWS["qlora-7b"].settings, **parse_variant(at_peer_memory(results, "qlora-7b"))}[
        "gradient_checkpointing_ratio"] == "auto"

    from workspace import model_config

    args = parse_args(["--rows", "qlora-7b", "--steps", "6", "--minlen", "32", "--maxlen", "128"])
    model_dir = tmp_path / "model-7b"
    model_config("7b").save_pretrained(model_dir)  # what meshtune's row reads: config.json and weights
    cmd = peer_command(args, ROWS["qlora-7b"], "bnb", 96, model_dir)
    assert cmd[:2] == [sys.executable, str(REPO / "bench" / "peer_hf.py")]
    peer = peer_hf.parse_args(cmd[2:])  # the peer takes the table's command line
    assert (peer.size, peer.mode, peer.bs, peer.steps, peer.samples, peer.model_dir, peer.liger) == (
        "7b", "qlora", 4, 6, 96, model_dir, 0)
    assert "--model-dir" not in peer_command(args, ROWS["lora-7b"], "liger", 96, model_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_tables_qlora_peer_run_says_what_it_needs_here(tmp_path):
    """The bnb peer run as the table starts it, on this machine (no bitsandbytes): its not-run line is the peer's
    own, with the pip command, and the peer stopped before loading the model or writing to its folder."""
    if BNB_INSTALLED:
        pytest.skip("bitsandbytes is installed here")
    from speed_table import ROWS, Deadline, parse_args, peer_row

    from workspace import model_config

    args = parse_args(["--rows", "qlora-7b", "--steps", "6", "--minlen", "32", "--maxlen", "128"])
    model_dir = tmp_path / "model-7b"
    model_config("7b").save_pretrained(model_dir)
    result = peer_row(args, ROWS["qlora-7b"], "bnb", 96, model_dir, 1.0, None, Deadline(None))
    assert result == dict(error="peer_hf.py: --mode qlora needs the bitsandbytes package, which is not installed: "
                                "pip install bitsandbytes")
    assert [p.name for p in model_dir.iterdir()] == ["config.json"]


def test_the_table_shows_our_speed_and_memory_against_each_peer():
    """tokens/s over each peer's, and our peak memory as a share of that peer's: the figures behind a claim such
    as "faster than HF with Liger, at no more memory"."""
    from speed_table import render

    results = [dict(row="lora-tiny", system="meshtune", variant="default", gpus=1, bs=8, tokens_per_s=3000,
                    per_gpu=3000, mfu=None, peak_gib=1.2),
               dict(row="lora-tiny", system="hf_trainer+peft", gpus=1, bs=8, tokens_per_s=1000, per_gpu=1000,
                    mfu=None, peak_gib=1.5),
               dict(row="lora-tiny", system="hf_trainer+peft+liger", gpus=1, bs=8, tokens_per_s=2000, per_gpu=2000,
                    mfu=None, peak_gib=1.0)]
    table = render(results, dict(device="cpu", gpus=0, peak_tflops=None, args=dict(steps=6, minlen=32, maxlen=128)))
    assert ("| lora-tiny | default | meshtune | 1 | 8 | 3,000 | 3,000 | 3.00x, 80% of its memory | "
            "1.50x, 120% of its memory |  | 1.2 |  |") in table
    assert "| lora-tiny |  | hf_trainer+peft+liger | 1 | 8 | 2,000 | 2,000 |  |  |  | 1.0 |  |" in table


def test_a_figure_from_a_run_that_hit_the_recompile_limit_says_so():
    """dynamo runs a frame uncompiled once its recompile limit is hit: such a figure is not the compiled speed,
    and the table says so beside it (one run of three is enough)."""
    from speed_table import render

    runs = [dict(row="lora-tiny", system="meshtune", variant="default", gpus=1, bs=8, tokens_per_s=t, per_gpu=t,
                 mfu=None, peak_gib=1.2, round=i, recompile_limit_hit=i == 1) for i, t in enumerate((30, 20, 31))]
    summary = dict(device="cpu", gpus=0, peak_tflops=None, args=dict(steps=6, minlen=32, maxlen=128, repeats=3))
    assert "| 30 (20–31, 3 runs) (dynamo's recompile limit hit: some graphs ran uncompiled) |" in render(runs, summary)
    assert "recompile limit" not in render([dict(runs[0])], summary)


def test_a_variant_that_changes_only_how_processes_share_runs_once_on_one_gpu_and_is_the_base_of_its_scaling():
    """`--variants "default;parallel=ddp"` over a 1-GPU and a 2-GPU row: one process runs no wrapper, so the 1-GPU
    row runs once, and both 2-GPU variants are judged against that run."""
    from speed_table import one_process_equivalent, render

    variants = ["default", "parallel=ddp", "parallel=ddp,grad_reduce_dtype=bf16", "master_weights=bf16",
                "master_weights=bf16,parallel=zero2"]
    assert [one_process_equivalent(v, variants) for v in variants] == [
        "default", "default", "default", "master_weights=bf16", "master_weights=bf16"]
    results = [dict(row="full-1.5b", system="meshtune", variant="default", gpus=1, bs=8, tokens_per_s=30000,
                    per_gpu=30000, mfu=0.4, peak_gib=37.0),
               dict(row="full-1.5b-2gpu", system="meshtune", variant="default", gpus=2, bs=8, tokens_per_s=42000,
                    per_gpu=21000, mfu=0.28, peak_gib=26.0),
               dict(row="full-1.5b-2gpu", system="meshtune", variant="parallel=ddp", gpus=2, bs=8, tokens_per_s=57000,
                    per_gpu=28500, mfu=0.38, peak_gib=40.0)]
    table = render(results, dict(device="cpu", gpus=2, peak_tflops=None,
                                 args=dict(steps=12, minlen=128, maxlen=1024, variants="default;parallel=ddp")))
    assert "| full-1.5b-2gpu | default | meshtune | 2 | 8 | 42,000 | 21,000 |  |  | 28.0% | 26.0 | 70.0% |" in table
    ddp = "| full-1.5b-2gpu | parallel=ddp | meshtune | 2 | 8 | 57,000 | 28,500 |  |  | 38.0% | 40.0 | 95.0% |"
    assert ddp in table


@pytest.mark.timeout(120)
def test_runs_past_the_time_limit_are_listed_as_not_run_and_the_table_is_written(tmp_path, monkeypatch):
    import speed_table

    out = tmp_path / "out"
    monkeypatch.setattr(speed_table.torch.cuda, "device_count", lambda: 0)  # as CUDA_VISIBLE_DEVICES="" (ENV)
    run_here(monkeypatch, speed_table.main, ["--rows", "lora-tiny,lora-1.5b-2gpu", "--time-limit", "0", *SHORT,
                                             "--work", str(tmp_path / "work"), "--out", str(out)])
    results = json.loads((out / "speed.json").read_text())["results"]
    assert [(r["system"], r["skipped"]) for r in results] == [
        ("meshtune", "time limit"), ("hf_trainer+peft", "time limit"), ("hf_trainer+peft+liger", "time limit"),
        ("meshtune", "needs 2 GPUs, this machine has 0")]
    assert (out / "speed.md").read_text().count("not run: time limit") == 3
    assert not (tmp_path / "work" / "tiny").exists()  # nothing was prepared for rows that do not run


def test_a_stream_passes_every_option_on_except_its_own():
    from speed_table import child_argv

    argv = ["--streams", "--rows", "a,b", "--steps", "7", "--work=/w", "--no-peer", "--out", "/o", "--variants", "x=1",
            "--time-limit", "500"]
    assert child_argv(argv, "a", Path("/w/g1s0"), Path("/o/g1s0")) == [
        "--steps", "7", "--no-peer", "--variants", "x=1", "--rows", "a", "--work", "/w/g1s0", "--out", "/o/g1s0"]
    assert child_argv(argv, "a", Path("/w"), Path("/o"), time_limit=123.4)[-2:] == ["--time-limit", "123"]
    assert child_argv(argv, "a", Path("/w"), Path("/o"), time_limit=-5)[-2:] == ["--time-limit", "0"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_streams_stopped_early_still_merge_the_rows_that_finished(tmp_path):
    """Two variants of one row in one stream: SIGTERM twice once the first result is printed. The first row is in
    the merged table, the stream is stopped, and the script ends at once."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, SPEED_TABLE, "--streams", "--rows", "lora-tiny", "--variants",
                             "default;default", *SHORT, "--no-peer", "--row-timeout", "150", "--work",
                             str(tmp_path / "work"), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[g1s0] {"):
                proc.send_signal(signal.SIGTERM)  # twice, as GNU timeout does (child, then its process group)
                proc.send_signal(signal.SIGTERM)
                break
        started = time.monotonic()
        rest = proc.communicate(timeout=60)[0]
        assert time.monotonic() - started < 30, "the stream was not stopped"
        assert any(line.startswith("[g1s0] {") for line in lines), "".join(lines)[-2000:]
        results = json.loads((out / "speed.json").read_text())["results"]
        assert len(results) == 1 and results[0]["tokens_per_s"] > 0, rest[-2000:]
        assert "lora-tiny" in (out / "speed.md").read_text()
    finally:
        if proc.poll() is None:
            from processes import kill_tree

            kill_tree(proc.pid)
            proc.wait()


@pytest.mark.slow
def test_a_run_stopped_by_its_timeout_keeps_its_log_with_the_time_of_each_line(tmp_path):
    from speed_table import run_captured

    log = tmp_path / "train.log"
    script = ("import sys, time; print('loading', flush=True); print('no GPU', file=sys.stderr, flush=True); "
              "time.sleep(60)")
    started = time.monotonic()
    code, output = run_captured([sys.executable, "-c", script], 3, log=log)
    assert code is None and time.monotonic() - started < 30
    assert output.splitlines() == ["loading", "no GPU"]
    stamps = [line.split("] ", 1) for line in log.read_text().splitlines()]
    assert [text for _, text in stamps] == ["loading", "no GPU"]
    assert all(stamp.startswith("[") and stamp.endswith(" s") and float(stamp[1:-2]) < 3 for stamp, _ in stamps)
    assert run_captured([sys.executable, "-c", "raise SystemExit(3)"], 30) == (3, "")


def test_presets_name_rows_and_every_scaling_row_has_its_base_in_the_table():
    from speed_table import DEFAULT_ROWS, PRESETS, ROWS, SCALING_8GPU, expand_rows, render

    assert expand_rows("table-1gpu") == ["lora-1.5b", "full-1.5b", "lora-7b", "qlora-7b"]
    assert expand_rows("scaling-2gpu") == ["lora-1.5b", "full-1.5b", "lora-1.5b-2gpu", "full-1.5b-2gpu"]
    assert expand_rows("table") == DEFAULT_ROWS
    assert expand_rows("lora-tiny,scaling-8gpu") == ["lora-tiny", *SCALING_8GPU]
    assert all(ROWS[name].gpus <= 4 for name in DEFAULT_ROWS) and "full-7b-2gpu-zero3" not in DEFAULT_ROWS
    every = (set(DEFAULT_ROWS) | set(SCALING_8GPU) | set(PRESETS["long-context"]) | set(PRESETS["tensor-parallel"])
             | {"lora-tiny"})
    assert every == set(ROWS)  # every row is in a preset
    for preset in PRESETS.values():  # the default table has no 2-GPU 7B rows: its 7B rows show no scaling
        for name in preset:
            base = ROWS[name].scaling_of
            if base and (preset in (SCALING_8GPU, PRESETS["tensor-parallel"]) or ROWS[name].size == "1.5b"):
                assert base in preset and ROWS[base].gpus < ROWS[name].gpus, (name, base)
    results = [dict(row="full-7b-2gpu-zero3", system="meshtune", variant="default", gpus=2, bs=4, tokens_per_s=12000,
                    per_gpu=6000, mfu=0.3, peak_gib=70.0),
               dict(row="full-7b-8gpu-zero3", system="meshtune", variant="default", gpus=8, bs=4, tokens_per_s=45600,
                    per_gpu=5700, mfu=0.29, peak_gib=30.0)]
    table = render(results, dict(device="cpu", gpus=8, peak_tflops=None, args=dict(steps=25, minlen=128, maxlen=1024)))
    assert "| full-7b-8gpu-zero3 | default | meshtune | 8 | 4 | 45,600 | 5,700 |  |  | 29.0% | 30.0 | 95.0% |" in table


@pytest.mark.timeout(120)
def test_an_unknown_row_preset_or_peer_is_named_with_the_choices(monkeypatch, capsys):
    from speed_table import PRESETS, expand_rows, main, parse_peers

    with pytest.raises(SystemExit) as stopped:
        run_here(monkeypatch, main, ["--rows", "lora-1.5b,lora-15b"])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and "unknown row(s) lora-15b" in stderr, stderr[-2000:]
    assert all(preset in stderr for preset in PRESETS) and "full-7b-8gpu-hsdp" in stderr
    with pytest.raises(ValueError, match="unknown row.*table-2gpu.*presets table .*table-1gpu"):
        expand_rows("table-2gpu")
    with pytest.raises(ValueError, match="unknown peer.*deepspeed.*peers are plain, liger"):
        parse_peers("plain,deepspeed", no_peer=False)
    assert parse_peers("plain,liger", no_peer=True) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_node_speed_script_runs_both_layouts_in_rounds_on_cpu(tmp_path):
    """bench/two_node_speed.py end to end with the tiny job: two agents (one process each) as two nodes, then one
    agent with both processes; a broken script shows up here, not on a GPU machine. The work folder holds
    what an earlier invocation leaves (an output folder with a checkpoint, a log that resumed): both jobs start
    afresh all the same."""
    work, out = tmp_path / "work", tmp_path / "out"
    stale = work / "lora-tiny-auto-two-nodes-default"
    (stale / "checkpoint-7").mkdir(parents=True)
    (stale / "checkpoint-7" / "COMPLETE").write_text("")
    (work / "lora-tiny-auto-two-nodes-default-node0.log").write_text("resumed from checkpoint-7 at step 7 of 7\n")
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "two_node_speed.py"), "--jobs", "lora-tiny",
                             "--gpus-per-node", "1", "--steps", "2", "--warmup", "1", "--logging-steps", "1",
                             "--global-batch", "8", "--links", "default", "--repeats", "1", "--no-bandwidth",
                             "--job-timeout", "150", "--work", str(work), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=500)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    rows = json.loads((out / "two_node_speed.json").read_text())["runs"]
    assert [(r["layout"], r["round"], r["exit_codes"], r["problem"], r["parallel"]) for r in rows] == [
        ("two-nodes", 0, [0, 0], None, "ddp"), ("one-node", 0, [0], None, "ddp")]
    assert all(r["step_s"] > 0 and r["per_gpu"] > 0 and r["tokens_per_step"] > 0 for r in rows), rows
    config = yaml.safe_load((work / "lora-tiny-auto-one-node.yaml").read_text())
    assert config["gradient_accumulation_steps"] == 2  # 8 sequences = 2 a GPU x 2 GPUs x 2 micro-steps
    assert not (stale / "checkpoint-7").exists()
    table = (out / "two_node_speed.md").read_text()
    assert "| lora-tiny | ddp | two-nodes | default | 1 |" in table and "| lora-tiny | ddp | one-node |  | 1 |" in table


def test_two_node_speed_reads_nccl_transports_and_refuses_a_global_batch_it_cannot_make():
    from two_node_speed import accumulation_for, node_env, transports

    log = ("host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "host:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] [send] via NET/Socket/0\n"
           "host:1:2 [1] NCCL INFO Channel 01/0 : 3[3] -> 1[1] [receive] via NET/Socket/1\n")
    assert transports(log) == {"P2P/CUMEM": 1, "NET/Socket": 2}
    assert node_env(1, "fast", "two-nodes") == {"NCCL_HOSTID": "meshtune-node1", "NCCL_DEBUG": "INFO",
                                                "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
    assert node_env(0, "default", "sockets")["NCCL_P2P_DISABLE"] == "1"
    assert accumulation_for(64, 8, 4) == 2
    with pytest.raises(ValueError, match="--global-batch 60 is not a multiple of 8 sequences a GPU x 4 GPUs"):
        accumulation_for(60, 8, 4)


@pytest.mark.slow
def test_two_node_report_gives_each_layouts_median_and_its_share_of_one_node_by_round():
    from two_node_speed import report

    def run(layout, link, round_, per_gpu):
        return dict(job="full-1.5b", mode="auto", layout=layout, link=link, round=round_, parallel="hsdp"
                    if layout == "two-nodes" else "zero2", per_gpu=per_gpu, step_s=0.5, transports={"NET/Socket": 4},
                    problem=None)
    rows = [run("two-nodes", "default", 0, 9000), run("one-node", "", 0, 30000),
            run("two-nodes", "default", 1, 12000), run("one-node", "", 1, 30000),
            run("two-nodes", "default", 2, 10000), run("one-node", "", 2, 25000),
            dict(job="full-1.5b", mode="auto", layout="two-nodes", link="fast", round=0, problem="exit codes [1, 1]")]
    table = report(rows, [dict(link="default", busbw_gbs=4.2, latency_us=80.0, transports={"NET/Socket": 2})])
    assert "| default | 4.2 | 80.0 |" in table
    # medians 10,000 over 30,000; the rounds: 30%, 40%, 40%
    assert ("| full-1.5b | hsdp | two-nodes | default | 3 | 10,000 (9,000–12,000) | 0.500 | 33.3% (30.0%–40.0%) |"
            in table)
    assert "| full-1.5b | zero2 | one-node |  | 3 | 30,000 (25,000–30,000) | 0.500 |  |" in table
    assert "| full-1.5b | auto | two-nodes | fast | 1 | failed: exit codes [1, 1] |" in table


def test_repeated_rounds_show_medians_with_their_spread_and_the_scaling_of_paired_rounds():
    from speed_table import render

    one = [30000, 28000, 32000]
    two = [27000, 29000, 28000]  # per GPU; the rounds' ratios: 90.0%, 103.6%, 87.5%
    results = [dict(row=row, system="meshtune", variant="default", gpus=gpus, bs=8, tokens_per_s=per_gpu * gpus,
                    per_gpu=per_gpu, mfu=0.3, peak_gib=20.0 + r, round=r)
               for r in range(3) for row, gpus, per_gpu in (("lora-1.5b", 1, one[r]), ("lora-1.5b-2gpu", 2, two[r]))]
    table = render(results, dict(device="H200", gpus=4, peak_tflops=800,
                                 args=dict(steps=25, minlen=128, maxlen=1024, repeats=3)))
    assert "3 rounds: medians (lowest–highest)" in table
    assert "| lora-1.5b | default | meshtune | 1 | 8 | 30,000 (28,000–32,000, 3 runs) | 30,000 |" in table
    assert ("| lora-1.5b-2gpu | default | meshtune | 2 | 8 | 56,000 (54,000–58,000, 3 runs) | 28,000 |  |  | 30.0% "
            "| 22.0 | 93.3% (87.5%–103.6%) |") in table


def test_a_two_agent_job_that_did_not_train_afresh_fails_the_report():
    from gpu_two_agents import fail_on_problems, problem

    trained = [{"step": 1, "tokens": 100}, {"step": 2, "tokens": 90}]
    assert problem(trained, "train: 100%\n", expect_resume=False) is None
    assert problem(trained, "  resume_from_checkpoint       none: from step 0\n", expect_resume=False) is None
    assert problem([], "", expect_resume=False) == "trained 0 tokens"
    assert problem([{"step": 40, "tokens": 0}], "", expect_resume=False) == "trained 0 tokens"
    log = ("warning: checkpoint-40 was written with another config (hash a, now b); resuming anyway\n"
           "resumed from runs/checkpoint-40 at step 40 of 40\n")
    assert problem(trained, log, expect_resume=False).startswith(
        "resumed instead of starting afresh: warning: checkpoint-40")
    assert problem(trained, log, expect_resume=True) is None
    assert problem(trained, "", expect_resume=True) == "the restarted node did not resume from the checkpoint"
    fail_on_problems({"zero2/uninterrupted": None})
    with pytest.raises(SystemExit, match="zero2/uninterrupted: trained 0 tokens"):
        fail_on_problems({"zero2/uninterrupted": "trained 0 tokens", "zero2/killed": None})


def test_a_second_sigterm_cannot_cut_the_merge():
    """GNU timeout sends SIGTERM to the script and then to its process group: the first one starts the merge, and
    from then on SIGTERM is ignored."""
    from speed_table import stop_once

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="merging"):
            stop_once(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_collective_probe_prints_every_collective_and_size():
    """bench/allreduce_probe.py on two gloo ranks (on GPUs it runs on NCCL): one line per collective and size."""
    from ranks import free_port

    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                  str(free_port()), str(REPO / "bench" / "allreduce_probe.py"), "--sizes-mb", "1,2",
                  "--unit-params-m", "0.5"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("gloo ")]
    assert [line.split(" MB")[0].split(" ", 2)[2] for line in lines] == [
        "all_reduce fp32 1", "all_reduce fp32 2", "all_gather bf16 (0.5M params) 1",
        "reduce_scatter fp32 (0.5M params) 2"], result.stdout
    assert all("bus bandwidth" in line and " ms," in line for line in lines)


def test_the_qlora_row_is_judged_against_our_lora_row():
    """The Q-LoRA target is relative to meshtune's own LoRA 7B (tokens/s and peak memory): the table says both."""
    from speed_table import render

    results = [dict(row="lora-7b", system="meshtune", variant="default", gpus=1, bs=4, tokens_per_s=9000,
                    per_gpu=9000, mfu=0.5, peak_gib=20.0),
               dict(row="qlora-7b", system="meshtune", variant="torch_compile=true", gpus=1, bs=4, tokens_per_s=6750,
                    per_gpu=6750, mfu=0.37, peak_gib=7.0)]
    summary = dict(device="H100", gpus=1, peak_tflops=790.0, args=dict(steps=25, minlen=128, maxlen=1024))
    line = next(line for line in render(results, summary).splitlines() if line.startswith("| qlora-7b"))
    assert "0.75x lora-7b, 35% of its memory" in line, line


def test_the_qlora_row_is_judged_against_its_bitsandbytes_peer_where_it_ran():
    """With the bnb peer in the table, the Q-LoRA row's "vs peer" is against it, not our LoRA row; the Liger
    column stays empty (no Liger peer on 4 bits)."""
    from speed_table import render

    results = [dict(row="lora-7b", system="meshtune", variant="default", gpus=1, bs=4, tokens_per_s=9000,
                    per_gpu=9000, mfu=0.5, peak_gib=20.0),
               dict(row="qlora-7b", system="meshtune", variant="default", gpus=1, bs=4, tokens_per_s=6000,
                    per_gpu=6000, mfu=0.33, peak_gib=9.0),
               dict(row="qlora-7b", system="hf_trainer+peft+bnb", gpus=1, bs=4, tokens_per_s=2000, per_gpu=2000,
                    mfu=0.11, peak_gib=12.0)]
    summary = dict(device="H100", gpus=1, peak_tflops=790.0, args=dict(steps=25, minlen=128, maxlen=1024))
    lines = [line for line in render(results, summary).splitlines() if line.startswith("| qlora-7b")]
    assert lines[0] == ("| qlora-7b | default | meshtune | 1 | 4 | 6,000 | 6,000 | 3.00x, 75% of its memory |  | "
                        "33.0% | 9.0 |  |"), lines[0]
    assert lines[1].startswith("| qlora-7b |  | hf_trainer+peft+bnb | 1 | 4 | 2,000 |"), lines[1]


@pytest.mark.slow
def test_big_qlora_script_writes_a_sharded_random_model_and_reports_memory_speed_and_refused_variants(tmp_path):
    """The big-model Q-LoRA bench on CPU: a model whose block weights quantize, written shard by shard, trained
    by 2 processes under zero3; the report has every figure the docs record. --variants run on the same model
    files: one meshtune refuses is reported with its named error and does not end the others."""
    from safetensors import safe_open

    work = tmp_path / "work"
    result = run([sys.executable, str(REPO / "bench" / "big_qlora.py"), "--size", "tiny-nf4", "--gpus", "2",
                  "--steps", "6", "--minlen", "32", "--maxlen", "128", "--samples", "64", "--work", str(work),
                  "--shard-gb", "0.001", "--variants", "lora_rank=-1;default", "--json", str(tmp_path / "big.json")],
                 timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    refused, report = json.loads((tmp_path / "big.json").read_text())
    assert refused["variant"] == "lora_rank=-1" and refused["error"].startswith("meshtune: error: ")
    assert "lora_rank=-1" in refused["error"] and "tokens_per_s" not in refused
    assert "the plan's own choice was the fastest that trained" in result.stdout
    assert report["variant"] == "default" and report["steps"] == 6 and report["timed_steps"] == 1
    assert report["tokens_per_s"] > 0
    assert "this process keeps" in report["build_line"] and "(1/2)" in report["build_line"]
    assert report["load_s"] is not None and report["host_peak_loading_gib"] > 0
    index = json.loads((work / "model-tiny-nf4" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    for file in files:
        with safe_open(str(work / "model-tiny-nf4" / file), framework="pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == file)
            if "model.norm.weight" in f.keys():
                assert float(f.get_tensor("model.norm.weight").float().mean()) == 1.0


def test_big_qlora_comparison_says_whether_the_plans_choice_was_the_fastest():
    from big_qlora import comparison

    def ran(variant, rate):
        return dict(variant=variant, tokens_per_s=rate, gpu_peak_gib=20.0, load_s=20.0)

    assert comparison([ran("default", 1800), ran("torch_compile=false", 1500)]).endswith(
        "the plan's own choice was the fastest that trained")
    assert comparison([ran("default", 1500), ran("gradient_checkpointing_ratio=0.5", 1800)]).endswith(
        "the plan's own choice was not the fastest: gradient_checkpointing_ratio=0.5 ran 1.20x its tokens/s")
    refused = dict(variant="default", error="meshtune: error: gradient_checkpointing_ratio auto: ... does not fit")
    text = comparison([refused, ran("gradient_checkpointing_ratio=1.0", 1815)])
    assert "| default | did not train: meshtune: error:" in text and text.endswith("did not train")
    assert comparison([ran("torch_compile=false", 1500)]).endswith("the plan's own choice was not run")
    # alternating rounds: each variant its runs' median, with their range; a refused run said beside it
    rounds = [ran("default", 2050), ran("combo", 2200), ran("default", 1934), dict(variant="combo", error="refused"),
              ran("default", 2033), ran("combo", 2100)]
    text = comparison(rounds)
    assert "| default | 2,033 (1,934–2,050, 3 runs) |" in text
    assert "| combo | 2,150 (2,100–2,200, 2 runs); 1 more did not train: refused |" in text
    assert text.endswith("the plan's own choice was not the fastest: combo ran 1.06x its tokens/s")


def test_the_run_at_peer_memory_takes_the_lowest_peak_of_the_rows_peers():
    from speed_table import at_peer_memory, parse_variant

    results = [dict(row="lora-1.5b", system="meshtune", peak_gib=17.5),
               dict(row="lora-1.5b", system="hf_trainer+peft", peak_gib=18.83),
               dict(row="lora-1.5b", system="hf_trainer+peft+liger", peak_gib=6.49),
               dict(row="full-1.5b", system="hf_trainer+peft+liger", peak_gib=13.61),
               dict(row="lora-7b", system="hf_trainer+peft", error="out of memory")]
    assert at_peer_memory(results, "lora-1.5b") == "memory_budget=6.49"
    # GiB (above 1); full fine-tuning trains bf16 weights there, as the peers do
    assert parse_variant(at_peer_memory(results, "full-1.5b")) == {"memory_budget": 13.61, "master_weights": "bf16"}
    assert at_peer_memory(results, "lora-7b") is None


def test_trace_summary_splits_a_ranks_gpu_time_and_names_the_host_op_behind_each_idle_gap():
    """A two-rank trace pair: rank 1's kernels leave a 3 ms gap while its host is in a hook; rank 0's all-gather
    waits for it. Compute, NCCL, NCCL not hidden, idle and the gaps' host operators come out as drawn."""
    from trace_summary import render, summarize

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    rank0 = {"traceEvents": [x("kernel", "gemm", 0, 1000), x("kernel", "ncclDevKernel_AllGather", 500, 4000),
                             x("kernel", "gemm", 4500, 500), x("cpu_op", "aten::mm", 0, 100)]}
    rank1 = {"traceEvents": [x("kernel", "gemm", 0, 1000), x("gpu_memcpy", "Memcpy HtoD", 1000, 200),
                             x("cpu_op", "FSDP::post_backward", 900, 3500), x("cpu_op", "aten::empty", 1100, 50),
                             x("kernel", "ncclDevKernel_AllGather", 4200, 300), x("kernel", "gemm", 4500, 500),
                             {"ph": "i", "name": "marker", "ts": 0}]}
    s0, s1 = summarize(rank0, gaps=5, min_gap_ms=1.0), summarize(rank1, gaps=5, min_gap_ms=1.0)
    assert (s0["window_ms"], s0["compute_ms"], s0["nccl_ms"], s0["nccl_exposed_ms"], s0["idle_ms"]) == (
        5.0, 1.5, 4.0, 3.5, 0.0)
    assert (s1["compute_ms"], s1["nccl_ms"], s1["idle_ms"]) == (1.7, 0.3, 3.0)
    assert s1["gaps"] == [dict(at_ms=1.2, ms=3.0, host="FSDP::post_backward")]  # aten::empty ended before the gap
    table = render(["rank0", "rank1"], [s0, s1], 1.0)
    assert "| GPU idle (nothing running) | 0.0 | 3.0 |" in table and "FSDP::post_backward" in table
    with pytest.raises(ValueError, match="no GPU events"):
        summarize({"traceEvents": [x("cpu_op", "aten::mm", 0, 10)]}, gaps=5, min_gap_ms=1.0)


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    """bench/parity_curves.py's CPU smoke run: meshtune on 2 gloo processes (zero3, padding-free, fused loss,
    recomputation) and the HF Trainer replay, two seeds each, fp32."""
    tmp = tmp_path_factory.mktemp("parity")
    out = tmp / "out"
    argv = [sys.executable, str(REPO / "bench" / "parity_curves.py"), "--size", "tiny", "--steps", "6", "--minlen",
            "16", "--maxlen", "64", "--bs", "2", "--seeds", "3,4", "--work", str(tmp / "work"), "--out", str(out)]
    proc = run(argv, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, argv


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_parity_curves_replay_meshtunes_batches_into_hf_trainer(parity_run):
    """Both stacks train the same samples in each step, so in fp32 their losses agree to float rounding at every
    step, far closer than the two seeds do; the report holds every curve and each comparison."""
    out, _ = parity_run
    summary = json.loads((out / "parity.json").read_text())
    runs = summary["runs"]
    assert sorted(runs) == ["hf-seed3", "hf-seed4", "meshtune-seed3", "meshtune-seed4"]
    assert all(len(run["loss"]) == len(run["lr"]) == len(run["tokens"]) == 6 for run in runs.values()), runs
    plan = runs["meshtune-seed3"]["plan"]
    assert (plan["parallel"], plan["padding_free"], plan["fused_loss"], plan["gradient_accumulation_steps"]) == (
        "zero3", True, True, 2)
    assert runs["meshtune-seed3"]["recomputed"] == "1 of the blocks"
    for seed in (3, 4):
        ours, theirs = runs[f"meshtune-seed{seed}"]["loss"], runs[f"hf-seed{seed}"]["loss"]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=0), (seed, ours, theirs)
        assert runs[f"meshtune-seed{seed}"]["tokens"] == runs[f"hf-seed{seed}"]["tokens"]
    assert runs["meshtune-seed3"]["loss"] != pytest.approx(runs["meshtune-seed4"]["loss"], rel=1e-4, abs=0)
    found = summary["report"]
    assert [c["compared"] for c in found["stacks"] + found["noise"]] == [
        "meshtune vs HF Trainer, seed 3", "meshtune vs HF Trainer, seed 4", "seed 3 vs seed 4, meshtune",
        "seed 3 vs seed 4, HF Trainer"]
    assert all(c["step_max"] < 1e-4 for c in found["stacks"]) and all(c["step_max"] > 1e-4 for c in found["noise"])
    assert [(s["lr_max"], s["same_tokens"]) for s in found["schedule"]] == [(0.0, True), (0.0, True)]
    assert found["verdict"]["within_noise"] is True
    table = (out / "parity.md").read_text()
    assert "| meshtune vs HF Trainer, seed 3 |" in table and "within run-to-run noise" in table
    assert "| step | meshtune-seed3 | meshtune-seed4 | hf-seed3 | hf-seed4 |" in table
    assert (out / "parity.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_parity_curves_keep_the_runs_that_finished_with_the_same_settings(parity_run):
    """A second invocation into the same --out runs nothing it finished before (the report is the same); one with
    another setting finds none of them, and leaves them in place."""
    out, argv = parity_run
    files = sorted((out / "runs").iterdir())
    before = [f.read_text() for f in files]
    again = run([*argv, "--only", "hf"], timeout=150)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "(finished with these settings): meshtune-seed3, meshtune-seed4, hf-seed3, hf-seed4" in again.stdout
    assert sorted((out / "runs").iterdir()) == files and [f.read_text() for f in files] == before
    assert json.loads((out / "parity.json").read_text())["report"]["verdict"]["within_noise"] is True
    other = run([*argv, "--lr", "1e-3", "--only", "meshtune", "--time-limit", "0"], timeout=150)
    assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
    assert "kept from" not in other.stdout
    runs = json.loads((out / "parity.json").read_text())["runs"]
    assert runs["meshtune-seed3"]["skipped"] == "time limit"
    assert runs["hf-seed3"]["skipped"].startswith("no run with these settings in")
    assert [f.read_text() for f in files] == before and len(list((out / "runs").iterdir())) == len(files) + 2


def test_parity_report_lists_runs_that_did_not_finish_and_judges_what_did():
    from parity_curves import render, report

    def curve(start):
        return dict(loss=[start - 0.01 * i for i in range(20)], lr=[1e-4] * 20, tokens=[100] * 20)

    runs = {"meshtune-seed1": curve(5.0), "meshtune-seed2": curve(5.5), "hf-seed1": curve(5.001),
            "hf-seed2": dict(error="timed out after 1200 s")}
    found = report(runs, [1, 2])
    assert [c["compared"] for c in found["stacks"] + found["noise"]] == [
        "meshtune vs HF Trainer, seed 1", "seed 1 vs seed 2, meshtune"]
    assert found["verdict"]["within_noise"] is True and found["verdict"]["stacks"] < 1e-3
    assert found["noise"][0]["final"] == pytest.approx(0.5 / 5.105, rel=1e-6)  # last 10 steps: 4.855 and 5.355
    summary = dict(device="NVIDIA H200", gpus=2, global_batch=32, meshtune_levers="parallel zero3",
                   hf_settings="bf16 autocast", memory_note=None, meshtune_config=dict(warmup_steps=2), runs=runs,
                   report=found, args=dict(size="0.5b", steps=20, minlen=64, maxlen=512, symbols=512, lr=3e-4, gpus=2))
    table = render(summary)
    assert "| hf-seed2 | not run: timed out after 1200 s |" in table
    assert "NVIDIA H200 x 2; Qwen2.5 0.5b shape" in table and "within run-to-run noise" in table
    runs["hf-seed1"] = curve(5.6)  # the stacks now differ more than the seeds
    assert report(runs, [1, 2])["verdict"]["within_noise"] is False


def test_parity_memory_budget_makes_the_fit_recompute_half_the_blocks():
    """The budget is read from the memory fit's own log line, and the fit's own rule then keeps half the blocks."""
    from parity_curves import budget_for_half

    from meshtune.train.memory_fit import GIB, MemoryFit, blocks_to_keep

    line = MemoryFit(blocks=24, kept=24, peak_all=6.3 * GIB, per_block=0.42 * GIB, budget=126 * GIB,
                     tokens=4096).describe()
    budget = budget_for_half(f"[ 60.2 s] {line}", 24)
    assert budget is not None and budget > 1  # GiB, as memory_budget reads a value above 1
    assert blocks_to_keep(6.3 * GIB, 0.42 * GIB, budget * GIB, 24) == 12
    assert budget_for_half("gradient_checkpointing_ratio auto: nothing measured", 24) is None


def test_parity_task_samples_are_a_walk_of_the_chain_then_its_copy():
    from parity_curves import SUCCESSORS, task_samples

    samples = task_samples(200, 16, 64, symbols=50)
    assert all(16 <= len(s) <= 64 and len(s) % 2 == 1 for s in samples)
    assert len({len(s) for s in samples}) > 10
    follows: dict[int, set[int]] = {}
    for s in samples:
        m = len(s) // 2
        assert s[m] == 50 and list(s[:m]) == list(s[m + 1:]) and max(s[:m]) < 50
        for a, b in zip(s[:m - 1], s[1:m]):
            follows.setdefault(int(a), set()).add(int(b))
    assert max(len(v) for v in follows.values()) <= SUCCESSORS and len(follows) == 50
    assert all((a == b).all() for a, b in zip(task_samples(200, 16, 64, 50), samples))  # from its own seed


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_parity_memory_probe_stops_the_run_and_its_workers_at_the_fit_line(tmp_path):
    """The probe reads the memory fit's line and ends the run there: the launcher and every process below it
    (torchrun's workers hold the GPUs) are gone when it returns."""
    from parity_curves import FIT_LINE, run_until
    from processes import alive

    script = ("import subprocess, sys, time\n"
              "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              "print('worker', worker.pid, flush=True)\n"
              "print('auto: a step of the largest micro-batch (9 tokens) takes 6.30 GiB with every block recomputed, "
              "and each block kept holds 0.42 GiB of activations', flush=True)\n"
              "time.sleep(120)\n")
    started = time.monotonic()
    line, output = run_until([sys.executable, "-c", script], FIT_LINE, 50, ENV, tmp_path / "probe.log")
    assert time.monotonic() - started < 30
    assert line is not None and "6.30 GiB" in line and (tmp_path / "probe.log").read_text().startswith("worker")
    worker = int(output.split()[1])
    assert not alive(worker) and alive(os.getpid())
    line, _ = run_until([sys.executable, "-c", "print('no fit here')"], FIT_LINE, 50, ENV, tmp_path / "none.log")
    assert line is None


def test_command_startup_refuses_freeze_without_a_run_and_patches_names_meshtune_still_has(monkeypatch, capsys):
    """The script swaps meshtune's collection choices by name in its child process: a renamed one would leave both
    sides the same, and the report would compare a run with itself."""
    import command_startup

    from meshtune import cli
    from meshtune.train import loop

    assert "cli.COMMAND_GC_THRESHOLD" in command_startup.RUN and cli.COMMAND_GC_THRESHOLD != (700, 10, 10)
    assert "loop.libraries_frozen" in command_startup.RUN and loop.libraries_frozen.__module__.endswith("collection")
    assert "cli.rare_collections()" in command_startup.IMPORT and callable(cli.rare_collections)
    monkeypatch.setattr(sys, "argv", ["command_startup.py", "--import-only", "--compare", "freeze"])
    with pytest.raises(SystemExit) as exit_:
        command_startup.main()
    assert exit_.value.code == 2 and "--compare freeze needs --config" in capsys.readouterr().err


@pytest.mark.slow
def test_command_startup_alternates_the_two_sides_and_reports_their_medians(tmp_path, tiny_model_dir, tiny_dataset):
    from conftest import base_config, write_config

    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2,
                                                  gc_interval=50))
    proc = run([sys.executable, str(REPO / "bench" / "command_startup.py"), "--config", str(config), "--compare",
                "freeze", "--repeats", "1", "--json", str(tmp_path / "runs.json")], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "runs.json").read_text())
    assert [run["side"] for run in report["runs"]] == ["frozen", "unfrozen"]
    assert all(run["cpu_s"] > 0 for run in report["runs"]) and "cpu_ratio" in report["summary"]
    assert "cpu frozen / unfrozen, paired:" in proc.stdout


def test_the_projection_scales_the_formulas_bytes_by_what_the_shaped_link_counted(tmp_path, tiny_model_dir,
                                                                                  tiny_dataset, monkeypatch):
    """scaling_model --from-link: each mode's measured / predicted bytes on the link calibrate its projection; a
    mode measured at 1.5x its formula's bytes is projected slower than at 1x, and the faster link is never worse."""
    import scaling_model
    from meshtune.config import build_config
    from meshtune.crossing import sent_by_each_node
    from meshtune.doctor.traffic import model_facts, step_collectives

    from conftest import base_config

    base = base_config(str(tiny_model_dir), str(tiny_dataset), "out", finetuning_type="lora")
    variants = {"lora-ddp": {"parallel": "ddp"}, "lora-ddp-bf16": {"parallel": "ddp", "grad_reduce_dtype": "bf16"}}
    # the tiny bench shape stands for LoRA 7B (a 7B skeleton with peft's adapters takes tens of seconds to count)
    monkeypatch.setitem(scaling_model.PROJECTED, "lora-7b", ("tiny", "lora", 14556.0, "the test's rate"))
    rows = []
    for name, keys, measured_over_predicted in (("lora-ddp", variants["lora-ddp"], 1.0),
                                                ("lora-ddp-bf16", variants["lora-ddp-bf16"], 1.5)):
        cfg = build_config({**base, **keys})
        predicted = sent_by_each_node(step_collectives(cfg, "ddp", model_facts(cfg), False, True, 4, None, 2, True), 2)
        rows.append({"variant": name, "tx_per_node": {"median": predicted * measured_over_predicted}})
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"nodes": 2, "nproc_per_node": 2, "base_config": base, "variants": variants,
                                "rows": rows}))
    scaling_model.main(["--from-link", str(link), "--jobs", "lora-7b", "--nodes", "2,8", "--out",
                        str(tmp_path / "projection")])
    result = json.loads((tmp_path / "projection.json").read_text())
    assert result["calibration"] == pytest.approx({"lora-ddp": 1.0, "lora-ddp-bf16": 1.5})
    eff = {(r["mode"], r["nodes"], r["gbps"]): r["efficiency"] for r in result["rows"]}
    # bf16 halves the bytes, the link counted 1.5x: 0.75 of fp32's, so still faster, but not twice
    plain, half = (scaling_model.projected_step(build_config({**base, **variants[n]}), "ddp",
                                                scaling_model.model_facts(scaling_model.Job("x", "tiny", "lora", 4, 1)),
                                                2, 8, 1.25e9, 0.158, r) for n, r in (("lora-ddp", 1.0),
                                                                                      ("lora-ddp-bf16", 1.5)))
    assert half["bytes_a_node"] == pytest.approx(0.75 * plain["bytes_a_node"])
    assert eff[("lora-ddp", 2, 10.0)] < eff[("lora-ddp", 2, 100.0)] < eff[("lora-ddp", 2, 400.0)] < 1
    # a stage a node, 4 one-sequence micro-batches a GPU x 2 stages a pipeline: 1f1b simulated over the stages the
    # run builds (the tiny model's block each, its large head on the last): slower than equal stages' 8 / (8 + 2 - 1)
    pipeline = next(r for r in result["rows"] if (r["mode"], r["nodes"], r["gbps"]) == ("lora-pp-mb1", 2, 400.0))
    assert 0 < pipeline["bubble_s"] and pipeline["step_s"] > 2304 / 14556 * 9 / 8 and pipeline["efficiency"] < 8 / 9


def test_the_projection_prices_pipeline_levers_not_built_and_leaves_the_other_modes_alone(tmp_path, monkeypatch):
    """scaling_model --what-if: hop-bytes=0.5 halves what each node sends in the pipeline rows and never slows them;
    even-stages gives every stage the mean stage's cost (the tiny model's large head no longer on one stage); the
    data-parallel rows do not change; a lever that is not one is refused naming the choices."""
    import scaling_model

    monkeypatch.setitem(scaling_model.PROJECTED, "lora-7b", ("tiny", "lora", 14556.0, "the test's rate"))

    def rows(*what_if: str) -> dict:
        out = tmp_path / f"projection{len(what_if)}"
        scaling_model.main(["--project", "--jobs", "lora-7b", "--nodes", "2,4", "--link-gbps", "10", "--out",
                            str(out), *what_if])
        result = json.loads(out.with_suffix(".json").read_text())
        return {(r["mode"], r["nodes"]): r for r in result["rows"]}, result["what_if"]

    built, none = rows()
    halved, said = rows("--what-if", "hop-bytes=0.5")
    even, _ = rows("--what-if", "even-stages")
    assert none == "" and said == "the hops at 0.5 of their bf16 bytes"
    pipeline = [key for key in built if "-pp" in key[0]]
    assert pipeline and all(halved[k]["bytes_a_node"] == pytest.approx(built[k]["bytes_a_node"] / 2) for k in pipeline)
    assert all(halved[k]["efficiency"] >= built[k]["efficiency"] for k in pipeline)
    assert any(halved[k]["efficiency"] > built[k]["efficiency"] for k in pipeline)
    assert any(even[k]["efficiency"] != built[k]["efficiency"] for k in pipeline)
    assert all(halved[k] == built[k] == even[k] for k in built if k not in pipeline)
    assert scaling_model.WhatIf.parse("even-stages, hop-bytes=0.5") == scaling_model.WhatIf(True, 0.5)
    for bad, named in (("odd-stages", "choose from even-stages, hop-bytes=SHARE"), ("hop-bytes=2", "in (0, 1]")):
        with pytest.raises(ValueError, match=re.escape(named)):
            scaling_model.WhatIf.parse(bad)
    with pytest.raises(SystemExit):
        scaling_model.main(["--job", "full-1.5b", "--compute-step-s", "1", "--what-if", "even-stages"])


def test_a_variant_sets_its_runs_environment_variables_apart_from_its_config(monkeypatch, tmp_path):
    """`--variants "...,env.NAME=VALUE"`: NAME reaches that run's environment and never its config."""
    import speed_table
    import yaml
    from workspace import parse_variant, run_environment

    assert run_environment(parse_variant("memory_budget=6.5,env.TORCHINDUCTOR_CPP_WRAPPER=1")) == (
        {"memory_budget": 6.5}, {"TORCHINDUCTOR_CPP_WRAPPER": "1"})
    seen = {}

    def run_captured(cmd, timeout, env=None, log=None):
        seen.update(env=env, config=yaml.safe_load(Path(cmd[-1]).read_text()))
        return 1, "meshtune: error: stopped here"

    monkeypatch.setattr(speed_table, "run_captured", run_captured)
    args = speed_table.parse_args(["--rows", "lora-tiny", "--steps", "8"])
    result = speed_table.meshtune_row(args, "lora-tiny", speed_table.ROWS["lora-tiny"],
                                      "env.TORCHINDUCTOR_CPP_WRAPPER=1,padding_free=false", 0, tmp_path / "model",
                                      tmp_path / "data.jsonl", tmp_path, None, speed_table.Deadline(None))
    assert result["error"].startswith("meshtune: error: stopped here")
    assert seen["env"]["TORCHINDUCTOR_CPP_WRAPPER"] == "1" and seen["config"]["padding_free"] is False
    assert not any(key.startswith("env.") for key in seen["config"])


def test_the_projection_takes_the_plan_s_pipeline_pricing_apart(tmp_path):
    """scaling_model --what-if in-step prices a node's pipelines as crossing.pipeline_step does (every pipeline's
    sends a hop), shared-link simulates them one by one in step; the plan's own pricing (no what-if) staggers them
    where that is shorter, so it is never slower than in step, and no lever of a data-parallel row changes."""
    import scaling_model
    from pipeline_levers import WhatIf

    def rows(*what_if: str) -> dict:
        out = tmp_path / f"projection{len(what_if)}"
        scaling_model.main(["--project", "--jobs", "full-7b", "--nodes", "2,4", "--link-gbps", "100", "--out", str(out),
                            *what_if])
        return {(r["mode"], r["nodes"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}

    built, in_step = rows(), rows("--what-if", "in-step")
    assert built[("pp-mb1-zbv", 4)]["staggered"] and not in_step[("pp-mb1-zbv", 4)]["staggered"]
    assert built[("pp-mb1-zbv", 4)]["efficiency"] > 0.9 > in_step[("pp-mb1-zbv", 4)]["efficiency"]
    assert all(built[k]["efficiency"] >= in_step[k]["efficiency"] for k in built)
    assert all(built[k] == in_step[k] for k in built if "pp" not in k[0])
    assert WhatIf.parse("in-step,hop-bytes=0.5") == WhatIf(False, 0.5, "in-step")
    with pytest.raises(ValueError, match="one of in-step, shared-link"):
        WhatIf.parse("in-step,shared-link")
