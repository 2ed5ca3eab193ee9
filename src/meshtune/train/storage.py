"""Where a run writes: can it write there at all (checked before any process starts), and is output_dir one storage
for all nodes? Checkpoints written to node-local disks are split across nodes and cannot be resumed from any single
one (LLaMA-Factory #2398, DeepSpeed #2319), so meshtune checks at start."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from meshtune.distributed import DistEnv, barrier
from meshtune.errors import STORAGE_CAUSES, MeshtuneError, StorageError

logger = logging.getLogger(__name__)

TOKEN_PREFIX = ".meshtune-shared-"


def ensure_writable_dir(path: str | Path, key: str) -> Path:
    """Create `path` if needed and write a file in it; a StorageError naming `key`, the path and the cause if that
    fails, so a bad output_dir stops before any process starts instead of deep inside one."""
    path = Path(path).expanduser()
    probe = path / f".meshtune-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("meshtune")
        probe.unlink()
    except OSError as error:
        why = STORAGE_CAUSES.get(error.errno, error.strerror or str(error))
        raise StorageError(f"{key}: cannot write to {path}: {why} ({error}). Set {key} to a directory this "
                           f"user can write on every node") from None
    return path


def check_shared_output_dir(output_dir: Path, env: DistEnv, allow_local: bool) -> bool:
    """Collective. Rank 0 writes a random token; the first process of every node looks for it.

    Returns True when the storage is shared; raises when it is not, unless `allow_local` (then the run goes on
    without periodic checkpoints or resume: DCP's shards of all ranks must land in one directory).
    """
    if env.world_size == 1:
        return True
    token = [secrets.token_hex(8) if env.is_main else None]
    dist.broadcast_object_list(token, src=0)
    path = Path(output_dir) / f"{TOKEN_PREFIX}{token[0]}"
    if env.is_main:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(socket.gethostname())
    barrier()
    seen = path.is_file() if env.is_local_main else True
    answers: list = [None] * env.world_size
    dist.all_gather_object(answers, (seen, socket.gethostname(), os.environ.get("MESHTUNE_NODE_RANK", "?")))
    barrier()
    if env.is_main:
        path.unlink(missing_ok=True)
    blind = sorted({f"node {node} ({host})" for ok, host, node in answers if not ok})
    if not blind:
        return True
    message = (f"output_dir {output_dir} is not shared storage: {', '.join(blind)} cannot see a file global rank 0 "
               f"wrote there. Sharded checkpoints need one directory that every rank writes into: put output_dir on "
               f"storage every node mounts at the same path (NFS, Lustre, ...)")
    if not allow_local:
        raise MeshtuneError(message + ", or set allow_local_checkpoints: true to train without periodic checkpoints")
    if env.is_main:
        logger.warning(f"warning: {message}. allow_local_checkpoints: true, so this run writes no periodic "
                       f"checkpoint and does not resume; final/ is written by global rank 0 on its own node")
    return False
