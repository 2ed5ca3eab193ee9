"""This node's side of a launch: train in this process, or start torchrun and stand between it and the user.

The launching process tokenizes once and checks the rendezvous before torchrun starts. Its workers leave their
MeshtuneError in its mailbox (mailbox.py), so the user's last line is the worker's own words; a worker that meets
one stops its agent, since restarts cannot fix a bad config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

from meshtune import logs
from meshtune.errors import EXIT_RETRYABLE, ConfigError, MeshtuneError, NodesLostError
from meshtune.mailbox import Mailbox
from meshtune.worker_env import LAUNCHER_PID, torchrun_worker

logger = logging.getLogger(__name__)

# how gloo and NCCL report that another rank died: a consequence, never the cause of a repeated failure
PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "remote process exit",
               "communicator was aborted")


def launch_training(cfg, argv: list[str], debug: bool = False) -> int:
    """Train in this process, or start this node's torchrun whose workers re-enter with `argv`. `debug` keeps
    torchrun's own tracebacks. Returns the exit code: 0, or 128 + the signal that stopped the run early."""
    from meshtune.launch import detect_node_settings, needs_torchrun
    from meshtune.model.custom_code import refuse_custom_code
    from meshtune.train.trackers import check_installed

    check_installed(cfg.report_to)  # report_to's packages: a named error before anything starts
    refuse_custom_code(cfg.model_name_or_path)  # transformers would ask to run the folder's code: never
    if torchrun_worker():
        return train_here(cfg)
    settings = detect_node_settings(cfg)
    check_cpu_processes(settings.nproc_per_node)
    check_gpu_processes(settings.nproc_per_node, settings.source.get("nproc_per_node", "config"))
    check_output_paths(cfg, settings.node_rank if str(settings.nnodes) != "1" else None)
    with output_lock(cfg.output_dir, settings) as lock:
        if needs_torchrun(settings):
            return run_node(cfg, settings, argv, debug, rejoining=lock is not None and lock.rejoined)
        return train_here(cfg)


def train_here(cfg) -> int:
    """Train in this process: the only one, or a torchrun worker (which never returns: see leave_worker)."""
    from meshtune.launch.parent_watch import watch_parents
    from meshtune.train.loop import run
    from meshtune.train.preemption import exit_code

    logs.show_all_ranks(cfg.log_level_all_ranks)
    if torchrun_worker():
        watch_parents()
    result = run(cfg)
    code = exit_code(result.stopped_by) if result.stopped_by else 0
    if torchrun_worker():
        mailbox, rank = Mailbox.of_launcher(), int(os.environ.get("RANK", "0"))
        if mailbox is not None and result.stopped_by:
            # a worker that stopped for a signal exits 0, or torchrun would restart it; the launcher reports it
            mailbox.mark_stopped(rank, result.stopped_by)
            code = 0
        elif mailbox is not None:  # its launcher need not leave torchrun waiting in its exit barrier for long
            mailbox.mark_finished(rank)
        leave_worker(code)
    return code


def run_node(cfg, settings, argv: list[str], debug: bool, rejoining: bool = False) -> int:
    """This node's torchrun, between the user and it: the preflight checks across the nodes (unless node 0
    `rejoining` its running job), tokenize, check the rendezvous, run torchrun (again after node 0's store was
    lost), then say in one line how it ended."""
    from meshtune.launch import describe, launch_env
    from meshtune.launch.preflight import run_preflight

    logger.info(describe(settings))
    run_preflight(cfg, settings, rejoining)  # its store on MASTER_PORT is closed before torchrun's takes the port
    prepare_data_once(cfg, settings.max_processes)
    if settings.multi_node:
        check_rendezvous(settings, cfg)
    with Mailbox.created() as mailbox:
        env = {**launch_env(settings, cfg.stop_grace_period), **mailbox.environment(),
               LAUNCHER_PID: str(os.getpid())}
        rejoins = 0
        while (code := run_torchrun_once(cfg, settings, argv, debug, env, mailbox)) is None:
            rejoins += 1
            lost = mailbox.peers_lost()
            mailbox.clear_peers_lost()
            if settings.node_rank != 0:  # node 0 hosts the store: its own torchrun starts it again
                rejoin_after_store_loss(settings, cfg, rejoins, lost)
            elif rejoins > cfg.max_restarts:
                raise MeshtuneError(f"node 0 started torchrun {rejoins} times and its max_restarts="
                                    f"{cfg.max_restarts} are used up")
        return code


def run_torchrun_once(cfg, settings, argv: list[str], debug: bool, env: dict, mailbox: Mailbox) -> int | None:
    """One torchrun of this node. Returns the exit code, None when node 0's rendezvous store was lost (rejoin),
    or raises the error that ended it, named: this node's worker's, or another node's (launch/job_channel.py)."""
    from meshtune.launch import run_torchrun, torchrun_command
    from meshtune.launch.torchrun import end_workers_line
    from meshtune.launch.job_channel import JobChannel
    from meshtune.doctor.joining import JoinWatch
    from meshtune.doctor.reachability import rendezvous_failure
    from meshtune.train.preemption import exit_code

    c10d = cfg.rdzv_backend == "c10d"  # an etcd rendezvous holds no store of node 0 to watch or lose
    watching = JoinWatch(settings, mailbox, cfg.rdzv_timeout) if settings.multi_node and c10d else None
    nproc = settings.nproc_per_node
    workers_done = lambda: mailbox.stopped_workers() + mailbox.finished_workers() >= nproc  # noqa: E731
    channel = JobChannel(settings, mailbox, workers_done, use_store=settings.multi_node and c10d)
    _launched.set()
    with watching or contextlib.nullcontext(), channel:
        ended = run_torchrun(torchrun_command(settings, argv, cfg), nproc, env, show_agent_tracebacks=debug,
                             mailbox=mailbox, stop_wait_s=cfg.stop_grace_period + 30, channel=channel)
    reported = mailbox.first_error()
    if ended.code != 0 and reported is not None:  # a worker's own words, last, under torchrun's traceback
        raise MeshtuneError(reported)
    if channel.cause is not None:
        raise MeshtuneError(channel.cause)
    if stopped := mailbox.stopped_signal() or (ended.signal if ended.signal == signal.SIGTERM else None):
        end_workers_line()
        logger.info(f"meshtune: stopped by {signal.Signals(stopped).name} (exit code {exit_code(stopped)}); run the "
                    f"same command again to resume")
        return exit_code(stopped)
    if ended.signal == signal.SIGINT:
        return 130
    if ended.code == 0 or mailbox.finished_workers() >= nproc:  # torchrun ended after its workers finished
        return 0
    if channel.severed is not None:  # this node's workers lost node 0 and its store does not answer: rejoin
        return None
    if ended.store_lost and c10d and settings.node_rank != 0:
        return None
    if ended.rank_exchange_lost and c10d:  # a node died as the round completed: torchrun again, in a new round
        logger.warning(f"meshtune: node {settings.node_rank}: a node left torchrun's rendezvous just as its round "
                       f"completed (killed or lost before it posted its workers' share); starting torchrun again to "
                       f"meet the others in a new round")
        return None
    if ended.rendezvous_closed and c10d:  # an agent that gave up closed it for all: the job goes on in a new one
        if settings.node_rank != 0:  # node 0 hosts the next one: rejoin it, as after its store's loss
            return None
        logger.warning("meshtune: node 0: another node's torchrun ended and closed the rendezvous while this node's "
                       "waited in it (no worker here failed); starting torchrun again to meet the others in a new one")
        return None
    if (lost := mailbox.peers_lost()) is not None:  # they never came back: the hang's line, then the end
        nodes = ", ".join(f"node {node}" for node in lost["nodes"])
        raise NodesLostError(f"node {settings.node_rank} lost {nodes} at step {lost['step']} (a network partition, "
                             f"or {'they' if len(lost['nodes']) > 1 else 'it'} stopped or died) and they did not meet "
                             f"again within rdzv_timeout={cfg.rdzv_timeout} s; once every node is up and reaches "
                             f"{settings.master_addr}:{settings.master_port}, run the same command on every node: it "
                             f"resumes from the newest checkpoint (exit code {EXIT_RETRYABLE}: retryable)")
    if settings.multi_node and not mailbox.any_started():
        raise rendezvous_failure(settings, cfg.rdzv_timeout, watching.joined if watching else None)
    if ended.code < 0 and not ended.signal:
        raise MeshtuneError(f"this node's torchrun agent was killed ({signal.Signals(-ended.code).name}) and its "
                            f"workers stopped with it; the other nodes wait for this node to come back (up to "
                            f"rdzv_timeout={cfg.rdzv_timeout} s): run the same command again on this node")
    raise MeshtuneError(f"training failed in a worker process (exit code {ended.code}); its error is above")


def rejoin_after_store_loss(settings, cfg, rejoins: int, lost: dict | None = None) -> None:
    """Node 0's launcher hosts the c10d rendezvous store: when it dies, or this node's workers lost node 0 and its
    store no longer answers (`lost`: a network partition, or node 0 died), this node's torchrun ends too. Wait for
    node 0 to answer again before torchrun starts again to join its new rendezvous, as a restarted node would (the
    workers resume from the newest checkpoint). Each rejoin counts as one of max_restarts."""
    from meshtune.doctor.reachability import RendezvousError, wait_for_master

    where = f"{settings.master_addr}:{settings.master_port}"
    if rejoins > cfg.max_restarts:
        raise RendezvousError(f"node {settings.node_rank} lost the rendezvous store at {where} (node 0's launcher "
                              f"hosts it) again, and its max_restarts={cfg.max_restarts} rejoins are used up")
    if lost is not None:
        logger.warning(f"meshtune: node {settings.node_rank} lost node 0 at step {lost['step']} and cannot reach its "
                       f"rendezvous store at {where} (a network partition, or node 0 died): waiting up to "
                       f"rdzv_timeout={cfg.rdzv_timeout} s for it to answer, then rejoining (rejoin {rejoins} of "
                       f"max_restarts={cfg.max_restarts})")
    else:
        logger.warning(f"meshtune: node {settings.node_rank} lost the rendezvous store at {where}, which node 0's "
                       f"launcher hosts: node 0 died or was stopped (no worker here failed). Waiting up to "
                       f"rdzv_timeout={cfg.rdzv_timeout} s for node 0 to be relaunched, then rejoining (rejoin "
                       f"{rejoins} of max_restarts={cfg.max_restarts})")
    try:
        wait_for_master(settings, cfg.rdzv_timeout)
    except RendezvousError:
        if lost is not None:
            raise NodesLostError(f"node {settings.node_rank} lost node 0 at step {lost['step']} (a network "
                                 f"partition, or node 0 stopped or died) and could not reach its rendezvous store at "
                                 f"{where} again within rdzv_timeout={cfg.rdzv_timeout} s; once every node is up and "
                                 f"reaches {where}, run the same command on every node: it resumes from the newest "
                                 f"checkpoint (exit code {EXIT_RETRYABLE}: retryable)") from None
        raise RendezvousError(f"node {settings.node_rank}: the rendezvous store at {where} was lost (node 0 died or "
                              f"was stopped) and did not come back within rdzv_timeout={cfg.rdzv_timeout} s: "
                              f"relaunch node 0 with the same command, then this node") from None


@contextlib.contextmanager
def output_lock(output_dir: str, settings):
    """Node 0 holds output_dir's lock for the whole job; the other nodes follow its verdict on a lock they find
    (launch/output_lock.py). A node that the live node 0's lock shows misconfigured (a second NODE_RANK 0, another
    MASTER_PORT) tells node 0 too, through its store, so that neither waits out rdzv_timeout."""
    from meshtune.doctor.joining import refusal_key
    from meshtune.doctor.reachability import post_note
    from meshtune.launch.output_lock import NodeMismatch, OutputLock, follow_node0

    lock = None
    try:
        if settings.node_rank == 0:
            lock = OutputLock(output_dir, settings.run_id, same_job_takes_over=settings.multi_node,
                              master_addr=settings.master_addr, master_port=settings.master_port).__enter__()
        else:
            follow_node0(output_dir, settings.run_id, settings.node_rank, settings.master_addr, settings.master_port,
                         settings.source.get("master_port", ""))
    except NodeMismatch as mismatch:
        host, port, run_id, message = mismatch.note
        if isinstance(port, int) and settings.multi_node:
            post_note(host, port, refusal_key(run_id), message)
        raise
    try:
        yield lock
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


_launched = threading.Event()  # this process started torchrun: it is a node's launcher


def ran_torchrun() -> bool:
    return _launched.is_set()


def leave_launcher(code: int) -> None:
    """End a node's launcher without interpreter finalisation: the teardown of torch, transformers and the data
    stack it imported took 3 to 8 s on 2 busy cores, after every file and lock of the run was closed and the last
    line printed."""
    leave_worker(code)


def leave_worker(code: int = 0) -> None:
    """End a torchrun worker without interpreter finalisation. With FSDP2 on gloo, destroy_process_group() leaves
    the group's worker threads alive; one releasing a tensor while Python finalises aborts the process ("terminate
    called without an active exception", caught under gdb in ~1 of 6 exits) after a good run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_rendezvous(settings, cfg) -> None:
    """c10d: node 0's port is free; other nodes: node 0 answers within rdzv_timeout (else say why, not hang).
    etcd-v2: python-etcd is installed and every node reaches the etcd server."""
    from meshtune.doctor.reachability import reach_node0, wait_for_endpoint

    if cfg.rdzv_backend == "etcd-v2":
        host, port = etcd_endpoint(cfg)
        logger.info(f"rendezvous: etcd-v2 at {host}:{port} (up to rdzv_timeout={cfg.rdzv_timeout} s)")
        wait_for_endpoint(host, port, cfg.rdzv_timeout, f"node {settings.node_rank} could not reach the etcd "
                          f"server at {host}:{port} (rdzv_endpoint)", "is etcd running there, with --enable-v2 and "
                          "--listen-client-urls on an address the nodes reach?")
        return
    reach_node0(settings, cfg.rdzv_timeout)


def etcd_endpoint(cfg) -> tuple[str, int]:
    """rdzv_endpoint as (host, port), and python-etcd present: torchrun's etcd-v2 backend imports it."""
    host, _, port = (cfg.rdzv_endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"rdzv_backend etcd-v2 needs rdzv_endpoint as host:port of the etcd server, e.g. "
                          f"etcd.cluster.local:2379; got {cfg.rdzv_endpoint!r}")
    try:
        import etcd  # noqa: F401
    except ImportError:
        raise ConfigError("rdzv_backend etcd-v2 needs the python-etcd package on every node: "
                          "pip install 'meshtune[etcd]' (or python-etcd)") from None
    return host.strip("[]"), int(port)


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
    logger.warning(f"warning: nproc_per_node {nproc} is more than this machine's {cores} CPU cores (no GPU): the "
                   f"processes share the cores and train slower than {cores} would")


def check_gpu_processes(nproc: int, source: str, gpus: int | None = None) -> None:
    """On a CUDA machine each process trains on a GPU of its own (local rank r on GPU r): more processes than
    visible GPUs would crash the extra ones at their first CUDA call, after torchrun started them all. `gpus`: the
    visible CUDA GPUs (default: counted; 0 on a machine without CUDA, where processes train on the cores)."""
    from meshtune.cpu_affinity import cuda_device_count

    gpus = cuda_device_count() if gpus is None else gpus
    if gpus == 0 or nproc <= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise ConfigError(f"nproc_per_node {nproc} (from {source}) on a node with {gpus} visible CUDA GPU"
                      f"{'s' if gpus > 1 else ''}{seen}: each process needs a GPU of its own; set nproc_per_node: "
                      f"{gpus} (or leave it unset: one process per visible GPU), or run on a node with {nproc} GPUs")


def check_output_paths(cfg, node_rank: int | None = None) -> None:
    """output_dir, the tokenized cache and checkpoint_dir are writable: one named error here, not one per worker."""
    from meshtune.data.pipeline import cache_dir
    from meshtune.train.storage import ensure_writable_dir

    ensure_writable_dir(cfg.output_dir, "output_dir")
    ensure_writable_dir(cache_dir(cfg), "tokenized_path" if cfg.tokenized_path else "output_dir")
    if cfg.checkpoint_dir:
        check_checkpoint_dir(cfg.checkpoint_dir, node_rank)


def check_checkpoint_dir(checkpoint_dir: str, node_rank: int | None = None) -> None:
    """An object store this node cannot list, write, read back and delete in (its package missing, credentials
    missing or refused, the endpoint unreachable) is named here, before any process group; a path must be
    writable."""
    from meshtune.checkpoint.object_store import check_store, is_url
    from meshtune.train.storage import ensure_writable_dir

    if not is_url(checkpoint_dir):
        ensure_writable_dir(checkpoint_dir, "checkpoint_dir")
        return
    check_store(checkpoint_dir, f" (node {node_rank})" if node_rank is not None else "")

def prepare_data_once(cfg, nproc: int) -> None:
    """Tokenize and plan in the launching process: data errors show before any worker starts, workers hit the cache."""
    from meshtune.data.pipeline import plan_steps, prepare_datasets
    from meshtune.model.model_dir import check_model_dir, load_tokenizer

    tokenizer = load_tokenizer(check_model_dir(cfg.model_name_or_path))
    train_data, _ = prepare_datasets(cfg, tokenizer, show_progress=True, report=False)  # rank 0 reports the data
    # a cp x tp group's processes train the same rows, and so do a pipeline's stages: one data-parallel process
    model_parallel = cfg.tensor_parallel * cfg.context_parallel * cfg.pipeline_parallel
    plan_steps(cfg, train_data, max(nproc // model_parallel, 1), cfg.gradient_accumulation_steps)


def worker_label() -> str | None:
    """Under torchrun every worker usually meets the same error: one per node (local rank 0) reports it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return (f" (node {os.environ.get('MESHTUNE_NODE_RANK', os.environ.get('GROUP_RANK', '?'))}, "
            f"rank {os.environ.get('RANK')})")


def stop_restarts() -> None:
    """A MeshtuneError (bad config, data, disagreeing nodes) fails the same way on every restart: in a torchrun
    worker, stop this node's agent now instead of letting it restart the workers max_restarts times. Crashes and
    dead nodes are not MeshtuneErrors and still get their restarts."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # our parent is a torchrun agent
        sys.stderr.flush()
        os.kill(os.getppid(), signal.SIGTERM)


def repeated_failure(exc: Exception) -> MeshtuneError | None:
    """A torchrun worker's crash, remembered across attempts in the launcher's mailbox: when this rank failed
    with the same error in an earlier attempt, another restart would too, and this says so; None on a first
    failure (or outside a meshtune-started torchrun), which torchrun then restarts."""
    mailbox = Mailbox.of_launcher()
    if mailbox is None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    error = f"{type(exc).__name__}: {exc}"
    if any(words in error for words in PEER_FAILED):  # another rank's crash, seen from here: not this rank's cause
        return None
    rank, attempt = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    earlier = mailbox.record_failure(rank, attempt, error)
    if not earlier:
        return None
    return MeshtuneError(f"rank {rank} failed the same way in attempts {min(earlier) + 1} and {attempt + 1}, so "
                         f"restarts cannot fix it; stopping (its traceback is above): {error}")


def report_to_launcher(message: str) -> bool:
    """Hand a worker's error to the meshtune process that started torchrun, which prints it once, as the last
    line; False when no such process listens (the user's own torchrun), and the worker prints it itself. Returns
    once the launcher has passed it on to the other nodes (launch/job_channel.py): until this worker stops its
    agent, the store that carries it (node 0's agent hosts it) is still there."""
    from meshtune.launch.job_channel import await_told

    mailbox = Mailbox.of_launcher()
    if mailbox is None:
        return False
    mailbox.report_error(int(os.environ.get("RANK", "0")), message)
    await_told(mailbox)
    return True


def lost_peers(exc: Exception) -> bool:
    """A torchrun worker's collective failed because another rank died or stopped: its traceback says nothing of
    the cause (that rank's own output, or its launcher, does), so one line stands for it here (--debug shows it).
    True when said."""
    if torchrun_worker() and (watchdog := sys.modules.get("meshtune.train.hang_watchdog")) is not None:
        watchdog.await_report()  # a report in progress ends this process, with the node's line
    error = f"{type(exc).__name__}: {exc}"
    words = next((words for words in PEER_FAILED if words in error), None)
    if not torchrun_worker() or words is None:
        return False
    print(f"meshtune: rank {os.environ.get('RANK', '?')} (node {os.environ.get('MESHTUNE_NODE_RANK', '?')}): a "
          f"collective failed because another rank died or stopped ({words}); --debug shows the traceback",
          file=sys.stderr, flush=True)
    return True


def mark_worker_started() -> None:
    """A worker got past the rendezvous: the launcher then knows a failure was not a rendezvous timeout."""
    if (mailbox := Mailbox.of_launcher()) is not None:
        mailbox.mark_started(int(os.environ.get("RANK", "0")))
        mailbox.clear_peers_lost()  # the nodes met again: a loss before is over
