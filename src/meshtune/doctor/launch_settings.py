"""What the doctor reads of this node's launch settings. The launcher's `NodeSettings` (launch/nodes.py) has this
shape; the doctor names the shape, not the class, because the launcher imports the doctor (its preflight)."""

from __future__ import annotations

from typing import Protocol


class LaunchSettings(Protocol):
    @property
    def nnodes(self) -> str: ...  # "N", or "MIN:MAX" for an elastic job

    @property
    def node_rank(self) -> int: ...

    @property
    def master_addr(self) -> str: ...

    @property
    def master_port(self) -> int | None: ...

    @property
    def nproc_per_node(self) -> int: ...

    @property
    def run_id(self) -> str: ...

    @property
    def min_nodes(self) -> int: ...

    @property
    def max_nodes(self) -> int: ...
