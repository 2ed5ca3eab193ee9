"""The speed table script end to end on CPU (tiny model, a stand-in peer): every row kind it prints, so a broken
bench script shows up here and not on a GPU machine whose time is counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PEER = """import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert args["--size"] == "tiny" and args["--mode"] == "lora" and args["--bs"] == "8", args
print("peer log line")
print(json.dumps({"tokens_per_s": 1000.0, "step_s": 2.0, "peak_gib": 1.5}))
"""


def test_speed_table_prints_meshtune_the_peer_and_rows_it_cannot_run(tmp_path):
    peer = tmp_path / "peer.py"
    peer.write_text(FAKE_PEER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "speed_table.py"), "--rows", "lora-tiny,lora-1.5b-2gpu",
                           "--steps", "7", "--peer", str(peer), "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "speed.json").read_text())["results"]
    ours, theirs, two_gpus = results
    assert ours["system"] == "meshtune" and ours["tokens_per_s"] > 0 and ours["first_loss"] > 0
    assert ours["compile_s_timed"] is None and ours["recompile_limit_hit"] is False  # no compile on CPU by default
    assert (tmp_path / "work" / "tiny" / "out-lora-tiny-v0" / "train.log").is_file()
    assert theirs == {"row": "lora-tiny", "system": "hf_trainer+peft", "gpus": 1, "bs": 8, "tokens_per_s": 1000.0,
                      "per_gpu": 1000.0, "mfu": None, "step_s": 2.0, "peak_gib": 1.5}
    assert two_gpus["skipped"] == "needs 2 GPUs, this machine has 0"
    table = (out / "speed.md").read_text()
    assert f"{ours['tokens_per_s'] / 1000:.2f}x" in table and "not run: needs 2 GPUs" in table

    merged = tmp_path / "merged"
    merged.mkdir()
    subprocess.run([sys.executable, str(REPO / "bench" / "speed_table.py"), "--merge", str(out / "speed.json"),
                    str(out / "speed.json"), "--out", str(merged)], check=True, capture_output=True, timeout=120, env=env)
    assert len(json.loads((merged / "speed.json").read_text())["results"]) == 6


def test_a_stream_passes_every_option_on_except_its_own():
    sys.path.insert(0, str(REPO / "bench"))
    from speed_table import child_argv

    argv = ["--streams", "--rows", "a,b", "--steps", "7", "--work=/w", "--no-peer", "--out", "/o", "--variants", "x=1"]
    assert child_argv(argv, "a", Path("/w/g1s0"), Path("/o/g1s0")) == [
        "--steps", "7", "--no-peer", "--variants", "x=1", "--rows", "a", "--work", "/w/g1s0", "--out", "/o/g1s0"]


def test_streams_stopped_early_still_merge_the_rows_that_finished(tmp_path):
    """Two variants of one row in one stream: SIGTERM twice once the first result is printed. The first row is in
    the merged table, the stream is stopped, and the script ends at once."""
    import signal
    import time

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "speed_table.py"), "--streams", "--rows", "lora-tiny",
                             "--variants", "default;default", "--steps", "7", "--no-peer", "--row-timeout", "200",
                             "--work", str(tmp_path / "work"), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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
            proc.kill()


def test_presets_name_rows_and_every_scaling_row_has_its_base_in_the_table():
    sys.path.insert(0, str(REPO / "bench"))
    from speed_table import DEFAULT_ROWS, PRESETS, ROWS, SCALING_8GPU, render

    assert all(ROWS[name].gpus <= 4 for name in DEFAULT_ROWS) and "full-7b-2gpu-zero3" not in DEFAULT_ROWS
    assert set(DEFAULT_ROWS) | set(SCALING_8GPU) | {"lora-tiny"} == set(ROWS)  # every row is in a preset
    for preset in PRESETS.values():  # the default table has no 2-GPU 7B rows: its 7B rows show no scaling
        for name in preset:
            base = ROWS[name].scaling_of
            if base and (preset is SCALING_8GPU or ROWS[name].size == "1.5b"):
                assert base in preset and ROWS[base].gpus < ROWS[name].gpus, (name, base)
    results = [dict(row="full-7b-2gpu-zero3", system="meshtune", variant="default", gpus=2, bs=4, tokens_per_s=12000,
                    per_gpu=6000, mfu=0.3, peak_gib=70.0),
               dict(row="full-7b-8gpu-zero3", system="meshtune", variant="default", gpus=8, bs=4, tokens_per_s=45600,
                    per_gpu=5700, mfu=0.29, peak_gib=30.0)]
    table = render(results, dict(device="cpu", gpus=8, peak_tflops=None, args=dict(steps=25, minlen=128, maxlen=1024)))
    assert "| full-7b-8gpu-zero3 | default | meshtune | 8 | 4 | 45,600 | 5,700 |  | 29.0% | 30.0 | 95.0% |" in table


def test_an_unknown_row_is_named_with_the_choices():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "speed_table.py"), "--rows", "lora-1.5b,lora-15b"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "unknown row(s) lora-15b" in proc.stderr and "scaling-8gpu" in proc.stderr


def test_two_agent_speed_script_runs_both_layouts_on_cpu(tmp_path):
    """bench/gpu_two_agents.py --speed end to end with the tiny job: two agents (one process each) as two nodes,
    then one agent with both processes; a broken script shows up here, not on a GPU machine."""
    import signal

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "gpu_two_agents.py"), "--speed", "--jobs", "lora-tiny",
                             "--modes", "ddp", "--gpus-per-node", "1", "--steps", "7", "--job-timeout", "150",
                             "--work", str(tmp_path / "work"), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output = proc.communicate(timeout=400)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    rows = json.loads((out / "two_agents_speed.json").read_text())
    assert [(r["layout"], r["exit_codes"]) for r in rows] == [("2 nodes, sockets", [0, 0]), ("1 node, NVLink", [0])]
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in rows), rows
    assert "| lora-tiny | ddp | 2 nodes, sockets |" in output


def test_a_second_sigterm_cannot_cut_the_merge():
    """GNU timeout sends SIGTERM to the script and then to its process group: the first one starts the merge, and
    from then on SIGTERM is ignored."""
    import signal

    sys.path.insert(0, str(REPO / "bench"))
    from speed_table import stop_once

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="merging"):
            stop_once(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_collective_probe_prints_every_collective_and_size(tmp_path):
    """bench/allreduce_probe.py on two gloo ranks (on the device it runs on NCCL): one line per collective and size."""
    from test_checkpoint import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(REPO / "bench" / "allreduce_probe.py"), "--sizes-mb", "1,2",
                             "--unit-params-m", "0.5"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("gloo ")]
    assert [line.split(" MB")[0].split(" ", 2)[2] for line in lines] == [
        "all_reduce fp32 1", "all_reduce fp32 2", "all_gather bf16 (0.5M params) 1",
        "reduce_scatter fp32 (0.5M params) 2"], result.stdout
    assert all("bus bandwidth" in line and " ms," in line for line in lines)


def test_the_qlora_row_is_judged_against_our_lora_row():
    """The Q-LoRA target is relative to meshtune's own LoRA 7B (tokens/s and peak memory): the table says both."""
    sys.path.insert(0, str(REPO / "bench"))
    from speed_table import render

    results = [dict(row="lora-7b", system="meshtune", variant="default", gpus=1, bs=4, tokens_per_s=9000,
                    per_gpu=9000, mfu=0.5, peak_gib=20.0),
               dict(row="qlora-7b", system="meshtune", variant="torch_compile=true", gpus=1, bs=4, tokens_per_s=6750,
                    per_gpu=6750, mfu=0.37, peak_gib=7.0)]
    summary = dict(device="H100", gpus=1, peak_tflops=790.0, args=dict(steps=25, minlen=128, maxlen=1024))
    line = next(line for line in render(results, summary).splitlines() if line.startswith("| qlora-7b"))
    assert "0.75x lora-7b, 35% of its memory" in line, line
