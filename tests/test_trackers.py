"""report_to: every metrics.jsonl record reaches TensorBoard, W&B (offline) and MLflow, read back with each one's own
reader; a resumed run continues the same tracker runs; refusals name the key and value before anything starts."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import base_config, read_metrics, run_cli_here, write_config
from meshtune.train import trackers

# ---- each tracker's own reader


def tensorboard_series(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard shows: its EventAccumulator, which drops the steps a purge_step discarded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def tensorboard_text(log_dir: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [tensor_util.make_ndarray(event.tensor_proto).item().decode()
            for event in accumulator.Tensors(f"{tag}/text_summary")]


def tensorboard_raw_steps(log_dir: Path, tag: str) -> list[int]:
    """Every event of `tag` in the files, as written (no purge applied)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return [event.step for path in sorted(log_dir.glob("events.out.tfevents.*"))
            for event in LegacyEventFileLoader(str(path)).Load()
            if any(value.tag == tag for value in event.summary.value)]


def mlflow_client(output_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(output_dir / "mlruns").resolve().as_uri())


def mlflow_series(output_dir: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow_client(output_dir).get_metric_history(run_id, key))


def wandb_records(run_file: Path) -> list:
    """The records of a W&B offline run file, parsed by W&B's own protobuf `Record`. The file is W&B's transaction
    log in LevelDB's log format: a 7-byte header, then 32 KiB blocks of chunks (crc32 of type and data, length,
    type: full, or first / middle / last of a record split across blocks), a block's tail under 7 bytes padded."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B transaction log"
    records, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:  # zeros: the end of what was written
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{run_file}: a damaged chunk"
        pending += chunk
        if kind in (1, 4):  # a whole record, or a split one's last chunk
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(output_dir: Path) -> list[dict]:
    """Each offline run file under output_dir/wandb/, oldest first: its run id, config and history rows."""
    runs = []
    for run_file in sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"id": None, "config": {}, "history": []}
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
        runs.append(run)
    return runs


def wandb_series(runs: list[dict], key: str) -> list[tuple[int, float]]:
    """A key's value by step over the run files of one W&B run, as W&B keeps it: the first value logged at a step."""
    series: dict[int, float] = {}
    for run in runs:
        for row in run["history"]:
            if key in row:
                series.setdefault(row["_step"], row[key])
    return sorted(series.items())


def jsonl_series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def float32(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """TensorBoard's scalars are float32."""
    return [(step, float(np.float32(value))) for step, value in series]


# ---- a run, and its resume


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, its settings and caches in the test's folder; MLflow in output_dir's store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow  # W&B starts its service process
@pytest.mark.timeout(300)
def test_every_record_reaches_each_tracker_and_a_resume_continues_their_runs(
        tmp_path, capfd, offline, tiny_model_dir, tiny_dataset):
    out = tmp_path / "out"
    config = write_config(tmp_path, **base_config(
        tiny_model_dir, tiny_dataset, out, max_steps=4, save_steps=2, save_final=False, val_size=8, eval_steps=2,
        report_to=["tensorboard", "mlflow", "wandb"]))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 0, result.stdout[-4000:]
    first = read_metrics(out)
    assert [r["step"] for r in first] == [1, 2, 3, 4] and len(jsonl_series(first, "eval_loss")) == 2
    runs = json.loads((out / "trackers.json").read_text())
    log_dir, run_id = out / runs["tensorboard"]["log_dir"], runs["mlflow"]["run_id"]
    plan = json.loads((out / "run_plan.json").read_text())

    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
        assert tensorboard_series(log_dir, key) == float32(jsonl_series(first, key)), key
        assert mlflow_series(out, run_id, key) == jsonl_series(first, key), key
        assert wandb_series(wandb_runs(out), key) == jsonl_series(first, key), key
    # the run plan as the run's config, and the checkpoints published
    assert json.loads(tensorboard_text(log_dir, "run_plan")[0]) == plan
    assert json.loads(Path(mlflow_client(out).download_artifacts(run_id, "run_plan.json", str(tmp_path))).read_text(
    )) == plan
    assert mlflow_client(out).get_run(run_id).data.params["run_plan.parallel"] == plan["parallel"]
    (run,) = wandb_runs(out)
    assert run["id"] == runs["wandb"]["id"] and run["config"]["run_plan"] == plan
    assert run["config"]["config"]["learning_rate"] == 5e-3
    assert [step for step, _ in tensorboard_series(log_dir, "checkpoint")] == [2, 4]
    assert mlflow_series(out, run_id, "checkpoint") == [(2, 2.0), (4, 4.0)]
    assert wandb_series([run], "checkpoint") == [(2, 2), (4, 4)]
    assert mlflow_client(out).get_run(run_id).info.status == "FINISHED"

    # a job that died after logging step 4 but before publishing checkpoint-4: the next resumes checkpoint-2
    shutil.rmtree(out / "checkpoint-4")
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "resumed from" in result.stdout
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert jsonl_series(resumed, "loss") == jsonl_series(first, "loss")  # the resume recomputes the same steps
    assert json.loads((out / "trackers.json").read_text()) == runs  # the same tracker runs
    assert tensorboard_raw_steps(log_dir, "loss") == [1, 2, 3, 4, 3, 4]  # steps 3 and 4 written twice...
    assert tensorboard_series(log_dir, "loss") == float32(jsonl_series(resumed, "loss"))  # ...and shown once
    assert tensorboard_text(log_dir, "resumed_from")[0].startswith(f"resumed from {out / 'checkpoint-2'} at step 2")
    runs_in_store = mlflow_client(out).search_runs([mlflow_client(out).get_run(run_id).info.experiment_id])
    assert [r.info.run_id for r in runs_in_store] == [run_id]
    for key in ("loss", "eval_loss"):
        assert mlflow_series(out, run_id, key) == jsonl_series(resumed, key), key
    assert mlflow_series(out, run_id, "resumed_from") == [(2, 2.0)]
    files = wandb_runs(out)
    assert [f["id"] for f in files] == [runs["wandb"]["id"]] * 2  # a second file of the same W&B run
    assert wandb_series(files, "loss") == jsonl_series(resumed, "loss")
    assert wandb_series(files[1:], "resumed_from") == [(2, 2)]


# ---- refusals, none, a failing tracker


@pytest.mark.parametrize("value, said", [
    ("swanlab", "meshtune does not write to swanlab; it writes to tensorboard, wandb, mlflow"),
    (["tensorboard", "comet_ml"], "meshtune does not write to comet_ml"),
    ("tensorbord", "unknown tracker 'tensorbord'; report_to takes none, all, tensorboard, wandb, mlflow"),
])
def test_report_to_refuses_other_trackers_naming_key_and_value(tmp_path, capfd, value, said):
    config = write_config(tmp_path, model_name_or_path="/m", dataset="d.jsonl", report_to=value)
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 1 and "Traceback" not in result.stdout
    assert f"report_to={value!r}" in result.stdout and said in result.stdout


def test_a_tracker_not_installed_is_named_before_anything_starts(tmp_path, capfd, monkeypatch, tiny_model_dir,
                                                                 tiny_dataset):
    monkeypatch.setattr(trackers, "installed", lambda name: name != "wandb")
    out = tmp_path / "out"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, out,
                                                  report_to=["tensorboard", "wandb"]))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 1 and "Traceback" not in result.stdout
    assert ("report_to: tensorboard, wandb needs wandb, not installed here: pip install 'meshtune[wandb]' "
            "(or pip install wandb)") in result.stdout
    assert not out.exists()  # refused before output_dir, the data or a process
    assert trackers.selected(["all"]) == ["tensorboard", "mlflow"]  # all: those installed


def test_none_writes_nothing_beside_metrics_jsonl(tmp_path, capfd, tiny_model_dir, tiny_dataset):
    """(With plot_loss false, as the tests' base config has it, not even loss.png.)"""
    out = tmp_path / "out"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, out, max_steps=2, save_final=False,
                                                  report_to="none"))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(read_metrics(out)) == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl", "run_plan.json", "tokenized"]


def test_a_failing_tracker_is_dropped_with_one_warning_and_training_goes_on(tmp_path, capfd, caplog, monkeypatch,
                                                                            tiny_model_dir, tiny_dataset):
    from meshtune.train.sinks import TensorBoardSink

    calls = []

    def broken(self, step, numbers, texts):
        calls.append(step)
        raise RuntimeError("the tracker's server went away")

    monkeypatch.setattr(TensorBoardSink, "log", broken)
    out = tmp_path / "out"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, out, max_steps=3, save_final=False,
                                                  report_to="tensorboard"))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert calls == [1]  # dropped after its first failure
    warnings = [r.getMessage() for r in caplog.records if "tensorboard failed" in r.getMessage()]
    assert warnings == ["warning: tensorboard failed logging step 1 (RuntimeError: the tracker's server went away); "
                        "nothing more goes to tensorboard in this run, output_dir/metrics.jsonl keeps every record"]


@pytest.mark.slow  # runs the mlflow command line
@pytest.mark.timeout(180)
def test_the_readmes_commands_list_the_mlflow_run_from_a_fresh_shell(tmp_path, monkeypatch):
    """The README's block, run as written in a shell that has none of meshtune's MLflow settings, finds the run a
    meshtune run wrote to output_dir/mlruns; the UI line names the full package, which mlflow-skinny is not."""
    import os
    import subprocess
    import sys

    from meshtune.train.sinks import MlflowSink

    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # so that what the sink sets in this process is undone after the test
        monkeypatch.delenv(name)
    sink = MlflowSink(tmp_path / "output", None, 0, "output")
    sink.log(1, {"loss": 1.5}, {})
    sink.close(True)
    experiment = sink.client.get_run(sink.run_id).info.experiment_id
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("#### Looking at meshtune's MLflow runs", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    assert lines[-1].startswith("pip install mlflow && mlflow ui --backend-store-uri output/mlruns")
    shell = "\n".join(["set -e", *lines[:-1]]).replace("--experiment-id ID", f"--experiment-id {experiment}")
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # this environment's mlflow
    done = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "meshtune" in done.stdout and sink.run_id in done.stdout
    without = subprocess.run(["bash", "-c", shell.replace("export MLFLOW_ALLOW_FILE_STORE=true ", "export ")],
                             env=env, capture_output=True, text=True, timeout=150)
    assert without.returncode != 0 and "MLFLOW_ALLOW_FILE_STORE" in without.stderr  # why the README sets it
