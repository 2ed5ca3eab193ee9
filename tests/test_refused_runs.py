"""A run refused at start (a resume with other values, missing data, a bad or pre-quantized model, output_dir in
use) changes no file of an existing output_dir: config.yaml and run_plan.json are written once a run is accepted.
A pre-quantized model is named before anything is tokenized, with what to use instead."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import yaml

from conftest import base_config, run_cli_here
from meshtune.config import build_config
from meshtune.errors import ConfigError, ModelError
from meshtune.launch.supervise import prepare_data_once
from meshtune.model.model_dir import check_model_dir

QUANTIZED = {  # quantization_config as the released -AWQ, -GPTQ / -Int4, AQLM and bnb-4bit models carry it
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "aqlm": {"quant_method": "aqlm", "in_group_size": 8, "nbits_per_codebook": 16, "num_codebooks": 1},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
}


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` by its relative path: (bytes, mtime in ns)."""
    return {str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(directory.rglob("*")) if path.is_file()}


def quantized_copy(model_dir: Path, into: Path, method: str) -> Path:
    shutil.copytree(model_dir, into)
    config = json.loads((into / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZED[method]}))
    return into


@pytest.mark.parametrize("method", sorted(QUANTIZED))
def test_a_pre_quantized_model_is_named_with_what_to_use_instead(tmp_path, tiny_model_dir, method):
    model = quantized_copy(tiny_model_dir, tmp_path / f"model-{method}", method)
    with pytest.raises(ModelError, match=rf"is a pre-quantized model \(config.json quantization_config: quant_method "
                                         rf"{method}.*unquantized base .* finetuning_type: qlora"):
        check_model_dir(model)


def test_a_pre_quantized_model_stops_the_launcher_and_a_run_before_tokenizing(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset, capfd):
    model = quantized_copy(tiny_model_dir, tmp_path / "model-awq", "awq")
    values = base_config(model, tiny_dataset, tmp_path / "out", tokenized_path=str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="pre-quantized model"):
        prepare_data_once(build_config(values), 2)  # the launcher's step before torchrun starts
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(values))
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode == 1 and "quant_method awq" in result.stdout.strip().splitlines()[-1]
    assert "Traceback" not in result.stdout and "optimum" not in result.stdout
    assert not [path for path in (tmp_path / "cache").rglob("*") if path.is_file()], "nothing was tokenized"


def test_the_launcher_counts_a_pipelines_stages_as_one_data_parallel_process(tmp_path, tiny_model_dir,
                                                                               tiny_dataset):
    """3 samples, one a process a step, dataloader_drop_last: 4 processes of pp 2 are 2 data-parallel ones, whose
    global batch of 2 the data fills; as 4 they would need 4 samples."""
    data = tmp_path / "three.jsonl"
    data.write_text("".join(tiny_dataset.read_text().splitlines(keepends=True)[:3]))
    values = base_config(tiny_model_dir, data, tmp_path / "out", tokenized_path=str(tmp_path / "cache"),
                         per_device_train_batch_size=1, gradient_accumulation_steps=1, dataloader_drop_last=True,
                         max_steps=1)
    prepare_data_once(build_config({**values, "pipeline_parallel": 2}), 4)
    with pytest.raises(ConfigError, match="one optimizer step needs a global batch of 4"):
        prepare_data_once(build_config(values), 4)


@pytest.fixture
def finished_run(tmp_path, tiny_model_dir, tiny_dataset, capfd):
    """A LoRA run that trained 2 steps with checkpoint-2 and final/, on copies of its model and data (which the
    refusals below move away or change)."""
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    shutil.copytree(tiny_model_dir, model)
    shutil.copy(tiny_dataset, data)
    values = base_config(model, data, tmp_path / "out", max_steps=2, save_steps=2)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(values))
    assert run_cli_here(["train", str(config)], capfd).returncode == 0
    assert {"config.yaml", "run_plan.json", "final/adapter_model.safetensors", "checkpoint-2/manifest.json"} <= \
        set(files_of(tmp_path / "out"))
    return config


def refused(config: Path, capfd, *overrides: str) -> str:
    """The last line of `meshtune train` refusing to run."""
    result = run_cli_here(["train", str(config), *overrides], capfd)
    assert result.returncode == 1, result.stdout
    return result.stdout.strip().splitlines()[-1]


def test_refused_runs_change_no_file_of_the_output_dir(finished_run, tmp_path, capfd):
    out = tmp_path / "out"
    before = files_of(out)
    assert "learning_rate: 0.005 -> 0.001" in refused(finished_run, capfd, "learning_rate=1e-3")
    assert files_of(out) == before

    os.rename(tmp_path / "train.jsonl", tmp_path / "moved.jsonl")
    assert "train.jsonl" in refused(finished_run, capfd)
    assert files_of(out) == before
    os.rename(tmp_path / "moved.jsonl", tmp_path / "train.jsonl")

    os.rename(tmp_path / "model", tmp_path / "moved-model")
    assert "is not a local directory" in refused(finished_run, capfd)
    assert files_of(out) == before
    quantized_copy(tmp_path / "moved-model", tmp_path / "model", "gptq")
    assert "pre-quantized model" in refused(finished_run, capfd)
    assert files_of(out) == before


def test_a_run_refused_because_another_job_holds_the_output_dir_changes_nothing(finished_run, tmp_path, capfd):
    out = tmp_path / "out"
    holder = {"run_id": "other-job", "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (out / ".meshtune-lock").write_text(json.dumps(holder))
    before = files_of(out)
    assert "is in use by another meshtune job: run other-job" in refused(finished_run, capfd)
    assert files_of(out) == before
