"""What the launchers of a job tell each other while their torchruns run, through the rendezvous store on
MASTER_PORT (node 0's torchrun agent hosts it; each launcher holds a client of its own, as doctor/joining.py does).

- A worker's MeshtuneError ends the job: restarts cannot fix it (a read-only or full output_dir, a bad config).
  Its launcher posts the message while the worker waits (`await_told`) before stopping its agent, so the store is
  still there to carry it; every other launcher, reading it, ends its own torchrun and the node's workers, and
  stops with those words. Without it, the others saw only their peers and the store vanish: node 0 stopped for a
  read-only output_dir looked dead, and node 1 waited rdzv_timeout for it to come back.
- Whether this node is cut off from node 0 (`cut_off`): its workers' hang watchdog found every rank of node 0
  silent, and a fresh connection to the store fails. torchrun's agent would wait on the store for many minutes (a
  read across a partition neither answers nor fails), so the launcher ends it and waits for node 0 itself.
- A node's workers all done (finished, or stopped for a signal): once every node's are, no agent needs another,
  and each launcher ends its torchrun at once instead of leaving it in torchrun's exit barrier, which waits up to
  300 s for an agent that was signalled (it leaves without reaching the barrier) or killed.

- Each launcher counts itself in under its NODE_RANK every BEAT_S. Beats of another launcher there mean two
  were given that rank: one whose workers have not started stops, naming it, and tells the others (below); one
  whose workers run says so and goes on (the job formed without the other).
- A node that cannot join leaves node 0 its reason (a second NODE_RANK 0, another MASTER_PORT: doctor/joining.py's
  refusal key): read while no worker of this node has started, it ends the wait as another node's error does.

On one node, and with an etcd rendezvous (no store on MASTER_PORT), there is nobody to tell: a report is
acknowledged at once.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from meshtune.doctor.joining import beat_key, connect, connect_possible, join_key, refusal_key
from meshtune.launch.nodes import NodeSettings
from meshtune.mailbox import Mailbox

POLL_S = 0.25
BEAT_S = 1.0  # how often a launcher counts itself in under its NODE_RANK
PROBE_S = 2.0  # how often a node whose workers lost node 0 tries a new connection to its store

logger = logging.getLogger(__name__)
READ_WAIT_S = 5.0  # how long a launcher waits for the other nodes to read its node's error before the worker goes


def error_key(run_id: str) -> str:
    return f"meshtune/{run_id}/error"


def known_key(run_id: str) -> str:
    """A counter: the launchers that know of a posted error (the one that posted it included)."""
    return f"meshtune/{run_id}/error/known"


def done_key(run_id: str) -> str:
    """A counter: the nodes whose workers are all done."""
    return f"meshtune/{run_id}/done"


class JobChannel:
    """`with JobChannel(settings, mailbox, workers_done, use_store) as channel:` around this node's torchrun.

    `cause`: another node's error that ended the job, once read (the launcher then ends its torchrun);
    `all_done()`: every node's workers are done."""

    def __init__(self, settings: NodeSettings, mailbox: Mailbox, workers_done, use_store: bool):
        self.settings, self.mailbox, self.workers_done, self.use_store = settings, mailbox, workers_done, use_store
        self.cause: str | None = None
        self.severed: dict | None = None  # the workers' report of node 0 lost, once its store did not answer either
        self._next_probe = 0.0
        self._posted = self._done_posted = False
        self._nodes_done = 0
        self._nodes = settings.min_nodes
        self._beats: int | None = None  # the rank's beat count after this launcher's last beat
        self._last_beat = 0.0
        self._warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshtune-job-channel", daemon=True)

    def __enter__(self) -> JobChannel:
        if self.use_store:  # this launcher's store clients (here, doctor/joining.py) outlive node 0's store at times
            quiet_cpp_log()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # at most a connect attempt (5 s) and a post's wait for readers; cut off, a read that never returns
        self._thread.join(timeout=1 if self.severed else 15)

    def cut_off(self) -> bool:
        """This node's workers lost node 0 (their hang report) and its store does not answer a new connection."""
        if self.severed is not None:
            return True
        if self.settings.node_rank == 0 or not self.use_store or time.monotonic() < self._next_probe:
            return False
        lost = self.mailbox.peers_lost()
        if lost is None or 0 not in lost["nodes"]:
            return False
        self._next_probe = time.monotonic() + PROBE_S
        if connect_possible(self.settings):  # node 0's store answers: torchrun's own restart meets it again
            return False
        self.severed = lost
        return True

    def all_done(self) -> bool:
        if self.settings.max_nodes == 1:  # no other agent to wait for in the exit barrier
            return self.workers_done()
        return self._done_posted and self._nodes_done >= self._nodes

    def _run(self) -> None:
        store = None
        # nothing more to learn once the job ended for every node (polling a store about to close only logs noise)
        while not self._stop.wait(POLL_S) and not self.all_done() and self.cause is None:
            if self.use_store and store is None:
                store = connect(self.settings)
            try:
                self._tell_error(store)
                if store is not None:
                    self._exchange(store)
            except Exception:  # noqa: BLE001 - the store went away (node 0 ended): torchrun's end says the rest
                store = None
        self._post_done_on_leaving(store)

    def _post_done_on_leaving(self, store) -> None:
        """The launcher is leaving (its torchrun ended) with its workers done between two polls: post it now, or
        the other nodes' launchers wait AGENT_EXIT_S for this node instead of ending their torchruns at once."""
        if store is None or self._done_posted or self.cause is not None or not self.workers_done():
            return
        try:
            self._post_done(store)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for this node
            pass

    def _post_done(self, store) -> None:
        """Count this node's workers done in the job's store (once)."""
        store.add(done_key(self.settings.run_id), 1)
        self._done_posted = True

    def _tell_error(self, store) -> None:
        """This node's worker reported an error: post it (once) and wait for the others to read it, then let the
        worker go on to stop its agent."""
        message = self.mailbox.first_error()
        if message is None or self._posted:
            return
        self._posted = True
        try:
            if store is not None:
                run_id = self.settings.run_id
                store.set(error_key(run_id), json.dumps({"node": self.settings.node_rank,
                                                         "host": socket.gethostname(),
                                                         "message": message}))
                known = store.add(known_key(run_id), 1)
                deadline = time.monotonic() + READ_WAIT_S
                while known < self._joined(store) and time.monotonic() < deadline:
                    time.sleep(POLL_S / 2)
                    known = store.add(known_key(run_id), 0)
        finally:
            self.mailbox.mark_told()  # the worker waiting in await_told goes on

    def _exchange(self, store) -> None:
        run_id = self.settings.run_id
        workers_done = self._done_posted or self.workers_done()  # the mailbox read once a poll, none once posted
        if not self._posted and self.cause is None and store.check([error_key(run_id)]):
            posted = json.loads(store.get(error_key(run_id)))
            store.add(known_key(run_id), 1)
            self.cause = (f"node {posted['node']} ({posted['host']}) stopped the job, and this node with it: "
                          f"{posted['message']}")
        if self.cause is None and not self.mailbox.any_started() and store.check([refusal_key(run_id)]):
            # a node that cannot join said why, while this node waits for it in the rendezvous; once the workers
            # run, the job goes on without heeding it (the refused launcher has stopped)
            self.cause = store.get(refusal_key(run_id)).decode()
        if self.cause is None and not workers_done:
            self._beat(store)
        if workers_done and not self._done_posted:
            self._post_done(store)
        if self._done_posted:
            self._nodes = self._joined(store)
            self._nodes_done = store.add(done_key(run_id), 0)

    def _beat(self, store) -> None:
        """Count this launcher in under its NODE_RANK; the count grown by more than this launcher's own beat means
        another launcher beats there too."""
        if time.monotonic() - self._last_beat < BEAT_S:
            return
        rank, run_id = self.settings.node_rank, self.settings.run_id
        count = store.add(beat_key(run_id, rank), 1)
        others = self._beats is not None and count > self._beats + 1
        self._beats, self._last_beat = count, time.monotonic()
        if not others:
            return
        host = socket.gethostname()
        if self.mailbox.any_started():  # the job formed with this launcher: the other one is the spare
            if not self._warned:
                self._warned = True
                logger.warning(f"warning: another launcher was given NODE_RANK {rank} of this job while this one's "
                               f"workers run (on {host}); it stops, and the job goes on. Give each node its own "
                               f"NODE_RANK from 0 to NNODES-1")
            return
        said = (f"two launchers were given NODE_RANK {rank} of this job (one on {host}): both count themselves in "
                f"under it in node 0's store. Give each node its own NODE_RANK from 0 to NNODES-1 and launch again")
        store.set(refusal_key(run_id), said)
        self.cause = said

    def _joined(self, store) -> int:
        """The nodes in the job: those whose launcher left its rank in the store (doctor/joining.py)."""
        joined = sum(store.check([join_key(self.settings.run_id, rank)]) for rank in range(self.settings.max_nodes))
        return max(joined, self.settings.min_nodes)


@functools.cache
def quiet_cpp_log() -> None:
    """torch's C++ log at ERROR for the rest of this launcher. Its store client logs every read of a store that has
    gone with a C++ stack trace ("recvValue failed ... Did the remote server shutdown or crash?"), which node 0's
    agent does at the end of every good job. TORCH_CPP_LOG_LEVEL is read only as torch loads; c10 checks the flags
    it sets at each message. A level the user set there, and a torch without those symbols, keep their log."""
    import torch

    if os.environ.get("TORCH_CPP_LOG_LEVEL"):
        return
    for library in sorted((Path(torch.__file__).parent / "lib").glob("libc10.*")):
        try:
            c10 = ctypes.CDLL(str(library))  # the copy torch loaded: dlopen hands back its handle
        except OSError:
            continue
        for flag in ("FLAGS_caffe2_log_level", "FLAGS_minloglevel"):
            try:
                level = ctypes.c_int.in_dll(c10, flag)
            except ValueError:  # a build without the symbol
                continue
            level.value = max(level.value, 2)  # 0 info, 1 warning, 2 error


def await_told(mailbox: Mailbox, timeout_s: float = READ_WAIT_S + 10) -> None:
    """In a worker that reported an error: wait until its launcher has told the other nodes, so that the store on
    MASTER_PORT (which this worker's agent hosts on node 0) is still there to carry it."""
    deadline = time.monotonic() + timeout_s
    while not mailbox.told() and time.monotonic() < deadline:
        time.sleep(0.05)
