"""Ready-to-submit job files: a SLURM batch script, a PBS job script, a Kubeflow PyTorchJob for Kubernetes.

Each file places one `meshtune launch` on every node and leaves the rest to what meshtune already does there:
it reads the scheduler's variables for the node count and rank (launch/nodes.py), stops at a step boundary on
SIGTERM and saves a checkpoint within `stop_grace_period` (train/preemption.py), and resumes from `output_dir` when
started again. So a file only fixes what no scheduler gives (the rendezvous port), turns the scheduler's warning
before a time limit or preemption into that SIGTERM in time, and makes the job run again after it. No torch import.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from meshtune.errors import ConfigError
from meshtune.launch.nodes import node_range

SCHEDULERS = ("slurm", "pbs", "k8s")
DEFAULT_MASTER_PORT = 29500
# SLURM's options, PBS's and Kubernetes': each is refused under another scheduler, naming the one that has it
OWN_OPTIONS = {"slurm": ("partition", "account", "time"), "pbs": ("queue", "account", "time"),
               "k8s": ("image", "pvc", "namespace", "elastic")}
CONFIG_MOUNT = "/etc/meshtune"  # where a pod sees the config, from the ConfigMap
K8S_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
K8S_NAME_MAX = 40  # pods are named <job>-worker-<index>, which must stay within 63 characters


@dataclass(frozen=True)
class JobRequest:
    """What `meshtune launch --scheduler` was asked for. `launch_args` are the overrides and `--key value` flags
    given after the config, passed on to every node; `config` and `workdir` are absolute."""

    scheduler: str
    nodes: int
    gpus_per_node: int
    config: Path | None
    launch_args: list[str]
    workdir: Path
    python: str | None  # None: the image's `meshtune` (Kubernetes)
    command_line: str
    job_name: str | None = None
    time: str | None = None
    cpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    queue: str | None = None
    image: str | None = None
    pvc: str | None = None
    namespace: str | None = None
    elastic: str | None = None
    given: tuple[str, ...] = field(default=())  # the scheduler options given on the command line, by name


def job_file(job: JobRequest, cfg) -> str:
    """The file's text, after every check that would otherwise fail on the cluster."""
    check_request(job, cfg)
    render = {"slurm": slurm_script, "pbs": pbs_script, "k8s": pytorchjob_manifest}[job.scheduler]
    return render(job, cfg)


def check_request(job: JobRequest, cfg) -> None:
    """Options and config keys that cannot work with a scheduler file, each named with what to do instead."""
    if job.scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler {job.scheduler}: choose one of {', '.join(SCHEDULERS)}")
    if job.nodes < 1:
        raise ConfigError(f"--nodes {job.nodes}: a job needs at least one node")
    if job.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {job.gpus_per_node}: give the GPUs of each node, 0 for CPU only")
    if job.cpus_per_node is not None and job.cpus_per_node < 1:
        raise ConfigError(f"--cpus-per-node {job.cpus_per_node}: give at least 1, or leave it out")
    for name in job.given:
        owners = [scheduler for scheduler, names in OWN_OPTIONS.items() if name in names]
        if owners and job.scheduler not in owners:
            raise ConfigError(f"--{name.replace('_', '-')} is an option of --scheduler {' / '.join(owners)}, "
                              f"not of {job.scheduler}")
    if job.time is not None:
        walltime_seconds(job.time)
    if job.job_name is not None and not re.fullmatch(r"[A-Za-z][-\w.]*", job.job_name):
        raise ConfigError(f"--job-name {job.job_name!r}: start with a letter, then letters, digits, '-', '_' or '.'")
    for key in ("node_rank", "master_addr"):
        if getattr(cfg, key) is not None:
            raise ConfigError(f"{key}: {getattr(cfg, key)} is set in the config, but under a scheduler every node "
                              f"has its own: remove {key} from the config and its overrides")
    if cfg.nnodes is not None and cfg.nnodes != expected_nnodes(job):
        raise ConfigError(f"nnodes: {cfg.nnodes} in the config, but the job asks for --nodes {job.nodes}"
                          f"{f' --elastic {job.elastic}' if job.elastic else ''}: remove nnodes from the config "
                          f"(the scheduler gives it) or make them agree")
    if job.gpus_per_node and cfg.nproc_per_node and cfg.nproc_per_node > job.gpus_per_node:
        raise ConfigError(f"nproc_per_node: {cfg.nproc_per_node} processes per node, but --gpus-per-node "
                          f"{job.gpus_per_node}: each process needs a GPU; lower nproc_per_node or ask for more GPUs")
    if job.scheduler == "k8s":
        check_kubernetes(job, cfg)
    if job.scheduler != "k8s" and job.time is not None and walltime_seconds(job.time) <= stop_warning_s(cfg):
        raise ConfigError(f"--time {job.time} is shorter than the {stop_warning_s(cfg)} s the job needs to stop "
                          f"and save before it (stop_grace_period {cfg.stop_grace_period} s + 60): ask for more time")


def check_kubernetes(job: JobRequest, cfg) -> None:
    if not job.image:
        raise ConfigError("--scheduler k8s needs --image IMAGE: the container image every pod runs, with meshtune "
                          "installed (and the model and data, unless they are on the shared volume)")
    if not job.pvc:
        raise ConfigError("--scheduler k8s needs --pvc NAME: a ReadWriteMany PersistentVolumeClaim mounted at "
                          "output_dir in every pod, so the checkpoints are one storage the pods share")
    if not Path(cfg.output_dir).is_absolute():
        example = f"/shared/runs/{Path(cfg.output_dir).name}"
        raise ConfigError(f"output_dir: {cfg.output_dir} is relative; in a pod it is where the shared volume is "
                          f"mounted, so give an absolute path, e.g. output_dir={example}")
    if job.job_name is not None and not (K8S_NAME.fullmatch(job.job_name) and len(job.job_name) <= K8S_NAME_MAX):
        raise ConfigError(f"--job-name {job.job_name}: a PyTorchJob's name is lowercase letters, digits and '-', "
                          f"starts with a letter, ends with a letter or digit, at most {K8S_NAME_MAX} characters")
    if job.elastic is not None:
        low, high = elastic_range(job.elastic)
        if not 1 <= low <= job.nodes <= high or job.nodes < 2:
            raise ConfigError(f"--elastic {job.elastic} with --nodes {job.nodes}: write MIN:MAX with "
                              f"1 <= MIN <= --nodes <= MAX, and --nodes at least 2 (an elastic PyTorchJob needs a "
                              f"Worker)")


def expected_nnodes(job: JobRequest) -> str:
    return job.elastic if job.elastic else str(job.nodes)


def elastic_range(text: str) -> tuple[int, int]:
    """`--elastic MIN:MAX`, read as `nnodes` is (a single number is not a range here)."""
    try:
        if ":" not in text:
            raise ValueError(text)
        return node_range(text)
    except ValueError:
        raise ConfigError(f"--elastic {text}: write the node range as MIN:MAX, e.g. 2:4") from None


def walltime_seconds(text: str) -> int:
    """SLURM's and PBS's forms: minutes, or [DAYS-]HOURS:MINUTES:SECONDS."""
    if text.strip().isdigit():
        return int(text) * 60
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{1,2}):(\d{1,2})", text.strip())
    if not match:
        raise ConfigError(f"--time {text}: write minutes (90) or [DAYS-]HOURS:MINUTES:SECONDS (1-12:00:00)")
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def hms(seconds: int) -> str:
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def stop_warning_s(cfg) -> int:
    """How long before the time limit the job is told to stop: meshtune's grace period, the 30 s torchrun gives
    on top of it, and 30 s to requeue."""
    return cfg.stop_grace_period + 60


def master_port(cfg) -> int:
    return cfg.master_port or DEFAULT_MASTER_PORT


def job_name(job: JobRequest, cfg) -> str:
    """--job-name, else output_dir's last part, in the characters every scheduler (and Kubernetes) accepts."""
    if job.job_name:
        return job.job_name
    name = re.sub(r"[^a-z0-9]+", "-", Path(cfg.output_dir).name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"meshtune-{name}"
    return name[:K8S_NAME_MAX].strip("-")


def launch_command(job: JobRequest) -> str:
    """The command every node runs, as shell words: the python that wrote the file, meshtune launch, the config."""
    return shlex.join([job.python, "-m", "meshtune", "launch",
                       *([str(job.config)] if job.config else []), *job.launch_args])


def describe_nodes(job: JobRequest) -> str:
    gpus = f"{job.gpus_per_node} GPU{'s' if job.gpus_per_node != 1 else ''} each" if job.gpus_per_node else "CPU only"
    return f"{job.nodes} node{'s' if job.nodes != 1 else ''}, {gpus}"


def output_dir(job: JobRequest, cfg) -> Path:
    return job.workdir / cfg.output_dir  # an absolute output_dir stays as it is


# ---- SLURM


def slurm_script(job: JobRequest, cfg) -> str:
    name, warn = job_name(job, cfg), stop_warning_s(cfg)
    directives = [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={job.nodes}",
        "# one meshtune launcher per node: it starts the node's processes itself (torchrun)",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"#SBATCH --cpus-per-task={job.cpus_per_node}"] if job.cpus_per_node else []),
        *([f"#SBATCH --time={job.time}"] if job.time else []),
        *([f"#SBATCH --partition={job.partition}"] if job.partition else []),
        *([f"#SBATCH --account={job.account}"] if job.account else []),
        "# a requeued job (preemption, a failed node, scontrol requeue, the time limit below) runs this script again",
        "#SBATCH --requeue",
        f"# {warn} s before the time limit, SLURM sends USR1 to this script alone: it stops the training, which saves",
        f"# a checkpoint within stop_grace_period ({cfg.stop_grace_period} s), and requeues the job",
        f"#SBATCH --signal=B:USR1@{warn}",
        "# one log for every run of the job: a requeued run appends to it",
        f"#SBATCH --output={name}-%j.out",
        "#SBATCH --open-mode=append",
    ]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            *([f"--cpus-per-task={job.cpus_per_node}"] if job.cpus_per_node else [])]
    return f"""#!/bin/bash
# meshtune on SLURM: {describe_nodes(job)}.
# Written by: {job.command_line}
# Submit with: sbatch THIS_FILE. meshtune resumes from the newest checkpoint in {output_dir(job, cfg)}
# whenever the job runs again.
{chr(10).join(directives)}

set -u
# relative paths in the config and its overrides are read from here
cd {shlex.quote(str(job.workdir))} || exit 1

# node 0: the first host of the job, as SLURM orders them (meshtune would take the same from SLURM_JOB_NODELIST)
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# SLURM gives no port: this one on every node
export MASTER_PORT={master_port(cfg)}
# each task's node count, rank and processes come from SLURM_JOB_NUM_NODES, SLURM_NODEID and SLURM_GPUS_ON_NODE
# (or nproc_per_node in the config); the run id is slurm-$SLURM_JOB_ID, the same after a requeue
echo "meshtune: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, run ${{SLURM_RESTART_COUNT:-0}} (0: the first)"

time_up=0
stop_before_time_limit() {{
  time_up=1
  echo "meshtune: the time limit is near: stopping the training at a step boundary, then requeueing"
  # SIGTERM to the job's steps, never to srun (srun turns a SIGTERM into SIGKILL of its tasks) or this script
  scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap stop_before_time_limit USR1
# scancel, scontrol requeue and preemption send SIGTERM to every process of the job and SIGKILL KillWait seconds
# later (scontrol show config): meshtune saves a checkpoint on the way out when KillWait leaves stop_grace_period
# for it, else the next run resumes from the last periodic one (save_steps). To stop with a checkpoint and requeue
# whatever KillWait is, use `scancel --batch --signal=USR1 JOBID`; to stop with one and end, `scancel --signal=TERM JOBID`.
trap 'echo "meshtune: SLURM is ending this run (scancel, requeue, preemption or the time limit)"' TERM

# in the background, so that the traps run while it trains; a node that fails stops the others
{shlex.join(srun)} {launch_command(job)} &
srun_pid=$!
wait "$srun_pid"
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done  # a trapped signal ends `wait` early
wait "$srun_pid"
status=$?

# 143 (128 + SIGTERM): meshtune stopped for the signal, a rerun resumes. 0: the training ended first. 1: an error no
# rerun can fix. Any other code (a node's launcher killed after another stopped) is retried as well.
if [ "$time_up" = 1 ] && [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
  echo "meshtune: requeueing job $SLURM_JOB_ID (exit code $status): the next run resumes from the newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


# ---- PBS


def pbs_script(job: JobRequest, cfg) -> str:
    name = job_name(job, cfg)
    chunk = ":".join([str(job.nodes), *([f"ncpus={job.cpus_per_node}"] if job.cpus_per_node else []),
                      *([f"ngpus={job.gpus_per_node}"] if job.gpus_per_node else []), "mpiprocs=1"])
    directives = [
        f"#PBS -N {name[:15]}",
        "# one chunk per node, each on its own host; mpiprocs=1 lists each host once in PBS_NODEFILE",
        f"#PBS -l select={chunk}",
        "#PBS -l place=scatter",
        *([f"#PBS -l walltime={hms(walltime_seconds(job.time))}"] if job.time else []),
        *([f"#PBS -q {job.queue}"] if job.queue else []),
        *([f"#PBS -A {job.account}"] if job.account else []),
        "# rerunnable: a requeued job (preemption, qrerun, a failed node) runs this script again and meshtune resumes",
        "#PBS -r y",
        "#PBS -j oe",
    ]
    status_dir = output_dir(job, cfg) / ".meshtune-pbs"
    walltime_stop = walltime_cleanup = ""
    if job.time:
        warn = stop_warning_s(cfg)
        walltime_stop = f"""
# {warn} s before the walltime, stop every node: meshtune stops at a step boundary and saves a checkpoint (at the
# walltime itself PBS leaves only the queue's kill_delay). The job then ends with 143: qsub this file again to resume.
( sleep {walltime_seconds(job.time) - warn}; kill -USR1 $$ ) &
timer=$!
trap 'stopping=1; echo "meshtune: the walltime is near: stopping every node"; stop_nodes' USR1
"""
        walltime_cleanup = 'kill "$timer" 2>/dev/null\n'
    return f"""#!/bin/bash
# meshtune on PBS: {describe_nodes(job)}, one meshtune launcher per node.
# Written by: {job.command_line}
# Submit with: qsub THIS_FILE. meshtune resumes from the newest checkpoint in {output_dir(job, cfg)}
# whenever the job runs again.
{chr(10).join(directives)}

set -u
cd {shlex.quote(str(job.workdir))} || exit 1
# how each node's launcher starts: pbsdsh (PBS's task manager, which also stops it when the job ends), or ssh
# (qsub -v MESHTUNE_PBS_LAUNCHER=ssh THIS_FILE)
launcher="${{MESHTUNE_PBS_LAUNCHER:-pbsdsh}}"

# the job's hosts in first-seen order (PBS_NODEFILE repeats a host once per slot); node 0 is the first. slots[i] is
# the line of host i's first entry, counted from 0: the node index pbsdsh -n takes
declare -A seen=()
hosts=() slots=() line=0
while read -r host; do
  [ -n "$host" ] || continue
  if [ -z "${{seen[$host]:-}}" ]; then seen[$host]=1; hosts+=("$host"); slots+=("$line"); fi
  line=$((line + 1))
done < "$PBS_NODEFILE"
nnodes=${{#hosts[@]}}
if [ "$nnodes" -ne {job.nodes} ]; then
  echo "meshtune: PBS_NODEFILE lists $nnodes host(s) (${{hosts[*]}}), the job asked for {job.nodes}: keep" \\
       "place=scatter so that every chunk gets a host of its own" >&2
  exit 1
fi
echo "meshtune: job $PBS_JOBID on ${{hosts[*]}} (node 0: ${{hosts[0]}}), started through $launcher"

# each node's launcher pid and exit status, on output_dir's storage, which every node sees
status_dir={shlex.quote(str(status_dir))}/"$PBS_JOBID"
rm -rf "$status_dir" && mkdir -p "$status_dir" || exit 1

# What runs on each node. pbsdsh and ssh pass on no environment and start in the home directory, so the node gets
# everything as arguments: its rank, the node count, node 0's host, the status directory.
cat > "$status_dir/node.sh" <<'NODE'
rank=$1 status_dir=$4
cd {shlex.quote(str(job.workdir))} || exit 1
export NODE_RANK="$1" NNODES="$2" MASTER_ADDR="$3" MASTER_PORT={master_port(cfg)}
# the node file may exist on node 0 only, and the four settings above are all meshtune needs
unset PBS_NODEFILE
echo $$ > "$status_dir/node-$rank.pid"
{launch_command(job)} &
pid=$!
# stopping this node (the job ends, another node failed) is a SIGTERM to meshtune: it stops at a step boundary and
# saves a checkpoint if stop_grace_period ({cfg.stop_grace_period} s) allows
trap 'kill -TERM "$pid" 2>/dev/null' TERM HUP INT
wait "$pid"
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
wait "$pid"
code=$?
echo "$code" > "$status_dir/node-$rank.exit"  # pbsdsh does not pass the exit status on
exit "$code"
NODE

run_on() {{  # run_on RANK COMMAND [ARGS...]: run it on that node
  if [ "$launcher" = ssh ]; then
    ssh -o BatchMode=yes "${{hosts[$1]}}" "$(printf '%q ' "${{@:2}}")" < /dev/null
  else
    pbsdsh -n "${{slots[$1]}}" -- "${{@:2}}"
  fi
}}

declare -A pids=()  # node rank -> the local pid of its pbsdsh or ssh
stop_nodes() {{  # SIGTERM to every node still running
  for rank in "${{!pids[@]}}"; do
    if [ ! -e "$status_dir/node-$rank.exit" ] && [ -s "$status_dir/node-$rank.pid" ]; then
      run_on "$rank" /bin/kill -TERM "$(cat "$status_dir/node-$rank.pid")"
    fi
  done
}}
stopping=0
# qdel, the walltime and preemption send SIGTERM to this script and to every PBS task (pbsdsh's); ssh's are not
# PBS's, so they are told here. PBS kills what is left after the queue's kill_delay.
trap 'stopping=1; echo "meshtune: PBS is ending this run"; [ "$launcher" = ssh ] && stop_nodes' TERM

for rank in "${{!hosts[@]}}"; do
  run_on "$rank" /bin/bash "$status_dir/node.sh" "$rank" "$nnodes" "${{hosts[0]}}" "$status_dir" &
  pids[$rank]=$!
done
{walltime_stop}
# wait for every node; the first that fails stops the others, and its exit code is the job's
failed=0
while [ "${{#pids[@]}}" -gt 0 ]; do
  for rank in "${{!pids[@]}}"; do
    kill -0 "${{pids[$rank]}}" 2>/dev/null && continue
    wait "${{pids[$rank]}}"
    code=$?
    [ -s "$status_dir/node-$rank.exit" ] && code=$(cat "$status_dir/node-$rank.exit")
    unset "pids[$rank]"
    echo "meshtune: node $rank (${{hosts[$rank]}}) exited with code $code"
    if [ "$code" -ne 0 ] && [ "$failed" -eq 0 ]; then
      failed=$code
      [ "$stopping" = 1 ] || {{ echo "meshtune: node $rank failed: stopping the other nodes"; stop_nodes; }}
    fi
  done
  [ "${{#pids[@]}}" -gt 0 ] && sleep 1
done
{walltime_cleanup}rm -rf "$status_dir"
rmdir "${{status_dir%/*}}" 2>/dev/null
exit "$failed"
"""


# ---- Kubernetes: a Kubeflow PyTorchJob (training-operator, kubeflow.org/v1)


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line text (the config file) as a literal block, so the ConfigMap reads like the file."""


_LiteralDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def pytorchjob_manifest(job: JobRequest, cfg) -> str:
    """A ConfigMap holding the config (when there is a YAML) and the PyTorchJob: a Master pod (node 0, whose service
    is MASTER_ADDR) and nodes - 1 Worker pods, each running `meshtune launch` on the config."""
    name = job_name(job, cfg)
    config_key = (job.config.name if re.fullmatch(r"[-._a-zA-Z0-9]+", job.config.name) else "config.yaml") \
        if job.config else None  # a ConfigMap key, and the file's name in the pod
    config_path = f"{CONFIG_MOUNT}/{config_key}" if job.config else None
    command = [*([job.python, "-m", "meshtune"] if job.python else ["meshtune"]), "launch",
               *([config_path] if config_path else []), *job.launch_args]
    metadata = {"name": name, **({"namespace": job.namespace} if job.namespace else {})}
    documents = []
    if job.config:
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**metadata, "name": f"{name}-config"},
                      "data": {config_key: job.config.read_text()}}
        documents.append("# the config, as every pod reads it at " + config_path + "\n"
                         + yaml.dump(config_map, Dumper=_LiteralDumper, sort_keys=False, width=120))
    nproc = cfg.nproc_per_node or job.gpus_per_node or 1
    elastic = ""
    if job.elastic:
        low, high = elastic_range(job.elastic)
        elastic = f"""
  # any number of pods from {low} to {high} forms the job (PET_NNODES={low}:{high}, meshtune's elastic nnodes); set the
  # Worker replicas between {low - 1} and {high - 1}. The rendezvous stays on the Master's service (PET_MASTER_ADDR).
  elasticPolicy:
    minReplicas: {low}
    maxReplicas: {high}"""
    replicas = [("Master", 1, "node 0: its service name is MASTER_ADDR, and it hosts the rendezvous")]
    if job.nodes > 1:
        replicas.append(("Worker", job.nodes - 1, "node 1" if job.nodes == 2 else f"nodes 1 to {job.nodes - 1}"))
    specs = "".join(f"""
    {kind}:
      # {what}
      replicas: {count}
      # exit 143 (stopped by SIGTERM, after saving) and other codes above 127 restart the pod, which resumes;
      # exit 1 (an error meshtune named, which a restart meets again) ends the job
      restartPolicy: ExitCode
      template:
{_pod_template(job, cfg, name, command)}""" for kind, count, what in replicas)
    documents.append(f"""# meshtune on Kubernetes (Kubeflow training-operator): {describe_nodes(job)}, one pod per node.
# Written by: {job.command_line}
# Create with: kubectl apply -f THIS_FILE (PersistentVolumeClaim {job.pvc} must exist, ReadWriteMany).
# meshtune resumes from the newest checkpoint in {cfg.output_dir} whenever a pod starts again.
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {json.dumps(name)}{f'''
  namespace: {json.dumps(job.namespace)}''' if job.namespace else ''}
spec:
  # processes per pod (PET_NPROC_PER_NODE); nproc_per_node in the config, if set, wins
  nprocPerNode: "{nproc}"{elastic}
  pytorchReplicaSpecs:{specs}
""")
    return "---\n".join(documents)


def _pod_template(job: JobRequest, cfg, name: str, command: list[str]) -> str:
    limits = {**({"nvidia.com/gpu": job.gpus_per_node} if job.gpus_per_node else {}),
              **({"cpu": job.cpus_per_node} if job.cpus_per_node else {})}
    resources = "".join(f"\n                  {key}: {value}" for key, value in limits.items())
    config_mount = f"""
                - {{name: config, mountPath: {CONFIG_MOUNT}, readOnly: true}}""" if job.config else ""
    config_volume = f"""
            - {{name: config, configMap: {{name: {json.dumps(name + '-config')}}}}}""" if job.config else ""
    return f"""        spec:
          # SIGTERM (deletion, preemption) reaches meshtune, which stops at a step boundary and saves within
          # stop_grace_period ({cfg.stop_grace_period} s); torchrun gives its processes 30 s more
          terminationGracePeriodSeconds: {cfg.stop_grace_period + 60}
          containers:
            # the operator sets MASTER_ADDR, MASTER_PORT and PET_NODE_RANK in the container named pytorch
            - name: pytorch
              image: {json.dumps(job.image)}
              command: {json.dumps(command)}
              env:
                # NCCL and gloo talk over the pod network's interface (change it for a secondary network)
                - {{name: NCCL_SOCKET_IFNAME, value: eth0}}
                - {{name: GLOO_SOCKET_IFNAME, value: eth0}}
                - {{name: NCCL_DEBUG, value: WARN}}
              ports:
                # MASTER_PORT: the Master's rendezvous port
                - {{name: pytorchjob-port, containerPort: {master_port(cfg)}}}{f'''
              resources:
                limits:{resources}''' if limits else ""}
              volumeMounts:{config_mount}
                - {{name: output, mountPath: {json.dumps(cfg.output_dir)}}}
                - {{name: shm, mountPath: /dev/shm}}
          volumes:{config_volume}
            # output_dir: the checkpoints every pod writes into and resumes from (ReadWriteMany)
            - {{name: output, persistentVolumeClaim: {{claimName: {json.dumps(job.pvc)}}}}}
            # torch's processes share memory through /dev/shm, 64 MiB by default in a container
            - {{name: shm, emptyDir: {{medium: Memory}}}}"""
