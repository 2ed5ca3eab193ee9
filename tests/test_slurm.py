"""The sbatch file `meshtune launch --scheduler slurm` writes, run by a real SLURM cluster on this machine
(tests/slurm_cluster.py: slurmctld and two slurmd nodes, each in its own network namespace). A two-node job is
requeued by `scontrol requeue` after its first checkpoint, then warned of its time limit (the USR1 that the
script's `--signal=B:USR1@` asks for) after a checkpoint of its second run: each time meshtune stops with a
checkpoint, the job runs again and resumes, and it trains to its last step with the losses and weights of an
uninterrupted run of the same config, exactly (gloo on CPU, one thread a process)."""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_config, read_metrics, run_cli_here, write_config
from ranks import run_meshtune_ranks
from slurm_cluster import SlurmUnavailable, slurm_cluster

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 16, 4
# a run of a job: two launchers and two workers importing torch on 2 cores (about 20 s), then 16 tiny steps
JOB_TIMEOUT = 180
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm():
    try:
        with slurm_cluster() as cluster:
            yield cluster
    except SlurmUnavailable as exc:
        pytest.skip(f"no SLURM cluster on this machine: {exc}")


def job_values(model: Path, dataset: Path, output: Path) -> dict:
    # stop_grace_period within the cluster's KillWait (15 s); a hang fails within a minute, not five
    return base_config(model, dataset, output, max_steps=STEPS, save_steps=SAVE_EVERY, stop_grace_period=10,
                       rdzv_timeout=60, ddp_timeout=60)


def submit(slurm, directory: Path, model: Path, dataset: Path, capfd, **env) -> tuple[str, Path]:
    """Writes the config and meshtune's sbatch file for 2 nodes without GPUs (`meshtune launch` in this process, in
    `directory`), and submits it from there."""
    directory.mkdir()
    output = directory / "out"
    config = write_config(directory, **job_values(model, dataset, output))
    script = directory / "job.sbatch"
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        result = run_cli_here(["launch", "--scheduler", "slurm", str(config), "--nodes", "2", "--gpus-per-node", "0",
                               "--output", str(script)], capfd)
    finally:
        os.chdir(cwd)
    assert result.returncode == 0, result.stdout
    # the script runs this interpreter; sbatch passes the environment on: this source tree, unbuffered logs
    source = str(Path(__file__).resolve().parents[1] / "src")
    job_env = {"PYTHONPATH": os.pathsep.join(filter(None, (source, os.environ.get("PYTHONPATH")))),
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    return slurm.sbatch(script, cwd=directory, env=job_env), output


def uninterrupted_run(directory: Path, model: Path, dataset: Path) -> Path:
    """The job's config trained without a stop, on the two ranks of one node (forked as torchrun would start them,
    one thread each: the same math as two nodes of one process). Its output folder."""
    directory.mkdir()
    output = directory / "out"
    config = write_config(directory, **{**job_values(model, dataset, output), "nproc_per_node": 2})
    result = run_meshtune_ranks(["train", str(config)], 2, directory / "ranks", env={"OMP_NUM_THREADS": "1"},
                                timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:]
    return output


def job_log(directory: Path) -> str:
    """The job's log (--output), every run of a requeued job appended to it."""
    return "\n".join(path.read_text(errors="replace") for path in sorted(directory.glob("*.out")))


def checkpoints(output: Path) -> list[int]:
    """The steps of the published checkpoints (a save in progress is checkpoint-N.tmp)."""
    return sorted(int(path.name.split("-")[1]) for path in output.glob("checkpoint-*")
                  if path.name.split("-")[1].isdigit() and (path / "COMPLETE").exists())


def wait_while_running(slurm, job: str, until, what: str, directory: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not until():
        info = slurm.job(job)
        assert info["JobState"] not in FINISHED and time.monotonic() < deadline, \
            f"job {job} {info['JobState']} before {what}:\n{job_log(directory)[-4000:]}\n{slurm.log_tails()}"
        time.sleep(0.2)


def adapter(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "final" / "adapter_model.safetensors")


def test_a_two_node_job_requeued_then_warned_of_its_time_limit_ends_as_an_uninterrupted_run(slurm, tmp_path,
                                                                                            tiny_model_dir,
                                                                                            tiny_dataset, capfd):
    # 0.4 s a step: each interruption lands while the run is between a checkpoint and its last step
    directory = tmp_path / "interrupted"
    job, output = submit(slurm, directory, tiny_model_dir, tiny_dataset, capfd, MESHTUNE_FAULT="slow:0.4")
    with ThreadPoolExecutor(1) as pool:  # the run it is held to trains while SLURM runs the job
        reference = pool.submit(uninterrupted_run, tmp_path / "clean", tiny_model_dir, tiny_dataset)
        wait_while_running(slurm, job, lambda: checkpoints(output), "its first checkpoint", directory)
        slurm.run("scontrol", "requeue", job)
        second_run = {"Restarts": "1", "JobState": "RUNNING"}
        wait_while_running(slurm, job, lambda: second_run.items() <= slurm.job(job).items(), "its second run",
                           directory)
        first_stop = checkpoints(output)[-1]  # the run that SLURM ended saved it, or it is the periodic one
        wait_while_running(slurm, job, lambda: checkpoints(output)[-1] > first_stop,
                           "a checkpoint of its second run", directory)
        slurm.run("scancel", "--batch", "--signal=USR1", job)  # SLURM's warning before the time limit
        info = slurm.wait_for_job(job, FINISHED, JOB_TIMEOUT)
        clean = reference.result()
    log = job_log(directory)
    assert (info["JobState"], info["ExitCode"], info["Restarts"], info["NodeList"]) == (
        "COMPLETED", "0:0", "2", "n[1-2]"), log[-4000:]
    assert re.search(r"this node's rank\s+1\s+\(SLURM SLURM_NODEID\)", log) and re.search(r"master\s+n1:29500", log)
    stops = [int(step) for step in re.findall(rf"stopped by SIGTERM at step (\d+) of {STEPS}", log)]
    resumes = [int(step) for step, at in re.findall(rf"resumed from \S*checkpoint-(\d+) at step (\d+) of {STEPS}", log)
               if step == at]
    assert len(stops) == 2 and resumes == stops, log[-6000:]  # each run resumed from the checkpoint of its stop
    assert "the time limit is near" in log and f"requeueing job {job} (exit code 143)" in log, log[-6000:]
    assert [r["step"] for r in read_metrics(output) if "loss" in r] == list(range(1, STEPS + 1)), log[-4000:]
    assert checkpoints(output)[-1] == STEPS and (output / "final").is_dir()
    assert [r["loss"] for r in read_metrics(output)] == [r["loss"] for r in read_metrics(clean)]
    ours, reference = adapter(output), adapter(clean)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
