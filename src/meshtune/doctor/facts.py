"""What `meshtune doctor` learns about this node: its launch settings, accelerators, software, the files it would
train on, its output_dir and the network interface that routes to MASTER_ADDR. A fact that cannot be computed
becomes an `error` entry in the facts, so no node is left waiting on another's exception."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import torch

from meshtune.checksums import RememberedChecksums, dataset_checksum, remembered_store
from meshtune.data.registry import resolve_all
from meshtune.errors import StorageError
from meshtune.train.agreement import package_versions, shared_config
from meshtune.train.storage import ensure_writable_dir

PACKAGES = ("meshtune", "torch", "transformers", "peft", "torchao")
FAKE_VERSIONS = "MESHTUNE_DOCTOR_FAKE_VERSIONS"  # "name=version,...": lets a test make one node differ
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def collect_facts(cfg, settings) -> dict:
    facts = {"host": socket.gethostname(), "pid": os.getpid(), "node_rank": settings.node_rank,
             "nnodes": settings.nnodes, "master_addr": settings.master_addr, "master_port": settings.master_port,
             "nproc_per_node": settings.nproc_per_node, "config": shared_config(cfg)}
    for key, fact in (("accelerators", accelerators), ("software", software),
                      ("model", lambda: directory_checksum(Path(cfg.model_name_or_path).expanduser())),
                      ("dataset", lambda: dataset_facts(cfg)),
                      ("output_dir", lambda: output_dir_facts(Path(cfg.output_dir).expanduser())),
                      ("network", lambda: network_facts(settings.master_addr, settings.master_port)),
                      ("checkpoint_store", lambda: store_facts(cfg.checkpoint_dir))):
        try:
            facts[key] = fact()
        except Exception as exc:  # noqa: BLE001 - reported in the table, with the node
            facts[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return facts


def accelerators() -> dict:
    if not torch.cuda.is_available():
        return {"count": 0, "models": [], "memory": [], "cuda": None, "nccl": None, "driver": None}
    count = torch.cuda.device_count()
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {"count": count, "models": [torch.cuda.get_device_name(i) for i in range(count)],
            "memory": [torch.cuda.get_device_properties(i).total_memory for i in range(count)],
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "driver": nvidia_driver()}


def nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def software() -> dict:
    found = package_versions(PACKAGES)
    fake = os.environ.get(FAKE_VERSIONS, "")
    found.update(item.split("=", 1) for item in fake.split(",") if "=" in item)
    found["meshtune code"] = code_hash()
    return found


def code_hash() -> str:
    """sha256 over meshtune's installed Python files: two installs of one version number can still differ."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_file() -> Path:
    return remembered_store()


def checksum_of(files: list[Path], base: Path) -> str:
    remembered = RememberedChecksums(cache_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(base)}:{remembered.sha256(file)}\n".encode())
    remembered.save()
    return digest.hexdigest()[:16]


def directory_checksum(directory: Path) -> dict:
    if not directory.is_dir():
        return {"error": f"{directory} is not a directory"}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
    return {"checksum": checksum_of(files, directory), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def dataset_facts(cfg) -> dict:
    """The checksum training's agreement check compares (the data files and how they are read), with remembered
    file checksums."""
    specs = resolve_all(cfg)
    remembered = RememberedChecksums(cache_file())
    checksum = dataset_checksum(specs, remembered.sha256)[:16]
    remembered.save()
    return {"checksum": checksum, "files": sum(len(spec.files) for spec in specs)}


def output_dir_facts(path: Path) -> dict:
    try:
        ensure_writable_dir(path, "output_dir")
    except StorageError as exc:
        return {"writable": False, "error": str(exc)}
    return {"writable": True, "free_bytes": shutil.disk_usage(path).free}


def store_facts(checkpoint_dir: str | None) -> dict | None:
    """With checkpoint_dir in an object store: whether this node lists, writes, reads back and deletes a probe
    object under its prefix with the credentials it has (None: checkpoint_dir is no URL)."""
    from meshtune.checkpoint.object_store import is_url, probe

    if not checkpoint_dir or not is_url(checkpoint_dir):
        return None
    return {"url": checkpoint_dir, "problem": probe(checkpoint_dir)}


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one (Linux ioctl; no third-party package)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def network_facts(master_addr: str, master_port: int | None) -> dict:
    """The interface the kernel routes MASTER_ADDR through, the one the host name resolves to (gloo's choice
    without GLOO_SOCKET_IFNAME), what the user set for NCCL and gloo, and InfiniBand devices."""
    addresses = interface_addresses()
    by_address = {address: name for name, address in addresses.items()}
    route_address = None
    try:
        target = socket.getaddrinfo(master_addr, master_port or 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(target)  # UDP: no packet is sent, the kernel only picks the route
            route_address = sock.getsockname()[0]
    except OSError as exc:
        return {"error": f"MASTER_ADDR {master_addr} does not resolve or route: {exc.strerror or exc}"}
    try:
        hostname_address = socket.gethostbyname(socket.gethostname())
    except OSError:
        hostname_address = None
    ib = Path("/sys/class/infiniband")
    return {"route_interface": by_address.get(route_address), "route_address": route_address,
            "master_resolves_to": target[0], "hostname_interface": by_address.get(hostname_address),
            "hostname_address": hostname_address,
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME"),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
            "infiniband": sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []}
