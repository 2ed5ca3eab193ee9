"""Fail in seconds, with the reason, instead of hanging at rendezvous: before torchrun starts, node 0 checks that
it can take the rendezvous port and every other node waits (up to rdzv_timeout) until it can reach it."""

from __future__ import annotations

import errno
import logging
import socket
import time

from meshtune.errors import MeshtuneError
from meshtune.doctor.launch_settings import LaunchSettings

logger = logging.getLogger(__name__)

CAUSES = ("likely causes: a firewall or security group blocking the port; a wrong MASTER_ADDR (on a cluster: node 0's "
          "address on the network all nodes share, not 127.0.0.1 or a docker/VPN interface's); a MASTER_PORT that "
          "differs between nodes (every node must use node 0's); node 0 not started or already failed; two nodes "
          "given the same NODE_RANK")


class RendezvousError(MeshtuneError):
    """This node cannot meet the others. `last_error`: the last connection error, when one was met."""

    def __init__(self, message: str, last_error: str | None = None):
        super().__init__(message)
        self.last_error = last_error


def check_port_free(settings: LaunchSettings) -> None:
    """Node 0 will host the c10d store on master_port: say so now if something else holds it."""
    try:
        infos = socket.getaddrinfo(settings.master_addr, settings.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return  # not resolvable yet (a Kubernetes service may appear late): torchrun retries within rdzv_timeout
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RendezvousError(
                    f"node 0: port {settings.master_port} on {settings.master_addr} is already in use (another job, "
                    f"or an earlier run still exiting); pick a free MASTER_PORT and use it on every node") from None
            # not one of this host's addresses: torchrun's c10d decides who hosts; nothing to check here


def reach_node0(settings: LaunchSettings, timeout_s: int, prefix: str = "") -> None:
    """Node 0: its port is free; the other nodes: node 0 answers within `timeout_s` (rdzv_timeout)."""
    if settings.node_rank == 0:
        check_port_free(settings)
    else:
        logger.info(f"{prefix}waiting for node 0 at {settings.master_addr}:{settings.master_port} (up to "
                    f"rdzv_timeout={timeout_s} s)")
        wait_for_master(settings, timeout_s)


def wait_for_master(settings: LaunchSettings, timeout_s: float, poll_s: float = 1.0) -> float:
    """Non-zero nodes: connect to master_addr:master_port until it answers; seconds waited, or RendezvousError."""
    return wait_for_endpoint(settings.master_addr, settings.master_port, timeout_s,
                             f"node {settings.node_rank} could not reach the rendezvous at {settings.master_addr}:"
                             f"{settings.master_port}", CAUSES, poll_s)


def wait_for_endpoint(host: str, port: int, timeout_s: float, failure: str, causes: str, poll_s: float = 1.0) -> float:
    """Connect to host:port until it answers; seconds waited, or RendezvousError: `failure`, the timeout and the
    last error, then `causes`."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    last_error = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(poll_s, 5.0)):
                return time.monotonic() - started
        except OSError as exc:
            last_error = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{failure} within rdzv_timeout={timeout_s:g} s ({last_error}); {causes}",
                                  last_error)
        time.sleep(poll_s)


def rendezvous_failure(settings: LaunchSettings, timeout_s: int, joined: set[int] | None = None) -> RendezvousError:
    """torchrun gave up before any worker of this node started: the nodes never all met. `joined`: the node
    ranks seen in the rendezvous store (joining.py), when it answered."""
    seen = ""
    if joined:
        missing = [rank for rank in range(settings.max_nodes) if rank not in joined]
        seen = (f" (joined: node ranks {', '.join(map(str, sorted(joined)))}; never joined: node ranks "
                f"{', '.join(map(str, missing)) or 'none'})")
    return RendezvousError(
        f"node {settings.node_rank}: the rendezvous at {settings.master_addr}:{settings.master_port} did not complete "
        f"within rdzv_timeout={timeout_s} s: not all of NNODES={settings.nnodes} nodes joined with run id "
        f"{settings.run_id}{seen}. Start the same command on every node with the same MASTER_ADDR, MASTER_PORT and "
        f"config (a run id derived on each node includes the port, so nodes given different ports never meet); "
        f"{CAUSES}")
