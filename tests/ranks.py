"""Ranks on this machine without paying Python's start-up in each: processes forked from a multiprocessing
forkserver that has imported torch, transformers, peft and meshtune's training code once. A fresh process spends
seconds importing them, most of a tiny test run's time.

- `run_ranks(job, world_size, workdir)`: `job(rank, world_size, workdir)` on gloo ranks of one group.
- `run_workers(argv, nproc, workdir)`: `meshtune ARGV` in each rank with the variables torchrun gives its workers,
  entering `meshtune.cli.main` as torchrun's `python -m meshtune` does: the training code of a one-node job,
  process group included. What only the launcher does (torchrun itself, restarts, signals, the error files between
  workers and launcher) is tested through the real `meshtune train` and torchrun (tests/test_faults.py,
  tests/test_launch.py, tests/test_node_exits.py)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

RANKS_TIMEOUT_S = 90
PRELOAD = ["meshtune", "torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers", "peft",
           "torchao", "meshtune.cli", "meshtune.train.loop"]


def context():
    """The forkserver context, started (once per test process) with the heavy modules imported. Forking a process
    that has imported torch but run nothing is safe: no thread pool exists yet to be lost in the child."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    return forkserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"


def wait_for_port(port: int, process: subprocess.Popen | None = None, host: str = "127.0.0.1",
                  timeout: float = 60, prefix: tuple[str, ...] | list[str] = (), ended_ok: bool = False) -> None:
    """Until `host:port` accepts a connection: node 0's launcher hosts the rendezvous store there, which a test
    waits for before it starts the other nodes. Fails once `process` (node 0) has ended (returns then instead with
    `ended_ok`: a test of a node 0 that stops early) or `timeout` s passed. `prefix` probes from another network
    namespace (`ip netns exec NAME`)."""
    deadline = time.monotonic() + timeout
    while True:
        if prefix:
            listening = subprocess.run([*prefix, sys.executable, "-c", PORT_PROBE, host, str(port)],
                                       capture_output=True).returncode == 0
        else:
            try:
                socket.create_connection((host, port), timeout=1).close()
                listening = True
            except OSError:
                listening = False
        if listening or (ended_ok and process is not None and process.poll() is not None):
            return
        assert process is None or process.poll() is None, f"it ended (code {process.returncode}) before {host}:" \
            f"{port} accepted a connection"
        assert time.monotonic() < deadline, f"nothing accepted a connection on {host}:{port} within {timeout} s"
        time.sleep(0.05)


def rank_entry(job, rank: int, world_size: int, port: int, workdir: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        job(rank, world_size, workdir)
        dist.destroy_process_group()
    except BaseException:
        (workdir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    # Skip interpreter shutdown: FSDP2's DTensor caches keep the gloo group (and its worker threads) alive past
    # destroy_process_group, and a worker freeing the last collective's tensors then needs the GIL while Python
    # finalises: "terminate called without an active exception", about 1 run in 6 on torch 2.13.
    os._exit(0)


def run_ranks(job, world_size: int, workdir: Path, entry=None) -> None:
    """Start `job` on `world_size` gloo ranks; fail with the ranks' tracebacks; never leave a process behind.
    `entry(job, rank, world_size, port, workdir)` runs in each process (default: `rank_entry`, which forms the
    group and calls `job`); it leaves its traceback in workdir/rank<R>.error."""
    port = free_port()
    processes = [context().Process(target=entry or rank_entry, args=(job, rank, world_size, port, workdir))
                 for rank in range(world_size)]
    hung = join_all(processes, RANKS_TIMEOUT_S)
    errors = "\n".join(p.read_text() for p in sorted(workdir.glob("rank*.error")))
    assert not hung, f"{len(hung)} rank(s) still running after {RANKS_TIMEOUT_S} s\n{errors}"
    assert all(p.exitcode == 0 for p in processes), errors


def join_all(processes, timeout: float) -> list:
    """Start and join `processes` within `timeout` seconds in all; kill the ones still running and return them."""
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [process for process in processes if process.is_alive()]
        for process in hung:
            process.kill()
            process.join()
    return hung


def worker_entry(argv: list[str], env: dict[str, str], log: Path, cwd: str) -> None:
    """One torchrun-like worker: its variables set, its output to `log`, then `python -m meshtune ARGV`'s code."""
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from meshtune.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as rank_entry: no interpreter shutdown beside a live gloo group


def run_workers(argv: list[str], nproc: int, workdir: Path, env: dict[str, str] | None = None,
                timeout: float = 240, per_node: int | None = None) -> tuple[list[int], str]:
    """`meshtune ARGV` on `nproc` local ranks, as torchrun --standalone would start them: (exit codes, the ranks'
    output, rank by rank). Ranks still running after `timeout` s are killed (exit code None). `per_node`: the ranks
    told they are on nodes of that many processes (consecutive ranks a node), as torchrun on several nodes tells
    them."""
    per_node = per_node or nproc
    workdir.mkdir(parents=True, exist_ok=True)
    run_id, port = uuid.uuid4().hex[:8], free_port()
    # as torchrun passes the caller's OMP_NUM_THREADS on (the suite sets one: tests/conftest.py), else the cores
    # over the ranks: runs held to each other bit for bit must multiply with the same threads
    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, len(os.sched_getaffinity(0)) // nproc)
    processes, logs = [], []
    for rank in range(nproc):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": str(nproc // per_node), "ROLE_NAME": "default",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": str(threads), **(env or {})}
        logs.append(workdir / f"worker{rank}.log")
        processes.append(context().Process(target=worker_entry, args=(argv, rank_env, logs[-1], os.getcwd())))
    join_all(processes, timeout)
    output = "".join(f"--- rank {rank}\n{log.read_text() if log.exists() else ''}" for rank, log in enumerate(logs))
    return [process.exitcode for process in processes], output


def train_on_ranks(config: str, nproc: int, workdir: Path, timeout: float = 240, per_node: int | None = None) -> None:
    """`meshtune train CONFIG` in this process (one rank) or on `nproc` forked ranks (told they are on nodes of
    `per_node`, as run_workers); every rank must succeed."""
    if nproc == 1:
        from meshtune.cli import main

        assert main(["train", config]) == 0
        return
    codes, output = run_workers(["train", config], nproc, workdir, timeout=timeout, per_node=per_node)
    assert codes == [0] * nproc, output[-6000:]


def run_meshtune_ranks(argv: list[str], nproc: int, workdir: Path, env: dict[str, str] | None = None,
                       timeout: float = 240) -> subprocess.CompletedProcess:
    """`run_workers` with `run_cli`'s result: return code 0 when every rank exited 0, else the first rank's other
    code (-9 for a rank killed at the timeout); stdout the ranks' output."""
    codes, output = run_workers(argv, nproc, workdir, env, timeout)
    failed = [-9 if code is None else code for code in codes if code != 0]
    return subprocess.CompletedProcess(argv, failed[0] if failed else 0, output, None)
