"""Where this node stands in a job: how many nodes, its rank, node 0's address and port, processes per node.

Each value comes from the first of: the config (YAML or `key=value`), plain env variables (the names Qwen's and
LLaMA-Factory's scripts use), the scheduler (SLURM, PBS, Kubeflow PyTorchJob), then one-machine defaults. So the
same command runs on every node, and nothing that must agree across nodes is left to chance: several nodes
need an explicit rendezvous port (a random one per node is the classic silent hang).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshtune.checkpoint.object_store import is_url
from meshtune.config import torchrun_nproc
from meshtune.errors import ConfigError
from meshtune.worker_env import torchrun_worker

DEFAULT_MASTER_ADDR = "127.0.0.1"
FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node")
ENV_NAMES = {"nnodes": ("NNODES",), "node_rank": ("NODE_RANK",), "master_addr": ("MASTER_ADDR",),
             "master_port": ("MASTER_PORT",), "nproc_per_node": ("NPROC_PER_NODE", "GPUS_PER_NODE")}
PET_NAMES = {"nnodes": "PET_NNODES", "node_rank": "PET_NODE_RANK", "master_addr": "PET_MASTER_ADDR",
             "master_port": "PET_MASTER_PORT", "nproc_per_node": "PET_NPROC_PER_NODE"}
NNODES_TEXT = re.compile(r"(\d+)(?::(\d+))?")

# field -> (value, where it came from); one dict per source, highest precedence first
Layer = dict[str, tuple[object, str]]


@dataclass(frozen=True)
class NodeSettings:
    """This node's part in the job, with `source[field]` saying where each value came from (for humans)."""

    nnodes: str  # "N", or "MIN:MAX" for an elastic job
    node_rank: int
    master_addr: str
    master_port: int | None
    nproc_per_node: int
    run_id: str
    source: dict[str, str]

    @property
    def min_nodes(self) -> int:
        return node_range(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return node_range(self.nnodes)[1]

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def max_processes(self) -> int:
        """Processes in the largest world this job can form (what one global batch must fit)."""
        return self.max_nodes * self.nproc_per_node


@dataclass(frozen=True)
class _Unresolved:
    """A value a scheduler could not work out; an error only if no higher-precedence source gives it."""

    message: str


def default_nproc_per_node() -> int:
    """One process per visible GPU; one on CPU."""
    import torch  # here, not at the top: `meshtune launch --dry-run` with NPROC_PER_NODE set needs no torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def node_range(nnodes: str) -> tuple[int, int]:
    """(min, max) nodes of "N" or "MIN:MAX"; ValueError if it is neither."""
    match = NNODES_TEXT.fullmatch(nnodes.strip())
    if not match:
        raise ValueError(nnodes)
    low = int(match[1])
    return low, int(match[2] or low)


def expand_hostlist(text: str, variable: str = "hostlist") -> list[str]:
    """SLURM's compressed host list: `node[01-03,07],gpu-a[1-2],login1` → node01 node02 node03 node07 gpu-a1 ...

    Zero padding is kept (`[08-10]` gives 08 09 10) and several bracket groups in one name multiply out.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip(), variable):
        hosts.extend(_expand_item(item, variable))
    if not hosts:
        raise ConfigError(f"{variable}={text!r} names no host")
    return hosts


def _split_top_level(text: str, variable: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(f"{variable}={text!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{variable}={text!r}: unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, variable: str) -> list[str]:
    opening = item.find("[")
    if opening < 0:
        return [item]
    closing = item.index("]", opening)
    prefix, spec, rest = item[:opening], item[opening + 1:closing], item[closing + 1:]
    tails = _expand_item(rest, variable)
    return [prefix + number + tail for number in _expand_ranges(spec, item, variable) for tail in tails]


def _expand_ranges(spec: str, item: str, variable: str) -> list[str]:
    numbers = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match[2] and int(match[2]) < int(match[1])):
            raise ConfigError(f"{variable}: cannot read {part!r} in {item!r}; expected numbers or ranges like 01-04")
        width, low = len(match[1]), int(match[1])
        numbers += [f"{n:0{width}d}" for n in range(low, int(match[2] or low) + 1)]
    return numbers


def detect_node_settings(cfg, environ: Mapping[str, str] = os.environ, hostname: str | None = None) -> NodeSettings:
    """This node's settings from config > env > scheduler > defaults, checked so a bad set fails here, not as a hang.

    `cfg` is a TrainConfig (only its launch keys and `output_dir` are read); `hostname` defaults to this host's
    and matters only under PBS, where the node rank is this host's place in the node file.
    """
    layers = [_from_config(cfg), _from_env(environ), _from_scheduler(environ, hostname)]
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    for name in (*FIELDS, "run_id"):
        for layer in layers:
            if name in layer:
                values[name], source[name] = layer[name]
                break
    for name, (value, origin) in _defaults(values).items():
        values.setdefault(name, value)
        source.setdefault(name, origin)
    if "run_id" not in values:
        # checkpoints in an object store leave output_dir to each node (its own local disk): the store names the job
        store = getattr(cfg, "checkpoint_dir", None)
        store = store if is_url(store) else None
        values["run_id"] = _derived_run_id(values["master_addr"], values["master_port"], store or cfg.output_dir)
        source["run_id"] = f"derived from master address, port and {'checkpoint_dir' if store else 'output_dir'}"
    for value in values.values():
        if isinstance(value, _Unresolved):
            raise ConfigError(value.message)
    settings = NodeSettings(source=source, **values)  # type: ignore[arg-type]
    _check(settings, needs_master=getattr(cfg, "rdzv_backend", "c10d") == "c10d")
    return settings


def _from_config(cfg) -> Layer:
    return {name: (getattr(cfg, name), "config") for name in FIELDS if getattr(cfg, name) is not None}


def _from_env(environ: Mapping[str, str]) -> Layer:
    found: Layer = {}
    for name, variables in ENV_NAMES.items():
        for variable in variables:
            value = _parse(name, environ.get(variable, ""), f"env {variable}")
            if value is not None:
                found[name] = (value, f"env {variable}")
                break
    return found


def _parse(name: str, raw: str, origin: str) -> object | None:
    """A raw env value as its field's type; None when empty (`export NODE_RANK=` counts as unset)."""
    raw = torchrun_nproc(raw.strip()) if name == "nproc_per_node" else raw.strip()
    if not raw:
        return None
    if name in ("nnodes", "master_addr"):
        return raw
    low, high = {"node_rank": (0, None), "master_port": (1, 65535), "nproc_per_node": (1, None)}[name]
    if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
        allowed = f"a whole number from {low}" + (f" to {high}" if high else "")
        raise ConfigError(f"{name}={raw!r} (from {origin}) is not {allowed}; fix or unset it")
    return int(raw)


def _from_scheduler(environ: Mapping[str, str], hostname: str | None) -> Layer:
    """The first scheduler whose marks are present; an empty layer outside any."""
    if "SLURM_JOB_ID" in environ:
        return _from_slurm(environ)
    if "PBS_JOBID" in environ:
        pbs = _from_pbs(environ, hostname or socket.gethostname())
        if pbs is not None:
            return pbs
    return _from_pytorchjob(environ)


def _from_slurm(environ: Mapping[str, str]) -> Layer:
    local_id = environ.get("SLURM_LOCALID", "0").strip()
    if local_id.isdigit() and int(local_id) > 0:
        raise ConfigError(f"SLURM started several tasks on this node (SLURM_LOCALID={environ['SLURM_LOCALID']}); "
                          "meshtune launch starts this node's processes itself: use srun --ntasks-per-node=1")
    found: Layer = {"run_id": (f"slurm-{environ['SLURM_JOB_ID']}", "SLURM SLURM_JOB_ID")}
    for variable in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if environ.get(variable):
            found["nnodes"] = (environ[variable].strip(), f"SLURM {variable}")
            break
    if environ.get("SLURM_NODEID"):
        found["node_rank"] = (_parse("node_rank", environ["SLURM_NODEID"], "SLURM SLURM_NODEID"), "SLURM SLURM_NODEID")
    for variable in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(variable):
            found["master_addr"] = (expand_hostlist(environ[variable], variable)[0], f"SLURM {variable} (first host)")
            break
    gpus = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus.isdigit() and int(gpus) > 0:
        found["nproc_per_node"] = (int(gpus), "SLURM SLURM_GPUS_ON_NODE")
    return found


def _from_pbs(environ: Mapping[str, str], hostname: str) -> Layer | None:
    """Hosts of PBS_NODEFILE (one line per slot, so hosts repeat) in first-seen order; None without one."""
    path = environ.get("PBS_NODEFILE", "")
    try:
        lines = Path(path).read_text().splitlines() if path else []
    except OSError as exc:  # silently training as a one-node job into the shared output_dir would be worse
        raise ConfigError(f"PBS_NODEFILE {path} cannot be read ({exc.strerror}); run meshtune inside the PBS job, "
                          f"or set NNODES, NODE_RANK and MASTER_ADDR yourself") from None
    hosts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if not hosts:
        return None
    origin = f"PBS {path}"
    rank = _host_index(hosts, hostname)
    if rank is None:
        shown = ", ".join(hosts[:8]) + (f", ... ({len(hosts)} in all)" if len(hosts) > 8 else "")
        rank = _Unresolved(f"this host {hostname!r} is not in PBS_NODEFILE {path} (hosts: {shown}); run meshtune on "
                           "the job's nodes, or set NODE_RANK (or node_rank:) on each node")
    return {"nnodes": (str(len(hosts)), origin), "master_addr": (hosts[0], f"{origin} (first host)"),
            "node_rank": (rank, f"{origin} (this host's place)"),
            "run_id": (f"pbs-{environ['PBS_JOBID']}", "PBS PBS_JOBID")}


def _host_index(hosts: list[str], hostname: str) -> int | None:
    """Exact name first, then the short name before the first dot (node files and hostname differ on domains)."""
    if hostname in hosts:
        return hosts.index(hostname)
    short = [host.split(".")[0] for host in hosts]
    mine = hostname.split(".")[0]
    return short.index(mine) if mine in short else None


def _from_pytorchjob(environ: Mapping[str, str]) -> Layer:
    """Kubeflow's training operator: PET_* for torchrun-style jobs, else WORLD_SIZE pods with RANK = pod index."""
    if any(environ.get(variable) for variable in PET_NAMES.values()):
        found: Layer = {}
        for name, variable in PET_NAMES.items():
            value = _parse(name, environ.get(variable, ""), f"PyTorchJob {variable}")
            if value is not None:
                found[name] = (value, f"PyTorchJob {variable}")
        if environ.get("PET_RDZV_ID"):
            found["run_id"] = (environ["PET_RDZV_ID"], "PyTorchJob PET_RDZV_ID")
        return found
    operator_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if all(environ.get(variable) for variable in operator_vars) and not torchrun_worker(environ):
        return {"nnodes": (environ["WORLD_SIZE"].strip(), "PyTorchJob WORLD_SIZE (pods)"),
                "node_rank": (_parse("node_rank", environ["RANK"], "PyTorchJob RANK"), "PyTorchJob RANK (pod index)")}
    return {}


def _defaults(values: Mapping[str, object]) -> Layer:
    defaults: Layer = {"nnodes": ("1", "default"), "node_rank": (0, "default"),
                       "master_addr": (DEFAULT_MASTER_ADDR, "default"), "master_port": (None, "not set")}
    if "nproc_per_node" not in values:  # only then: it may import torch
        defaults["nproc_per_node"] = (default_nproc_per_node(), "default: visible GPUs, 1 on CPU")
    return defaults


def _derived_run_id(master_addr: object, master_port: object, output_dir: str) -> str:
    """The same on every node with no coordination: all nodes run one config against one master.

    The config hash is left out on purpose: nodes with different configs must still meet, so the startup
    agreement check can name the difference instead of the rendezvous timing out. output_dir (checkpoint_dir, when
    it is an object store's URL) keeps two jobs that reuse one master port apart.
    """
    digest = hashlib.sha256(f"{master_addr}:{master_port}:{output_dir}".encode()).hexdigest()[:12]
    return f"meshtune-{digest}"


def _check(settings: NodeSettings, needs_master: bool = True) -> None:
    """Mistakes that would otherwise surface as a rendezvous that never completes."""
    src = settings.source
    try:
        low, high = node_range(settings.nnodes)
    except ValueError:
        raise ConfigError(f"nnodes={settings.nnodes!r} (from {src['nnodes']}) is not a node count: "
                          "write N or an elastic range MIN:MAX, e.g. 2 or 1:4") from None
    if low < 1 or low > high:
        raise ConfigError(f"nnodes={settings.nnodes!r} (from {src['nnodes']}): "
                          f"{'MIN must be at least 1' if low < 1 else f'MIN {low} is above MAX {high}'}; "
                          "write N or MIN:MAX with 1 <= MIN <= MAX")
    if settings.node_rank >= high:
        raise ConfigError(f"node_rank={settings.node_rank} (from {src['node_rank']}) is not below "
                          f"nnodes={settings.nnodes} (from {src['nnodes']}): node ranks go from 0 to {high - 1}; "
                          "set NODE_RANK (or node_rank:) to this node's index")
    if not settings.multi_node or not needs_master:  # an etcd rendezvous needs rdzv_endpoint instead
        return
    job = f"nnodes={settings.nnodes} (from {src['nnodes']}) means several nodes"
    if src["master_addr"] == "default":
        raise ConfigError(f"{job}, which need node 0's address, and none is set: set MASTER_ADDR "
                          "(or master_addr:) to node 0's hostname or IP, the same on every node")
    if settings.master_port is None:
        raise ConfigError(f"{job}, which need one rendezvous port, and none is set: set MASTER_PORT "
                          "(or master_port:) to the same free port on every node, e.g. MASTER_PORT=29500")


def describe(settings: NodeSettings) -> str:
    """What this node will do and why; one line on a single node, where master, port and run id don't matter."""
    src = settings.source
    if not settings.multi_node:
        count = settings.nproc_per_node
        return f"meshtune: 1 node, {count} process{'es' if count > 1 else ''} (from {src['nproc_per_node']})"
    endpoint = f"{settings.master_addr}:{settings.master_port}"
    elastic = settings.min_nodes != settings.max_nodes
    total = f"up to {settings.max_processes}" if elastic else str(settings.max_processes)
    rows = [("nodes", settings.nnodes + (" (elastic)" if elastic else ""), src["nnodes"]),
            ("this node's rank", str(settings.node_rank), src["node_rank"]),
            ("master", endpoint, f"{src['master_addr']}; port: {src['master_port']}"),
            ("processes per node", f"{settings.nproc_per_node} ({total} in all)",
             src["nproc_per_node"]),
            ("run id", settings.run_id, src["run_id"])]
    width = max(len(value) for _, value, _ in rows)
    return "\n".join(["meshtune: multi-node job"] +
                     [f"  {label:<19} {value:<{width}}  ({origin})" for label, value, origin in rows])
