"""How a node ends, and what the others learn of it: a storage error on one node ends every node with its words;
SIGTERM ends every node within seconds of the checkpoint it leads to; a node's workers do not outlive its
launcher, and the other nodes never wait past a short bound in torchrun's exit barrier.

The parts first, in this process (the store between launchers, the workers' watch over their parents, torchrun's
end); then two agents of one process each on 127.0.0.1, as tests/test_faults.py runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import kill_tree
from processes import alive, descendants
from ranks import free_port, wait_for_port
from test_faults import EXIT_AFTER_SAVE_S, Cluster, Node, job_config, published_after, wait_for_step

# ---- the parts


def settings(rank: int, port: int, nnodes: str = "2"):
    from meshtune.launch.nodes import NodeSettings

    return NodeSettings(nnodes=nnodes, node_rank=rank, master_addr="127.0.0.1", master_port=port, nproc_per_node=1,
                        run_id="job-1", source={})


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def two_launchers(tmp_path: Path, done: dict[int, bool]):
    """node 0's rendezvous store (both launchers' ranks left in it) and a JobChannel per node."""
    import torch.distributed as dist

    from meshtune.launch.job_channel import JobChannel
    from meshtune.doctor.joining import join_key
    from meshtune.mailbox import Mailbox

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    for rank in (0, 1):
        store.set(join_key("job-1", rank), "host")
        (tmp_path / f"node{rank}").mkdir()
    channels = [JobChannel(settings(rank, port), Mailbox(tmp_path / f"node{rank}"), lambda rank=rank: done[rank], True)
                for rank in (0, 1)]
    return store, channels


def test_a_workers_error_reaches_the_other_nodes_before_its_worker_stops_its_agent(tmp_path):
    """Node 1's worker reports an error: its launcher posts it in the store and lets the worker go (TOLD) once
    node 0's launcher has read it, which names node 1 and the error."""
    from meshtune.mailbox import TOLD, Mailbox

    store, channels = two_launchers(tmp_path, {0: False, 1: False})
    with channels[0], channels[1]:
        Mailbox(tmp_path / "node1").report_error(1, "output_dir: the file system is read-only")
        assert wait_until(lambda: (tmp_path / "node1" / TOLD).exists())
        host = json.loads(store.get("meshtune/job-1/error"))["host"]
        assert channels[0].cause == (f"node 1 ({host}) stopped the job, and this node with it: output_dir: the file "
                                     f"system is read-only")
        assert store.add("meshtune/job-1/error/known", 0) == 2  # both knew before the worker went on
        assert channels[1].cause is None and not (tmp_path / "node0" / TOLD).exists()


def test_a_launcher_leaving_right_after_its_workers_end_still_posts_them_done(tmp_path):
    """Node 1's workers end and its launcher leaves before its channel's next poll (a signal to the whole node):
    the channel posts the end on its way out, so node 0 ends its torchrun at once instead of after AGENT_EXIT_S."""
    done = {0: False, 1: False}
    store, channels = two_launchers(tmp_path, done)
    channels[1].__enter__()
    time.sleep(0.6)  # a few polls with the workers running
    done[1] = True
    channels[1].__exit__(None, None, None)  # at once: no poll saw the workers done
    assert channels[1]._done_posted and store.add("meshtune/job-1/done", 0) == 1
    with channels[0]:
        done[0] = True
        assert wait_until(channels[0].all_done, 5)


def test_each_launcher_learns_when_every_nodes_workers_are_done(tmp_path):
    done = {0: False, 1: False}
    _store, channels = two_launchers(tmp_path, done)
    with channels[0], channels[1]:
        done[0] = True
        assert wait_until(lambda: channels[0]._nodes_done == 1, 5)  # node 0 posted its end and read the count
        assert not channels[0].all_done() and not channels[1].all_done()
        done[1] = True
        assert wait_until(lambda: channels[0].all_done() and channels[1].all_done(), 5)


def test_a_store_gone_once_the_workers_are_done_leaves_no_cpp_trace_in_the_output(tmp_path, capfd):
    """The end of a good job: node 0's agent, which hosts the store, leaves while the launchers still poll it.
    torch's C++ client logs each failed read with a stack trace; once its node's workers are done, a launcher's
    channel reads on in silence (the end it would report is torchrun's)."""
    import torch.distributed as dist

    from meshtune.launch.job_channel import JobChannel
    from meshtune.mailbox import Mailbox

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    channel = JobChannel(settings(1, port, nnodes="3"), Mailbox(tmp_path), lambda: True, True)  # nodes 0, 2 not done
    failed_reads, exchange = [], channel._exchange

    def reading(store) -> None:
        try:
            exchange(store)
        except Exception:
            failed_reads.append(store)
            raise

    channel._exchange = reading
    with channel:
        assert wait_until(lambda: channel._done_posted, 5) and not channel.all_done()
        del store  # node 0's agent leaves: the store's port closes while this launcher polls it
        assert wait_until(lambda: failed_reads, 10)  # the launcher read the closed store
    err = capfd.readouterr().err
    assert "recvValue failed" not in err and "TCPStore" not in err, err[-2000:]


def test_a_report_with_nobody_to_tell_is_acknowledged_at_once(tmp_path):
    from meshtune.launch.job_channel import JobChannel, await_told
    from meshtune.mailbox import TOLD, Mailbox

    mailbox = Mailbox(tmp_path)
    with JobChannel(settings(0, free_port(), nnodes="1"), mailbox, lambda: False, use_store=False):
        mailbox.report_error(0, "a config error")
        started = time.monotonic()
        await_told(mailbox)
    assert (tmp_path / TOLD).exists() and time.monotonic() - started < 2


WORKER = """
import time
from meshtune.launch.parent_watch import watch_parents
watch_parents(poll_s=0.1)
print("watching", flush=True)
time.sleep(60)
"""
AGENT = """
import subprocess, sys, time
print(subprocess.Popen([sys.executable, "-c", sys.argv[1]]).pid, flush=True)
time.sleep(60)
"""
LAUNCHER = """
import os, subprocess, sys, time
os.environ["MESHTUNE_LAUNCHER_PID"] = str(os.getpid())
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["launcher", "agent"])
def test_a_worker_stops_with_its_agent_or_launcher(killed):
    """launcher -> agent -> worker, as meshtune -> torchrun -> worker: SIGKILL to the launcher alone (left a zombie:
    its parent, this test, does not reap it yet) or to the agent alone, and the worker is gone within two seconds,
    the agent with it."""
    from meshtune.launch.parent_watch import parent_of

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, AGENT, WORKER], stdout=subprocess.PIPE, text=True)
    try:
        lines = sorted(launcher.stdout.readline().strip() for _ in range(2))  # the agent's and the worker's
        assert lines[1] == "watching", lines  # the worker's watch started
        worker = int(lines[0])
        agent = parent_of(worker)
        assert agent is not None and parent_of(agent) == launcher.pid
        assert alive(worker) and alive(agent)
        os.kill(launcher.pid if killed == "launcher" else agent, signal.SIGKILL)
        assert wait_until(lambda: not alive(worker), 3), f"the worker outlived the {killed}"
        assert wait_until(lambda: not alive(agent), 3), f"the agent outlived the {killed}"
    finally:
        kill_tree(launcher.pid)
        launcher.wait()


class FakeChannel:
    def __init__(self, workers_done=False, all_done=False, cause=None):
        self._workers_done, self._all_done, self.cause = workers_done, all_done, cause

    def workers_done(self) -> bool:
        return self._workers_done

    def all_done(self) -> bool:
        return self._all_done

    def cut_off(self) -> bool:
        return False


# a torchrun that never leaves its exit barrier, its workers gone; and one with a worker still training
STUCK_AGENT = [sys.executable, "-c", "import time; time.sleep(60)"]
AGENT_AND_WORKER = [sys.executable, "-c", "import subprocess, sys, time\n"
                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)"]


@pytest.mark.slow
@pytest.mark.parametrize("every_node_done", [True, False])
def test_torchrun_stuck_in_its_exit_barrier_is_ended_soon_after_the_workers(every_node_done, monkeypatch):
    """This node's workers are done: torchrun gets AGENT_GRACE_S once every node's are, else AGENT_EXIT_S (its 10 s
    shortened to 4 here: what is checked is which of the two bounds the agent gets, not how long a wait is)."""
    from meshtune.launch import torchrun

    monkeypatch.setattr(torchrun, "AGENT_EXIT_S", 4)
    bound = torchrun.AGENT_GRACE_S + 2 if every_node_done else torchrun.AGENT_EXIT_S + 4
    started = time.monotonic()
    ended = torchrun.run_torchrun(STUCK_AGENT, 1, channel=FakeChannel(workers_done=True, all_done=every_node_done))
    took = time.monotonic() - started
    assert ended.code == -signal.SIGKILL
    assert took < bound and (every_node_done or took > torchrun.AGENT_EXIT_S), took


@pytest.mark.slow
def test_another_nodes_error_ends_torchrun_and_its_workers_at_once():
    from meshtune.launch.torchrun import run_torchrun

    started = time.monotonic()
    channel = FakeChannel()
    process_tree: list[int] = []
    earlier = set(descendants(os.getpid()))  # children of earlier tests (a multiprocessing resource tracker, say)

    def new_processes() -> list[int]:
        return [pid for pid in descendants(os.getpid()) if pid not in earlier]

    def cause_after_a_while():
        wait_until(lambda: len(new_processes()) == 2, 5)  # torchrun and its worker are running
        process_tree.extend(new_processes())
        channel.cause = "node 0 (host) stopped the job, and this node with it: the storage is full"

    import threading

    threading.Thread(target=cause_after_a_while, daemon=True).start()
    ended = run_torchrun(AGENT_AND_WORKER, 1, channel=channel)
    assert ended.code == -signal.SIGKILL and time.monotonic() - started < 5
    assert len(process_tree) == 2 and wait_until(lambda: not any(alive(pid) for pid in process_tree), 3)


# ---- two nodes of one process each on 127.0.0.1

STEPS = 40  # with slow:0.3, about 0.5 s a step: the job runs long after any test's action


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def start_pair(cluster: Cluster, config: Path, fault: str = "slow:0.3", port: int | None = None) -> list[Node]:
    port = port or free_port()
    env = {"NPROC_PER_NODE": "1", "MESHTUNE_FAULT": fault}
    nodes = [cluster.start(0, config, port, env=env)]
    wait_for_port(port, nodes[0].process, timeout=120)
    return nodes + [cluster.start(1, config, port, env=env)]


def last_line(node: Node) -> str:
    return node.output().strip().splitlines()[-1]


def check_every_node_named_the_cause(nodes: list[Node], cause: str) -> None:
    """One node stopped for its own error; the other names that node and the error; both on their last line, with
    no worker's traceback."""
    lines = [last_line(node) for node in nodes]
    for node, line in zip(nodes, lines):
        assert node.process.returncode == 1 and line.startswith("meshtune: error: ") and cause in line, line
        assert "Traceback" not in node.output(), node.output()[-4000:]
    told = [line for line in lines if "stopped the job, and this node with it" in line]
    assert len(told) == 1, lines
    failed = lines.index(next(line for line in lines if line not in told))
    assert f"node {failed} (" in told[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_storage_error_on_one_node_ends_every_node_naming_it(cluster, tmp_path, tiny_model_dir, tiny_dataset, rank):
    """Global rank `rank` meets a read-only output_dir after step 7 (fault injection; the node hosting the rendezvous
    store, or the other): both nodes end within 30 s, each with the cause as its last line, and node 0's launcher
    leaves no lock behind."""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, max_steps=STEPS,
                        rdzv_timeout=120)
    nodes = start_pair(cluster, config, fault=f"slow:0.3,storage:7:{rank}")
    near_the_fault = wait_for_step(output, 6, nodes)
    for node in nodes:
        node.wait(120)
    assert time.monotonic() - near_the_fault < 30, [node.output()[-2000:] for node in nodes]
    check_every_node_named_the_cause(nodes, "the file system is read-only")
    assert "a restart cannot fix this" in last_line(nodes[0])
    assert not (output / ".meshtune-lock").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_save_ends_every_node_naming_it_in_one_line(cluster, tmp_path, tiny_model_dir,
                                                                          tiny_dataset):
    """A real full disk (a 1.1 MB tmpfs as output_dir; root only): the second checkpoint does not fit. Every rank's
    DCP write fails; each node says so in one line, not under every rank's traceback."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs",
                                                        str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        output = disk / "out"
        config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, max_steps=STEPS, save_steps=2,
                            save_total_limit=1, rdzv_timeout=120)
        nodes = start_pair(cluster, config)
        near_the_fault = wait_for_step(output, 3, nodes)
        for node in nodes:
            node.wait(120)
        assert time.monotonic() - near_the_fault < 30, [node.output()[-2000:] for node in nodes]
        for node in nodes:
            line = last_line(node)
            assert node.process.returncode == 1 and "No space left on device" in line, node.output()[-4000:]
            assert "free space or lower save_total_limit" in line and "checkpoint-2 stays the resume point" in line
            assert "Traceback" not in node.output(), node.output()[-4000:]
        assert not (output / ".meshtune-lock").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
@pytest.mark.alone
def test_sigterm_to_every_process_of_node_1_ends_every_node_within_seconds_of_its_checkpoint(
        cluster, tmp_path, tiny_model_dir, tiny_dataset):
    """SLURM signals every process of the job step: launcher, torchrun and worker of node 1 at once. Both nodes
    write a checkpoint past the periodic one and exit 143. (Only node 0's launcher signalled, as Kubernetes does,
    and the relaunch that resumes exactly: test_faults.py.)"""
    output = tmp_path / "output"
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, max_steps=STEPS)
    nodes = start_pair(cluster, config)
    wait_for_step(output, 5, nodes)
    signalled = time.monotonic()
    kill_tree(nodes[1].process.pid, signal.SIGTERM)
    saved, published = published_after(output, 4, nodes)
    for node in nodes:
        assert node.wait(60) == 143, node.output()[-4000:]
    assert time.monotonic() - published < EXIT_AFTER_SAVE_S, [node.output()[-2000:] for node in nodes]
    assert time.monotonic() - signalled < 30
    text = nodes[0].output() + nodes[1].output()
    assert f"SIGTERM received: stopping after step {saved} of {STEPS}; writing checkpoint-{saved}" in text, text
    assert saved in (6, 7) and "run the same command again to resume" in last_line(nodes[0])
    assert not (output / "final").exists()


def stops_for_the_lost_peer(nodes: list[Node], node0: list[int], killed: float) -> None:
    """Node 0's worker (node0: its torchrun and worker before the kill), failed on its lost peer, gone within 30 s
    of the kill; its launcher and torchrun stay, back in the rendezvous, waiting for node 1."""
    assert wait_until(lambda: not alive(node0[1]), 30 - (time.monotonic() - killed)), nodes[0].output()[-3000:]
    assert alive(node0[0]) and nodes[0].process.poll() is None, nodes[0].output()[-3000:]


@pytest.mark.slow
def test_an_agent_then_a_launcher_killed_alone_take_their_workers_along_and_the_job_recovers(
        cluster, tmp_path, tiny_model_dir, tiny_dataset):
    """Node 1 loses a process of its own twice in one job, and each time the job goes on once node 1 is relaunched.
    First SIGKILL to its torchrun alone (the OOM killer's pick): its worker stops within seconds and its launcher
    names what happened. Then, after the relaunched job's first checkpoint, SIGKILL to its meshtune launcher alone
    (its torchrun and worker left running): they stop within seconds. Each time node 0's worker stops within 30 s
    and its torchrun waits for node 1 in the rendezvous; node 1's relaunch resumes the job, to its last step."""
    output, port = tmp_path / "output", free_port()
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, max_steps=16)
    nodes = start_pair(cluster, config, port=port)
    wait_for_step(output, 5, nodes)
    (agent, worker), node0 = descendants(nodes[1].process.pid), descendants(nodes[0].process.pid)
    killed = time.monotonic()
    os.kill(agent, signal.SIGKILL)
    assert wait_until(lambda: not alive(worker), 5), "node 1's worker outlived its torchrun"
    assert nodes[1].wait(30) == 1
    assert "this node's torchrun agent was killed (SIGKILL) and its workers stopped with it" in last_line(nodes[1])
    stops_for_the_lost_peer(nodes, node0, killed)

    # the first launch may have published checkpoint-8 itself before its peer was lost (a loaded machine reads
    # step 5 late): wait for a checkpoint the relaunched job publishes, past every one there now
    newest = max([int(p.parent.name.split("-")[1]) for p in output.glob("checkpoint-*/COMPLETE")
                  if not p.parent.name.endswith(".tmp")], default=0)
    nodes[1] = cluster.start(1, config, port, env={"NPROC_PER_NODE": "1"})
    published_after(output, max(newest, 4), nodes, timeout=240)
    orphans, node0 = descendants(nodes[1].process.pid), descendants(nodes[0].process.pid)
    assert len(orphans) == 2 and len(node0) == 2, (orphans, node0, nodes[1].process.poll(),  # torchrun, worker
                                                   nodes[1].output()[-3000:])
    seen = len(nodes[0].output())
    killed = time.monotonic()
    os.kill(nodes[1].process.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(alive(pid) for pid in orphans), 5), "node 1's processes outlived its launcher"
    stops_for_the_lost_peer(nodes, node0, killed)
    text = nodes[0].output()[seen:]
    assert "Traceback" not in text and "a collective failed because another rank died or stopped" in text, text
    relaunched = cluster.start(1, config, port, env={"NPROC_PER_NODE": "1"})
    assert nodes[0].wait(240) == 0 and relaunched.wait(240) == 0, nodes[0].output()[-4000:]
    assert "resumed from" in nodes[0].output() + relaunched.output()
    assert (output / "final" / "model.safetensors").exists()
