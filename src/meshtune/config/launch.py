"""Nodes and launch: the processes, the nodes, the rendezvous and its timeouts (each node may set these for itself;
the launcher checks them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from meshtune.config.section import JOB, NODE, Keys, Section

LAUNCH = Section("nodes and launch (each node may set these for itself; the launcher checks them)", NODE)


class LaunchKeys(Keys):
    nproc_per_node: int | None = LAUNCH(None, "processes on this machine; default: env NPROC_PER_NODE, else visible "
                                              "GPUs (1 on CPU)", gt=0)
    nnodes: str | None = LAUNCH(None, "nodes in the job, or an elastic range MIN:MAX; default: env NNODES / the "
                                      "scheduler, else 1")
    node_rank: int | None = LAUNCH(None, "this node's rank (0 = the node at master_addr); default: env NODE_RANK / the "
                                         "scheduler", ge=0)
    master_addr: str | None = LAUNCH(None, "address of node 0, the rendezvous host; default: env MASTER_ADDR / the "
                                           "scheduler, else 127.0.0.1")
    master_port: int | None = LAUNCH(None, "rendezvous port on master_addr; required for several nodes (the same free "
                                           "port on every node)", gt=0, lt=65536)
    local_addr: str | None = LAUNCH(None, "the address other nodes reach this node at (torchrun --local-addr); "
                                          "default: hostname lookup. Set it when the hostname resolves to the "
                                          "wrong network")
    max_restarts: int = LAUNCH(3, "times torchrun restarts all workers after a failure (they resume from the newest "
                                  "checkpoint)", ge=0)
    rdzv_backend: Literal["c10d", "etcd-v2"] = LAUNCH(
        "c10d", "c10d: node 0's launcher hosts the rendezvous store on MASTER_ADDR:MASTER_PORT, nothing else to run; "
                "when node 0 dies the other nodes wait for it to be relaunched and rejoin | etcd-v2: an etcd server at "
                "rdzv_endpoint holds the rendezvous (v2 API: start etcd with --enable-v2), so it outlives any node; "
                "needs python-etcd (pip install 'meshtune[etcd]')")
    rdzv_endpoint: str | None = LAUNCH(None, "rdzv_backend etcd-v2: the etcd server as host:port, the same on every "
                                             "node (MASTER_ADDR and MASTER_PORT are then not needed)")
    rdzv_timeout: int = LAUNCH(300, "seconds to wait for all nodes to join before failing with a diagnosis", gt=0)
    preflight: bool | Literal["bandwidth"] = LAUNCH(
        True, "on several nodes, the launcher's first step: the checks of `meshtune doctor` (node ranks, launch "
              "settings, config, versions, model and data checksums, shared output_dir, clocks, network interface) "
              "across the nodes, waiting up to rdzv_timeout for them; one line when all pass, the table when one needs "
              "a look, and no torchrun when one fails | bandwidth: the same, plus the bandwidth test between the nodes "
              "and its verdict for this config (about 10-60 s more) | false: none. Skipped by a node 0 relaunched into "
              "its running job and by a node joining one. Set it alike on every node", scope=JOB)
    ddp_timeout: int = LAUNCH(600, "seconds a collective may wait before the job fails", gt=0)
    gpu_memory_limit: float | None = LAUNCH(None, "GiB each process may allocate on its GPU "
                                                  "(torch.cuda.set_per_process_memory_fraction): beyond it an "
                                                  "allocation fails as out of memory, as on a smaller card. Rehearse a "
                                                  "run meant for 24 GB GPUs (gpu_memory_limit: 24) on larger ones, or "
                                                  "leave room on a shared card; parallel: auto plans for it. "
                                                  "Ignored on CPU", gt=0)

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_text(cls, value: Any) -> Any:
        """`nnodes: 2` and `nnodes: 1:4` (elastic) both arrive as text."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("preflight", mode="before")
    @classmethod
    def _preflight(cls, value: Any) -> Any:
        """One message for a wrong value, not one per member of `bool | "bandwidth"`."""
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "bandwidth"):
            return {"true": True, "false": False}.get(value.strip().lower(), "bandwidth")
        if isinstance(value, bool) or value == "bandwidth":
            return value
        raise ValueError("must be true, false or bandwidth")
