"""A crash in a worker is restarted and resumes exactly; a crash every attempt meets again stops the job at once
with the worker's own words as the last line, instead of burning every restart."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import base_config, read_metrics, run_cli, write_config
from ranks import run_meshtune_ranks


def job_config(tmp_path, model_dir, dataset, name: str):
    (tmp_path / name).mkdir()
    output = tmp_path / name / "output"
    return write_config(tmp_path / name, **base_config(model_dir, dataset, output, nproc_per_node=2, max_steps=6,
                                                       save_steps=2, max_restarts=2)), output


def job(tmp_path, model_dir, dataset, name: str, fault: str, timeout: float = 180):
    """`meshtune train` with this fault injected: the launcher and torchrun that restart the workers."""
    config, output = job_config(tmp_path, model_dir, dataset, name)
    result, seconds = run_cli(["train", str(config)], timeout=timeout, env={"MESHTUNE_FAULT": fault})
    return result, seconds, output


def uninterrupted(tmp_path, model_dir, dataset):
    """The same job without a fault, on the ranks torchrun would start (forked: no launcher to test here)."""
    config, output = job_config(tmp_path, model_dir, dataset, "clean")
    return run_meshtune_ranks(["train", str(config)], 2, tmp_path / "clean" / "ranks"), output


@pytest.mark.slow
def test_a_worker_that_fails_once_is_restarted_and_the_job_ends_as_if_nothing_happened(tmp_path, tiny_model_dir,
                                                                                        tiny_dataset):
    # the two jobs side by side (own output_dirs, ports and processes): most of the faulty one is single-threaded
    # start-up, and nothing here is timed
    with ThreadPoolExecutor(1) as pool:
        clean_job = pool.submit(uninterrupted, tmp_path, tiny_model_dir, tiny_dataset)
        result, _, output = job(tmp_path, tiny_model_dir, tiny_dataset, "fault", fault="raise:3:1")
        reference, clean = clean_job.result()
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert result.returncode == 0, result.stdout[-4000:]
    assert "fault injection: rank 1 fails after step 3" in result.stdout
    assert "resumed from" in result.stdout and "checkpoint-2 at step 2 of 6" in result.stdout
    assert [r["loss"] for r in read_metrics(output)] == [r["loss"] for r in read_metrics(clean)]
    weights = [hashlib.sha256((out / "final" / "adapter_model.safetensors").read_bytes()).hexdigest()
               for out in (clean, output)]
    assert weights[0] == weights[1]


@pytest.mark.alone
@pytest.mark.slow
def test_a_worker_that_fails_every_attempt_ends_the_job_quickly_with_its_message(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset):
    result, seconds, _ = job(tmp_path, tiny_model_dir, tiny_dataset, "always", fault="raise-always:3:1", timeout=120)
    assert result.returncode == 1, result.stdout[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("meshtune: error: rank 1 failed the same way in attempts 1 and 2"), result.stdout[-3000:]
    assert "fault injection: rank 1 fails after step 3" in last
    assert seconds < 60, seconds
