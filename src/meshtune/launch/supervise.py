"""This node's side of a launch: train in this process, or start torchrun and stand between it and the user.

The launching process tokenizes once and checks the rendezvous before torchrun starts. Its workers leave their
MeshtuneError in a directory it reads (`MESHTUNE_ERROR_DIR`), so the user's last line is the worker's own words;
a worker that meets one stops its agent, since restarts cannot fix a bad config.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from meshtune.errors import ConfigError, MeshtuneError

ERROR_DIR = "MESHTUNE_ERROR_DIR"  # where torchrun workers leave their error for the launching process
# how gloo and NCCL report that another rank died: a consequence, never the cause of a repeated failure
PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "remote process exit",
               "communicator was aborted")


def launch_training(cfg, argv: list[str], debug: bool = False) -> int:
    """Train in this process, or start this node's torchrun whose workers re-enter with `argv`. `debug` keeps
    torchrun's own tracebacks."""
    from meshtune.launch import (describe, detect_node_settings, launch_env, needs_torchrun, run_torchrun,
                                 torchrun_command, torchrun_worker)

    if not torchrun_worker():
        settings = detect_node_settings(cfg)
        check_cpu_processes(settings.nproc_per_node)
        check_output_paths(cfg)
        if needs_torchrun(settings):
            print(describe(settings), flush=True)
            prepare_data_once(cfg, settings.max_processes)
            if settings.multi_node:
                check_rendezvous(settings, cfg)
            with tempfile.TemporaryDirectory(prefix="meshtune-errors-") as errors:
                env = {**launch_env(settings), ERROR_DIR: errors}
                code = run_torchrun(torchrun_command(settings, argv, cfg), settings.nproc_per_node, env,
                                    show_agent_tracebacks=debug)
                reported = sorted(Path(errors).glob("*.txt"))
                if code != 0 and reported:  # a worker's own words, last, under torchrun's traceback
                    raise MeshtuneError(reported[0].read_text())
                if code != 0 and settings.multi_node and not any(Path(errors).glob("started-*")):
                    from meshtune.launch.reachability import rendezvous_failure

                    raise rendezvous_failure(settings, cfg.rdzv_timeout)
            if code != 0:
                raise MeshtuneError(f"training failed in a worker process (exit code {code}); its error is above")
            return 0
    from meshtune.train.loop import run

    run(cfg)
    if torchrun_worker():
        leave_worker()
    return 0


def leave_worker() -> None:
    """End a torchrun worker without interpreter finalisation. With FSDP2 on gloo, destroy_process_group() leaves
    the group's worker threads alive; one releasing a tensor while Python finalises aborts the process ("terminate
    called without an active exception", caught under gdb in ~1 of 6 exits) after a good run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_rendezvous(settings, cfg) -> None:
    """Node 0: the port is free; other nodes: node 0 answers within rdzv_timeout (else say why, not hang)."""
    from meshtune.launch.reachability import check_port_free, wait_for_master

    if settings.node_rank == 0:
        check_port_free(settings)
    else:
        print(f"waiting for node 0 at {settings.master_addr}:{settings.master_port} "
              f"(up to rdzv_timeout={cfg.rdzv_timeout} s)", flush=True)
        wait_for_master(settings, cfg.rdzv_timeout)


CPU_OVERSUBSCRIPTION = 4  # processes per core beyond which a CPU-only run is refused


def check_cpu_processes(nproc: int, cores: int | None = None, cuda: bool | None = None) -> None:
    """On a machine without GPUs every process computes on the cores: more processes than cores only slow the
    run, and far more (a GPU count typed on a laptop) thrash it. Warn above the core count, refuse far above it."""
    import torch

    cores = cores or os.cpu_count() or 1
    if (torch.cuda.is_available() if cuda is None else cuda) or nproc <= cores:
        return
    if nproc > CPU_OVERSUBSCRIPTION * cores:
        raise ConfigError(f"nproc_per_node {nproc} on a machine with no GPU and {cores} CPU cores: each process "
                          f"trains on the cores, so {nproc} would only thrash them; use at most {cores} (one per "
                          f"core) or run on a GPU machine")
    print(f"warning: nproc_per_node {nproc} is more than this machine's {cores} CPU cores (no GPU): the processes "
          f"share the cores and train slower than {cores} would", flush=True)


def check_output_paths(cfg) -> None:
    """output_dir and the tokenized cache are writable: one named error here, not one per worker."""
    from meshtune.data.pipeline import cache_dir
    from meshtune.train.storage import ensure_writable_dir

    ensure_writable_dir(cfg.output_dir, "output_dir")
    ensure_writable_dir(cache_dir(cfg), "tokenized_path" if cfg.tokenized_path else "output_dir")


def prepare_data_once(cfg, nproc: int) -> None:
    """Tokenize and plan in the launching process: data errors show before any worker starts, workers hit the cache."""
    from meshtune.data.pipeline import plan_steps, prepare_datasets
    from meshtune.model.loading import check_model_dir, load_tokenizer

    tokenizer = load_tokenizer(check_model_dir(cfg.model_name_or_path))
    train_data, _ = prepare_datasets(cfg, tokenizer, show_progress=True, log=lambda _line: None)
    plan_steps(cfg, train_data, nproc, cfg.gradient_accumulation_steps)


def worker_label() -> str | None:
    """Under torchrun every worker usually meets the same error: one per node (local rank 0) reports it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return f" (node {os.environ.get('MESHTUNE_NODE_RANK', os.environ.get('GROUP_RANK', '?'))}, rank {os.environ.get('RANK')})"


def stop_restarts() -> None:
    """A MeshtuneError (bad config, data, disagreeing nodes) fails the same way on every restart: in a torchrun
    worker, stop this node's agent now instead of letting it restart the workers max_restarts times. Crashes and
    dead nodes are not MeshtuneErrors and still get their restarts."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # our parent is a torchrun agent
        sys.stderr.flush()
        os.kill(os.getppid(), signal.SIGTERM)


def repeated_failure(exc: Exception) -> MeshtuneError | None:
    """A torchrun worker's crash, remembered across attempts in the launcher's error directory: when this rank
    failed with the same error in an earlier attempt, another restart would too, and this says so; None on a
    first failure (or outside a meshtune-started torchrun), which torchrun then restarts."""
    directory = os.environ.get(ERROR_DIR)
    if not (directory and os.path.isdir(directory) and "TORCHELASTIC_RUN_ID" in os.environ):
        return None
    error = f"{type(exc).__name__}: {exc}"
    if any(words in error for words in PEER_FAILED):  # another rank's crash, seen from here: not this rank's cause
        return None
    rank, attempt = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    earlier = [int(p.stem.rsplit("attempt", 1)[1]) for p in Path(directory).glob(f"failure-rank{rank}-attempt*.log")
               if p.read_text() == error]
    Path(directory, f"failure-rank{rank}-attempt{attempt}.log").write_text(error)
    if not earlier:
        return None
    return MeshtuneError(f"rank {rank} failed the same way in attempts {min(earlier) + 1} and {attempt + 1}, so "
                         f"restarts cannot fix it; stopping (its traceback is above): {error}")


def report_to_launcher(message: str) -> bool:
    """Hand a worker's error to the meshtune process that started torchrun, which prints it once, as the last
    line; False when no such process listens (the user's own torchrun), and the worker prints it itself."""
    directory = os.environ.get(ERROR_DIR)
    if not (directory and os.path.isdir(directory)):
        return False
    Path(directory, f"rank-{int(os.environ.get('RANK', '0')):06d}.txt").write_text(message)
    return True


def mark_worker_started() -> None:
    """A worker got past the rendezvous: the launcher then knows a failure was not a rendezvous timeout."""
    directory = os.environ.get(ERROR_DIR)
    if directory and os.path.isdir(directory):
        Path(directory, f"started-{os.environ.get('RANK', '0')}").touch()
