"""`meshtune launch --scheduler`: the PyTorchJob against the training operator's schema, the PBS script running a real
two-node job through stand-ins for pbsdsh and ssh, the SLURM script's stop-and-requeue path through stand-ins for
srun, scancel and scontrol, and the errors of the command."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import base_config, kill_tree, read_metrics, run_cli_here, write_config
from meshtune.cli import main

SCHEMA = json.loads((Path(__file__).parent / "fixtures" / "kubeflow" / "pytorchjob-v1.schema.json").read_text())
SCHEDULER_VARIABLES = ("SLURM_", "PBS_", "PET_", "TORCHELASTIC_")
NODE_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "GPUS_PER_NODE", "RANK",
                  "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def generate(capsys, *args: str) -> str:
    """`meshtune launch ARGS` in this process; the job file it printed."""
    code = main(["launch", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def small_config(tmp_path: Path, **extra) -> Path:
    values = {"model_name_or_path": "/shared/models/qwen", "dataset": "/shared/data/train.jsonl",
              "output_dir": "/shared/runs/qwen-lora", "save_steps": 50, **extra}
    return write_config(tmp_path, **values)


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without anything node detection reads, stand-ins first on PATH, a home of its own."""
    kept = {key: value for key, value in os.environ.items()
            if not key.startswith(SCHEDULER_VARIABLES) and key not in NODE_VARIABLES}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**kept, "PATH": f"{tmp_path / 'bin'}:{kept['PATH']}", "HOME": str(home), "PYTHONUNBUFFERED": "1",
            "STUB_LOG": str(tmp_path / "stub.log"), **extra}


def stand_in(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def run_script(script: Path, env: dict[str, str], timeout: float, meanwhile=None):
    """bash SCRIPT, everything it starts killed on the way out; `meanwhile(process)` runs while it does."""
    process = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=env["HOME"])
    try:
        if meanwhile:
            meanwhile(process)
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        pytest.fail(f"{script.name} did not finish in {timeout} s:\n{process.communicate()[0][-4000:]}")
    finally:
        kill_tree(process.pid)
    return process.returncode, output


# ---- Kubernetes


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as `kubectl apply --validate=strict` does (the CRD alone prunes them)."""
    node = dict(schema)
    if "properties" in node:
        node["properties"] = {name: strict(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = strict(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            node[key] = [strict(sub) for sub in node[key]]
    return node


VALIDATOR = jsonschema.Draft4Validator(strict(SCHEMA))


def schema_errors(job: dict) -> list[str]:
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in VALIDATOR.iter_errors(job)]


def pytorchjob(text: str) -> tuple[dict | None, dict]:
    documents = list(yaml.safe_load_all(text))
    jobs = [doc for doc in documents if doc["kind"] == "PyTorchJob"]
    maps = [doc for doc in documents if doc["kind"] == "ConfigMap"]
    assert len(jobs) == 1 and len(maps) <= 1
    return (maps[0] if maps else None), jobs[0]


@pytest.mark.parametrize("nodes, gpus, extra", [(3, 8, ["--elastic", "2:4", "--namespace", "ml"]), (1, 0, []),
                                                (2, 4, ["--cpus-per-node", "16", "--job-name", "qwen-a"])])
def test_the_pytorchjob_validates_against_the_training_operators_schema(capsys, tmp_path, nodes, gpus, extra):
    config = small_config(tmp_path)
    text = generate(capsys, "--scheduler", "k8s", str(config), "learning_rate=1e-4", "--nodes", str(nodes),
                    "--gpus-per-node", str(gpus), "--image", "registry.example.com/meshtune:1", "--pvc", "shared-rwx",
                    *extra)
    config_map, job = pytorchjob(text)
    assert schema_errors(job) == []
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1  # the operator's webhook refuses any other count
    assert ("Worker" in specs) == (nodes > 1) and (nodes == 1 or specs["Worker"]["replicas"] == nodes - 1)
    assert job["spec"]["nprocPerNode"] == str(gpus or 1)
    assert config_map["data"]["config.yaml"] == config.read_text()
    for spec in specs.values():
        assert spec["restartPolicy"] == "ExitCode"
        pod = spec["template"]["spec"]
        container, = pod["containers"]
        assert container["name"] == "pytorch"  # where the operator puts MASTER_ADDR and PET_*
        assert container["command"] == ["meshtune", "launch", "/etc/meshtune/config.yaml", "learning_rate=1e-4"]
        assert container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == (gpus or None)
        assert "NCCL_NVLS_ENABLE" not in {variable["name"] for variable in container["env"]}
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert mounts["output"] == "/shared/runs/qwen-lora"
        assert volumes["output"]["persistentVolumeClaim"] == {"claimName": "shared-rwx"}
        assert mounts["shm"] == "/dev/shm" and volumes["shm"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert pod["terminationGracePeriodSeconds"] > 60 + 30  # stop_grace_period and torchrun's 30 s
    if "--elastic" in extra:
        assert job["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4}
        assert job["metadata"]["namespace"] == config_map["metadata"]["namespace"] == "ml"
    if "--job-name" in extra:
        assert job["metadata"]["name"] == "qwen-a"
        assert specs["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == 16


def test_the_configs_model_and_data_are_mounted_or_named_in_a_warning(capsys, tmp_path):
    """The pods read the config's paths as written: --mount puts the claims that hold them there; what no volume of
    the job holds is named on stderr and in the manifest, since the pods would not find it."""
    config = small_config(tmp_path, eval_dataset="eval.jsonl", tokenized_path="/cache/tokens")
    base = ["--scheduler", "k8s", str(config), "--nodes", "2", "--gpus-per-node", "8", "--image", "meshtune:1",
            "--pvc", "shared-rwx"]
    code = main(["launch", *base])
    bare = capsys.readouterr()
    assert code == 0
    missing = ("model_name_or_path /shared/models/qwen, dataset /shared/data/train.jsonl, eval_dataset eval.jsonl "
               "(relative: in the image's working directory), tokenized_path /cache/tokens")
    assert bare.err == (f"meshtune: warning: the PyTorchJob mounts output_dir (--pvc shared-rwx) and the config, not "
                        f"{missing}: the pods find them only if the image holds them; mount the claim that holds them "
                        f"with --mount CLAIM:PATH[:ro]\n")
    assert f"# not on any volume above, so the image must hold them: {missing}\n" in bare.out

    text = generate(capsys, *base, "--mount", "models:/shared/models:ro", "--mount", "data:/shared/data/",
                    "--mount", "cache:/cache", "eval_dataset=/shared/data/eval.jsonl")
    _, job = pytorchjob(text)
    assert schema_errors(job) == [] and "not on any volume" not in text
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        mounts = {mount["name"]: mount for mount in pod["containers"][0]["volumeMounts"]}
        claims = {volume["name"]: volume.get("persistentVolumeClaim") for volume in pod["volumes"]}
        assert [(mounts[name]["mountPath"], mounts[name].get("readOnly", False), claims[name])
                for name in ("mount-0", "mount-1", "mount-2")] == [
            ("/shared/models", True, {"claimName": "models", "readOnly": True}),
            ("/shared/data", False, {"claimName": "data"}), ("/cache", False, {"claimName": "cache"})]
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    code = main(["launch", *base, "--mount", "models:/shared/models", "--mount", "data:/shared/data",
                 "--mount", "cache:/cache", "eval_dataset=/shared/data/eval.jsonl",
                 f"deepspeed={tmp_path / 'ds.json'}"])
    assert code == 0 and f"not deepspeed {tmp_path / 'ds.json'}:" in capsys.readouterr().err  # read by every pod
    named = small_config(tmp_path, dataset="alpaca_en_demo,identity", dataset_dir="/lf/data")
    code = main(["launch", *base[:2], str(named), *base[3:], "--mount", "models:/shared/models"])
    assert code == 0 and "not dataset_dir /lf/data:" in capsys.readouterr().err  # where dataset_info.json names them


@pytest.mark.parametrize("mount, message", [
    ("models", "--mount models: write CLAIM:PATH or CLAIM:PATH:ro"),
    ("Models:/m", "--mount Models:/m: write CLAIM:PATH"),
    ("models:relative", "--mount models:relative: write CLAIM:PATH"),
    ("models:/m:rw", "--mount models:/m:rw: write CLAIM:PATH"),
    ("models:/shared/runs/qwen-lora", "/shared/runs/qwen-lora is where output_dir (--pvc) is mounted"),
    ("models:/etc/meshtune", "/etc/meshtune is where the config is mounted"),
])
def test_a_mount_that_cannot_work_is_refused(capsys, tmp_path, mount, message):
    code = main(["launch", "--scheduler", "k8s", str(small_config(tmp_path)), "--nodes", "2", "--gpus-per-node", "8",
                 "--image", "meshtune:1", "--pvc", "shared-rwx", "--mount", mount])
    assert code == 1 and message in capsys.readouterr().err


def test_a_malformed_pytorchjob_fails_the_schema(capsys, tmp_path):
    text = generate(capsys, "--scheduler", "k8s", str(small_config(tmp_path)), "--nodes", "2", "--gpus-per-node",
                    "8", "--image", "img", "--pvc", "shared")
    _, job = pytorchjob(text)
    worker = ["spec", "pytorchReplicaSpecs", "Worker"]
    cases = {
        "replicas as text": (worker + ["replicas"], "two", "'two' is not of type 'integer'"),
        "a misspelt field": (worker + ["restartPolicyy"], "ExitCode", "'restartPolicyy' was unexpected"),
        "a pod without containers": (worker + ["template", "spec", "containers"], None, "'containers' is a required"),
        "GPUs that are no quantity": (worker + ["template", "spec", "containers", 0, "resources", "limits",
                                                "nvidia.com/gpu"], "eight", "does not match"),
    }
    for name, (path, value, message) in cases.items():
        broken = copy.deepcopy(job)
        parent = broken
        for key in path[:-1]:
            parent = parent[key]
        if value is None:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        errors = schema_errors(broken)
        assert any(message in error for error in errors), f"{name}: {errors}"


# ---- SLURM


@pytest.mark.slow
def test_the_slurm_script_requeues_signals_and_runs_one_launcher_per_node(capsys, tmp_path):
    config = small_config(tmp_path, stop_grace_period=30, master_port=29611)
    text = generate(capsys, "--scheduler", "slurm", str(config), "max_steps=100", "--nodes", "4", "--gpus-per-node",
                    "8", "--time", "1-00:00:00", "--partition", "gpu", "--account", "proj", "--cpus-per-node", "32")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@90", "#SBATCH --time=1-00:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --cpus-per-task=32", "#SBATCH --open-mode=append",
                 "export MASTER_PORT=29611", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in [text_line.strip() for text_line in text.splitlines()], line
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in text
    assert (f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=32 {sys.executable} -m meshtune launch "
            f"{config} max_steps=100 &") in text
    assert f"cd {Path.cwd()}" in text


def test_the_slurm_script_of_a_cpu_job_asks_for_no_gpu(capsys, tmp_path):
    text = generate(capsys, "--scheduler=slurm", str(small_config(tmp_path, nproc_per_node=2)), "--nodes=2",
                    "--gpus-per-node=0")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives and not any("gpu" in line.lower() for line in directives)
    assert "#SBATCH --signal=B:USR1@120" in directives  # the default stop_grace_period, 60 s, + 60


SLURM_STAND_INS = {
    # scontrol: the allocation's hosts, and requeue written down
    "scontrol": """#!/bin/bash
case "$1" in
  show) echo node-a; echo node-b ;;
  requeue) echo "requeue $2" >> "$STUB_LOG" ;;
esac
""",
    # srun: its command once, here, as the task of node 0; a SIGTERM to srun is a SIGKILL to the task
    "srun": """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
echo $$ > "$STUB_LOG.srun"
SLURM_NODEID=0 "$@" &
task=$!
echo $task > "$STUB_LOG.task"
trap 'kill -KILL $task' TERM
wait $task
while kill -0 $task 2>/dev/null; do wait $task; done
wait $task
""",
    # scancel --signal=TERM JOBID: the signal to the job's tasks, never to the batch script
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$STUB_LOG"
kill -TERM "$(cat "$STUB_LOG.task")"
""",
    # the python the file runs: a training that stops on SIGTERM, as meshtune does, with 143
    "fake-python": """#!/bin/bash
echo "python $* run ${SLURM_RESTART_COUNT:-0} master $MASTER_ADDR:$MASTER_PORT" >> "$STUB_LOG"
trap 'echo stopped >> "$STUB_LOG"; exit 143' TERM
for _ in $(seq 300); do sleep 0.1; done
""",
}


def in_wait(pid: int) -> bool:
    """Whether process `pid` (bash) is blocked waiting for a child, as in the script's `wait` for srun."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() == "do_wait"
    except OSError:
        return False


@pytest.mark.parametrize("signal_to_script, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)],
                         ids=["USR1-before-the-time-limit", "TERM-from-slurm"])
@pytest.mark.slow
def test_the_slurm_script_stops_the_training_before_the_time_limit_and_requeues(capsys, tmp_path, signal_to_script,
                                                                                requeued):
    for name, text in SLURM_STAND_INS.items():
        stand_in(tmp_path, name, text)
    script = tmp_path / "job.sbatch"
    script.write_text(generate(capsys, "--scheduler", "slurm", str(small_config(tmp_path)), "--nodes", "2",
                               "--gpus-per-node", "0", "--python", str(tmp_path / "bin" / "fake-python")))
    env = job_env(tmp_path, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]", SLURM_RESTART_COUNT="1")

    def signal_the_job(process):
        task = tmp_path / "stub.log.task"
        deadline = time.monotonic() + 60  # the stand-ins start in seconds, under a loaded machine's tens
        while not (task.exists() and in_wait(process.pid)) and time.monotonic() < deadline:  # its traps now run
            time.sleep(0.05)
        assert task.exists() and in_wait(process.pid), "the job's task had not started within 60 s"
        process.send_signal(signal_to_script)
        if signal_to_script == signal.SIGTERM:  # SLURM ending the job signals srun as well
            os.kill(int((tmp_path / "stub.log.srun").read_text()), signal.SIGTERM)

    code, output = run_script(script, env, timeout=30, meanwhile=signal_the_job)
    log = (tmp_path / "stub.log").read_text()
    assert "run 1 master node-a:29500" in log and f"launch {tmp_path / 'config.yaml'}" in log
    if requeued:  # USR1, SLURM's warning before the time limit: TERM to the tasks, then the job requeued
        assert code == 143, output
        assert "scancel --signal=TERM 4242" in log and "stopped" in log and "requeue 4242" in log
    else:  # SLURM itself ends the run (scancel, requeue, preemption): the script neither signals nor requeues
        # srun's own code (its task killed); 255 where bash lost it: srun ended while the script ran its TERM trap,
        # and bash 5.2's last `wait` then finds no status (seen under load, srun having exited 137)
        assert code in (128 + signal.SIGKILL, 255), output
        assert "SLURM is ending this run" in output
        assert "scancel" not in log and "requeue" not in log


# ---- PBS

PBSDSH = """#!/bin/bash
# pbsdsh on this machine: -n INDEX -- PROGRAM ARGS starts PROGRAM as PBS's task manager does, in the home
# directory with the job's PBS variables only (its node file missing, as on any node but the first); pbsdsh's exit
# status is 0 whatever the task's, and a SIGTERM to pbsdsh is passed on to the task
echo "pbsdsh $*" >> "$STUB_LOG"
[ "$1" = -n ] && shift 2
[ "$1" = -- ] && shift
cd "$HOME" || exit 1
env -i HOME="$HOME" PATH="$PATH" PYTHONPATH="${PYTHONPATH:-}" PYTHONUNBUFFERED=1 PBS_JOBID="$PBS_JOBID" \\
    PBS_ENVIRONMENT=PBS_BATCH PBS_NODEFILE=/var/spool/pbs/aux/"$PBS_JOBID" STUB_LOG="$STUB_LOG" "$@" &
task=$!
trap 'kill -TERM "$task"; exit 1' TERM
wait "$task"
exit 0
"""

SSH = """#!/bin/bash
# ssh to this machine: ssh [-o OPTION]... HOST COMMAND runs COMMAND through the login shell in the home directory,
# with none of the caller's variables, and exits with its status
echo "ssh $*" >> "$STUB_LOG"
while [ "$1" = -o ]; do shift 2; done
shift
cd "$HOME" || exit 255
exec env -i HOME="$HOME" PATH="$PATH" PYTHONPATH="${PYTHONPATH:-}" PYTHONUNBUFFERED=1 STUB_LOG="$STUB_LOG" \\
    /bin/bash -c "$*"
"""


def pbs_job(capsys, tmp_path: Path, config: Path, *options: str) -> Path:
    stand_in(tmp_path, "pbsdsh", PBSDSH)
    stand_in(tmp_path, "ssh", SSH)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("127.0.0.1\n127.0.0.1\nlocalhost\nlocalhost\n")  # two hosts, two slots each
    script = tmp_path / "job.pbs"
    assert main(["launch", "--scheduler", "pbs", str(config), "--nodes", "2", "--gpus-per-node", "0",
                 "--output", str(script), *options]) == 0
    assert "qsub" in capsys.readouterr().out
    return script


@pytest.mark.slow
def test_the_pbs_script_runs_a_two_node_job(capsys, tmp_path, tiny_model_dir, tiny_dataset):
    """Each node runs `meshtune launch cfg.yaml` with its rank, the node count and node 0's address: two agents on
    this machine train as two nodes, after the preflight's checks passed."""
    out = tmp_path / "out"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, out, max_steps=3, save_steps=2,
                                                  master_port=port))
    script = pbs_job(capsys, tmp_path, config)
    env = job_env(tmp_path, PBS_JOBID="77.pbs", PBS_NODEFILE=str(tmp_path / "nodefile"), PBS_ENVIRONMENT="PBS_BATCH")
    code, output = run_script(script, env, timeout=240)
    assert code == 0, output
    assert "node 0: 127.0.0.1" in output and "node 1 (localhost) exited with code 0" in output
    assert "this node's rank    1" in output and f"127.0.0.1:{port}" in output
    assert "preflight: 2 nodes, all checks passed" in output and "meshtune doctor" not in output
    log = (tmp_path / "stub.log").read_text()
    assert "pbsdsh -n 0 -- /bin/bash" in log and "pbsdsh -n 2 -- /bin/bash" in log  # the first line of each host
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3]
    assert (out / "checkpoint-2" / "COMPLETE").exists() and (out / "checkpoint-3" / "COMPLETE").exists()
    assert not (out / ".meshtune-pbs").exists()


FAKE_PYTHON = """#!/bin/bash
# a node's training: node FAILING fails at once, the others train until told to stop, and stop as meshtune does
echo "node $NODE_RANK of $NNODES, master $MASTER_ADDR:$MASTER_PORT, node file ${{PBS_NODEFILE:-unset}}, in $PWD" \\
    >> "$STUB_LOG"
[ "$NODE_RANK" = {failing} ] && exit 3
trap 'echo "node $NODE_RANK stopped" >> "$STUB_LOG"; exit 143' TERM
for _ in $(seq 300); do sleep 0.1; done
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["pbsdsh", "ssh"])
def test_the_pbs_script_stops_every_node_when_one_fails(capsys, tmp_path, launcher):
    fake = stand_in(tmp_path, "fake-python", FAKE_PYTHON.format(failing=1))
    script = pbs_job(capsys, tmp_path, small_config(tmp_path, output_dir=str(tmp_path / "out")), "--python", str(fake))
    env = job_env(tmp_path, PBS_JOBID="78.pbs", PBS_NODEFILE=str(tmp_path / "nodefile"),
                  MESHTUNE_PBS_LAUNCHER=launcher)
    code, output = run_script(script, env, timeout=30)
    log = (tmp_path / "stub.log").read_text()
    assert code == 3, output
    assert "node 1 (localhost) exited with code 3" in output and "node 0 (127.0.0.1) exited with code 143" in output
    assert "node 0 stopped" in log
    for rank in (0, 1):
        assert f"node {rank} of 2, master 127.0.0.1:29500, node file unset, in {Path.cwd()}" in log
    assert f"{launcher} " in log


@pytest.mark.slow
def test_the_pbs_script_stops_every_node_before_the_walltime(capsys, tmp_path):
    fake = stand_in(tmp_path, "fake-python", FAKE_PYTHON.format(failing="none"))
    config = small_config(tmp_path, output_dir=str(tmp_path / "out"), stop_grace_period=0)  # stops 60 s before
    script = pbs_job(capsys, tmp_path, config, "--python", str(fake), "--time", "0:01:01")
    assert "#PBS -l walltime=0:01:01" in script.read_text()
    env = job_env(tmp_path, PBS_JOBID="80.pbs", PBS_NODEFILE=str(tmp_path / "nodefile"))
    code, output = run_script(script, env, timeout=30)
    log = (tmp_path / "stub.log").read_text()
    assert code == 143, output
    assert "the walltime is near: stopping every node" in output and "failed" not in output
    assert "node 0 stopped" in log and "node 1 stopped" in log


@pytest.mark.slow
def test_a_node_file_with_fewer_hosts_than_asked_stops_the_job(capsys, tmp_path):
    script = pbs_job(capsys, tmp_path, small_config(tmp_path, output_dir=str(tmp_path / "out")))
    (tmp_path / "nodefile").write_text("node-a\nnode-a\n")
    env = job_env(tmp_path, PBS_JOBID="79.pbs", PBS_NODEFILE=str(tmp_path / "nodefile"))
    code, output = run_script(script, env, timeout=30)
    assert code == 1 and "PBS_NODEFILE lists 1 host(s) (node-a), the job asked for 2" in output


# ---- the command


@pytest.mark.parametrize("args, message", [
    (["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8", "--pvc", "shared"], "needs --image IMAGE"),
    (["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "img"], "needs --pvc NAME"),
    (["--scheduler", "slurm", "--nodes", "0", "--gpus-per-node", "8"], "--nodes 0: a job needs at least one node"),
    (["--scheduler", "slurm", "--gpus-per-node", "8"], "--scheduler needs --nodes N and --gpus-per-node G"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--queue", "gpu"],
     "--queue is an option of --scheduler pbs, not of slurm"),
    (["--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "8", "--time", "soon"], "--time soon: write minutes"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "1"], "--time 1 is shorter than"),
    (["--nodes", "2", "--gpus-per-node", "8"], "--nodes, --gpus-per-node, --output: options of a job file; add"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "2", "nproc_per_node=4"],
     "nproc_per_node: 4 processes per node, but --gpus-per-node 2"),
    (["--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "2", "node_rank=0"],
     "node_rank: 0 is set in the config"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "2", "nnodes=3"],
     "nnodes: 3 in the config, but the job asks for --nodes 2"),
    (["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "i", "--pvc", "p", "--elastic", "3:4"],
     "--elastic 3:4 with --nodes 2"),
    (["--scheduler", "k8s", "--nodes", "1", "--gpus-per-node", "8", "--image", "i", "--pvc", "p", "--elastic", "1:2"],
     "--nodes at least 2 (an elastic PyTorchJob needs a Worker)"),
    (["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "i", "--pvc", "p",
      "output_dir=runs/a"], "output_dir: runs/a is relative"),
    (["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "i", "--pvc", "p", "--job-name",
      "Qwen_7B"], "a PyTorchJob's name is lowercase letters"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--job-name", "my run"],
     "--job-name 'my run': start with a letter"),
    (["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "8", "learning_rat=1"],
     "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
])
def test_errors_name_the_option_and_what_to_do(capsys, tmp_path, args, message):
    output = tmp_path / "job.file"
    code = main(["launch", str(small_config(tmp_path)), *args, "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 1 and message in err, err
    assert not output.exists()  # nothing is written for a job that cannot run


def test_an_unknown_scheduler_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as stopped:  # argparse's usage error
        main(["launch", "--scheduler", "lsf", "cfg.yaml", "--nodes", "2", "--gpus-per-node", "8"])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "invalid choice: 'lsf'" in stderr and "'slurm', 'pbs', 'k8s'" in stderr


def test_a_value_a_template_names_but_was_not_given_stops_the_rendering():
    """The job files' templates see only what their function gives them: a name left out is an error, not an empty
    string in a script that a scheduler would run."""
    import jinja2

    from meshtune.launch.scheduler_files import JobRequest, render

    job = JobRequest(scheduler="slurm", nodes=2, gpus_per_node=8, config=None, launch_args=[], workdir=Path("/w"),
                     python="python", command_line="meshtune launch --scheduler slurm")
    with pytest.raises(jinja2.UndefinedError, match="master_port"):
        render("slurm.sh.j2", job=job, name="run", nodes="2 nodes", output_dir="/runs/a", launch_command="x",
               stop_grace_period=30, warn_s=90)


def test_launch_help_names_the_schedulers(capfd):
    result = run_cli_here(["launch", "--help"], capfd)
    assert result.returncode == 0
    for expected in ("--scheduler {slurm,pbs,k8s}", "--gpus-per-node", "--image", "--pvc", "docs/schedulers/"):
        assert expected in result.stdout


DOCS = Path(__file__).resolve().parents[1] / "docs" / "schedulers"
PAGES = {"slurm.md": ("bash", "qwen7b.sbatch", ["--scheduler", "slurm", "--nodes", "4", "--gpus-per-node", "8",
                                               "--cpus-per-node", "64", "--time", "24:00:00", "--partition", "gpu"]),
         "pbs.md": ("bash", "qwen7b.pbs", ["--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "4",
                                           "--cpus-per-node", "32", "--time", "12:00:00", "--queue", "gpu"]),
         "kubernetes.md": ("yaml", "qwen7b.yaml", ["--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "8",
                                                   "--image", "registry.example.com/meshtune:0.1", "--pvc",
                                                   "shared-rwx", "--mount", "models:/shared/models:ro", "--mount",
                                                   "data:/shared/data:ro"])}


@pytest.mark.parametrize("page", PAGES)
def test_the_scheduler_pages_show_what_the_command_writes(capsys, tmp_path, monkeypatch, page):
    """Each page's file is the command's output for the page's example config, written in /shared/project."""
    language, name, options = PAGES[page]
    text = (DOCS / page).read_text()
    config = text.split("# cfg.yaml\n", 1)[1].split("```", 1)[0] if page == "slurm.md" else \
        (DOCS / "slurm.md").read_text().split("# cfg.yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "cfg.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    python = [] if page == "kubernetes.md" else ["--python", "/shared/project/.venv/bin/python"]
    assert main(["launch", *options[:2], "cfg.yaml", *options[2:], *python, "--output", name]) == 0
    capsys.readouterr()
    written = (tmp_path / name).read_text().replace(str(tmp_path), "/shared/project")
    shown = text.split(f"```{language}\n", 1)[1].split("```\n", 1)[0]
    assert shown == written
