"""Who has joined, said while waiting: torchrun's rendezvous prints nothing until every node is there, so a
node that never comes is a silent wait of rdzv_timeout. Each launcher leaves its NODE_RANK in the rendezvous's
own store (torch's TCPStore on MASTER_ADDR:MASTER_PORT, hosted by node 0's agent: no other port to open) and,
until its workers start, prints every JOIN_REPORT_S which node ranks are there and which are missing."""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

from meshtune.doctor.launch_settings import LaunchSettings
from meshtune.mailbox import Mailbox

JOIN_REPORT_S = 15

logger = logging.getLogger(__name__)


def join_key(run_id: str, node_rank: int) -> str:
    """The key a launcher in torchrun's rendezvous leaves in the store on MASTER_PORT."""
    return f"meshtune/{run_id}/node/{node_rank}"


def refusal_key(run_id: str) -> str:
    """Where a node that cannot join leaves node 0 the reason, in the store on MASTER_PORT (node 0's doctor or
    rendezvous store): a second launcher given NODE_RANK 0, a node given another MASTER_PORT. Node 0 stops with
    it instead of waiting rdzv_timeout for a node that will not come."""
    return f"meshtune/{run_id}/refused"


def beat_key(run_id: str, node_rank: int) -> str:
    """A counter each launcher of a NODE_RANK adds to while its torchrun runs (launch/job_channel.py): beats
    that are not its own mean two launchers were given the rank."""
    return f"meshtune/{run_id}/node/{node_rank}/beats"


STORE_CONNECT_BOUND_S = 60  # longer than any connect attempt of the watcher's store client (a 5 s timeout, retried)


class JoinWatch:
    """`with JoinWatch(settings, mailbox, rdzv_timeout) as watch:` around this node's torchrun; `watch.joined`
    is the node ranks seen so far (for the error when the rendezvous times out)."""

    def __init__(self, settings: LaunchSettings, mailbox: Mailbox, rdzv_timeout: float,
                 interval_s: float = JOIN_REPORT_S):
        self.settings, self.mailbox, self.rdzv_timeout = settings, mailbox, rdzv_timeout
        self.interval_s = interval_s
        self.joined: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> JoinWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        # until the thread has ended: one inside TCPStore's connect (tries and backoff, about 15 s at most) when
        # Python exits would abort the process ("terminate called without an active exception")
        self._thread.join(timeout=STORE_CONNECT_BOUND_S)

    def missing(self) -> list[int]:
        return [rank for rank in range(self.settings.max_nodes) if rank not in self.joined]

    def _started(self) -> bool:
        return self.mailbox.any_started()

    def _watch(self) -> None:
        started = reported = time.monotonic()
        store = None
        while not self._done.wait(1.0) and not self._started():
            store = store or self._connect()
            if store is not None:
                try:
                    self.joined = {rank for rank in range(self.settings.max_nodes)
                                   if store.check([join_key(self.settings.run_id, rank)])}
                except Exception:  # the store went away (node 0 stopped): torchrun reports that
                    store = None
            if time.monotonic() - reported >= self.interval_s and not self._started():
                reported = time.monotonic()
                logger.info(self.describe(reported - started))

    def _connect(self):
        """A client of the rendezvous store, with this node's rank left in it; None while it does not answer."""
        store = connect(self.settings)
        try:
            if store is not None:
                store.set(join_key(self.settings.run_id, self.settings.node_rank), socket.gethostname())
            return store
        except Exception:  # gone again
            return None

    def describe(self, waited_s: float) -> str:
        if not self.joined:
            return (f"rendezvous: no answer yet from the store at {self.settings.master_addr}:"
                    f"{self.settings.master_port} ({waited_s:.0f} s of rdzv_timeout={self.rdzv_timeout:g} s)")
        joined = ", ".join(str(rank) for rank in sorted(self.joined)) or "none"
        missing = ", ".join(str(rank) for rank in self.missing()) or "none"
        need = (f"at least {self.settings.min_nodes} of {self.settings.max_nodes}"
                if self.settings.min_nodes != self.settings.max_nodes else str(self.settings.max_nodes))
        return (f"rendezvous: {len(self.joined)} of {need} nodes joined (node ranks {joined}); waiting for node "
                f"ranks {missing} ({waited_s:.0f} s of rdzv_timeout={self.rdzv_timeout:g} s)")


def connect_possible(settings: LaunchSettings) -> bool:
    """node 0's MASTER_PORT accepts a connection."""
    try:
        socket.create_connection((settings.master_addr, settings.master_port), timeout=2).close()
        return True
    except OSError:
        return False


def connect(settings: LaunchSettings):
    """A client of the rendezvous store, or None while it does not answer. A plain connect first: TCPStore's own
    failing connect logs a C++ traceback on every try."""
    import torch.distributed as dist

    if not connect_possible(settings):
        return None
    try:
        return dist.TCPStore(settings.master_addr, settings.master_port, is_master=False,
                             timeout=timedelta(seconds=5), wait_for_workers=False)
    except Exception:  # noqa: BLE001 - gone between the two connects
        return None
