"""Ready-to-submit job files: a SLURM batch script, a PBS job script, a Kubeflow PyTorchJob for Kubernetes.

Each file places one `meshtune launch` on every node and leaves the rest to what meshtune already does there:
it reads the scheduler's variables for the node count and rank (launch/nodes.py), stops at a step boundary on
SIGTERM and saves a checkpoint within `stop_grace_period` (train/preemption.py), and resumes from `output_dir` when
started again. So a file only fixes what no scheduler gives (the rendezvous port), turns the scheduler's warning
before a time limit or preemption into that SIGTERM in time, and makes the job run again after it. No torch import.

The files' text is in launch/templates/ (jinja2); this module checks the request and works out the values.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from meshtune.errors import ConfigError
from meshtune.launch.nodes import node_range

if TYPE_CHECKING:
    import jinja2

SCHEDULERS = ("slurm", "pbs", "k8s")
DEFAULT_MASTER_PORT = 29500
# SLURM's options, PBS's and Kubernetes': each is refused under another scheduler, naming the one that has it
OWN_OPTIONS = {"slurm": ("partition", "account", "time"), "pbs": ("queue", "account", "time"),
               "k8s": ("image", "pvc", "namespace", "elastic", "mount")}
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
    mount: tuple[str, ...] | None = None  # k8s: CLAIM:PATH[:ro], more claims mounted in every pod
    deepspeed: str | None = None  # the DeepSpeed JSON the config names, which every node reads too
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
    claims = claim_mounts(job)
    taken = {cfg.output_dir: "output_dir (--pvc)", CONFIG_MOUNT: "the config", "/dev/shm": "shared memory"}
    for claim in claims:
        if claim.path in taken:
            raise ConfigError(f"--mount {claim.claim}:{claim.path}: {claim.path} is where {taken[claim.path]} is "
                              f"mounted; mount the claim elsewhere")
        taken[claim.path] = f"--mount {claim.claim}"
    if job.elastic is not None:
        low, high = elastic_range(job.elastic)
        if not 1 <= low <= job.nodes <= high or job.nodes < 2:
            raise ConfigError(f"--elastic {job.elastic} with --nodes {job.nodes}: write MIN:MAX with "
                              f"1 <= MIN <= --nodes <= MAX, and --nodes at least 2 (an elastic PyTorchJob needs a "
                              f"Worker)")


@dataclass(frozen=True)
class ClaimMount:
    claim: str       # a PersistentVolumeClaim's name
    path: str        # where every pod sees it
    read_only: bool


def claim_mounts(job: JobRequest) -> list[ClaimMount]:
    """`--mount CLAIM:PATH[:ro]`, each checked: a claim's name, an absolute path."""
    mounts = []
    for text in job.mount or ():
        claim, _, rest = text.partition(":")
        path, _, mode = rest.partition(":")
        if not (K8S_NAME.fullmatch(claim) and len(claim) <= 253) or not path.startswith("/") or mode not in ("", "ro"):
            raise ConfigError(f"--mount {text}: write CLAIM:PATH or CLAIM:PATH:ro, a PersistentVolumeClaim's name "
                              f"and the absolute path every pod sees it at, e.g. --mount models:/shared/models:ro")
        mounts.append(ClaimMount(claim, path.rstrip("/") or "/", mode == "ro"))
    return mounts


def paths_in_pods(job: JobRequest, cfg) -> list[tuple[str, str]]:
    """(key, path) for every file or folder the config names, which each pod reads at that path: the model, an
    adapter, the DeepSpeed JSON, the data (a dataset name: dataset_dir, where its dataset_info.json is) and the
    token cache."""
    paths = [("model_name_or_path", cfg.model_name_or_path)]
    if job.deepspeed:
        paths.append(("deepspeed", job.deepspeed))
    if cfg.adapter_name_or_path:
        paths.append(("adapter_name_or_path", cfg.adapter_name_or_path))
    named = False
    for key in ("dataset", "eval_dataset"):
        for entry in getattr(cfg, key) or []:
            if "/" in entry or Path(entry).suffix.lower() in (".json", ".jsonl"):
                paths.append((key, entry))
            else:
                named = True
    if named:
        paths.append(("dataset_dir", cfg.dataset_dir))
    if cfg.tokenized_path:
        paths.append(("tokenized_path", cfg.tokenized_path))
    return paths


def unmounted_paths(job: JobRequest, cfg) -> list[str]:
    """The config's paths that no volume of the PyTorchJob holds (output_dir's claim, a --mount): a pod finds them
    only if its image has them. Relative paths are read from the image's working directory."""
    holders = [cfg.output_dir, *(claim.path for claim in claim_mounts(job))]
    missing = []
    for key, path in paths_in_pods(job, cfg):
        if not Path(path).is_absolute():
            missing.append(f"{key} {path} (relative: in the image's working directory)")
        elif not any(Path(path) == Path(holder) or Path(holder) in Path(path).parents for holder in holders):
            missing.append(f"{key} {path}")
    return missing


def unmounted_warning(job: JobRequest, cfg) -> str | None:
    """One line naming what the pods would not find, and how to mount it; None where every path is mounted."""
    missing = unmounted_paths(job, cfg) if job.scheduler == "k8s" else []
    if not missing:
        return None
    return (f"the PyTorchJob mounts output_dir (--pvc {job.pvc}){', the --mount claims' if job.mount else ''} and "
            f"the config, not {', '.join(missing)}: the pods find them only if the image holds them; mount the "
            f"claim that holds them with --mount CLAIM:PATH[:ro]")


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


# ---- the files: their text in launch/templates/, their values from here


def render(template: str, **values) -> str:
    """A job file from its template in launch/templates/; a value the template names but was not given is an error."""
    return templates().get_template(template).render(**values)


@functools.cache
def templates() -> jinja2.Environment:
    import jinja2  # here, not at the top: every `meshtune` command imports this module to build its options

    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("meshtune.launch", "templates"), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
        comment_start_string="{##", comment_end_string="##}")  # bash's ${#array[@]} is no template comment
    environment.filters["shell"] = lambda value: shlex.quote(str(value))
    environment.filters["json"] = json.dumps
    return environment


def slurm_script(job: JobRequest, cfg) -> str:
    return render("slurm.sh.j2", job=job, name=job_name(job, cfg), nodes=describe_nodes(job),
                  output_dir=output_dir(job, cfg), master_port=master_port(cfg), launch_command=launch_command(job),
                  stop_grace_period=cfg.stop_grace_period, warn_s=stop_warning_s(cfg))


def pbs_script(job: JobRequest, cfg) -> str:
    # one chunk per node: its CPUs and GPUs, and one MPI process so that PBS_NODEFILE names each host once
    chunk = ":".join([str(job.nodes), *([f"ncpus={job.cpus_per_node}"] if job.cpus_per_node else []),
                      *([f"ngpus={job.gpus_per_node}"] if job.gpus_per_node else []), "mpiprocs=1"])
    seconds = walltime_seconds(job.time) if job.time else None
    return render("pbs.sh.j2", job=job, name=job_name(job, cfg), nodes=describe_nodes(job),
                  output_dir=output_dir(job, cfg), master_port=master_port(cfg), launch_command=launch_command(job),
                  stop_grace_period=cfg.stop_grace_period, warn_s=stop_warning_s(cfg), chunk=chunk,
                  status_dir=output_dir(job, cfg) / ".meshtune-pbs", walltime=hms(seconds) if seconds else None,
                  stop_after_s=seconds - stop_warning_s(cfg) if seconds else None)


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
    config_map = None
    if job.config:  # dumped, not templated: the config's own text, quoted as YAML needs
        metadata = {"name": f"{name}-config", **({"namespace": job.namespace} if job.namespace else {})}
        config_map = yaml.dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                                "data": {config_key: job.config.read_text()}},
                               Dumper=_LiteralDumper, sort_keys=False, width=120)
    replicas = [("Master", 1, "node 0: its service name is MASTER_ADDR, and it hosts the rendezvous")]
    if job.nodes > 1:
        replicas.append(("Worker", job.nodes - 1, "node 1" if job.nodes == 2 else f"nodes 1 to {job.nodes - 1}"))
    limits = {**({"nvidia.com/gpu": job.gpus_per_node} if job.gpus_per_node else {}),
              **({"cpu": job.cpus_per_node} if job.cpus_per_node else {})}
    return render("pytorchjob.yaml.j2", job=job, name=name, nodes=describe_nodes(job), output_dir=cfg.output_dir,
                  config_map=config_map, config_path=config_path, config_mount=CONFIG_MOUNT, command=command,
                  nproc=cfg.nproc_per_node or job.gpus_per_node or 1, replicas=replicas, limits=limits,
                  elastic=elastic_range(job.elastic) if job.elastic else None, master_port=master_port(cfg),
                  stop_grace_period=cfg.stop_grace_period, claims=claim_mounts(job),
                  unmounted=unmounted_paths(job, cfg))
