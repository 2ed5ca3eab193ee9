"""The run's parallel layout, one object: the degrees checked against the processes once, the device mesh built
once with named dimensions, and the answers to 'which ranks share my data' by name instead of rank arithmetic.

The mesh's dimensions, outermost first: pp (pipeline stages), dp_replicate (replicas), dp_shard (FSDP2's
shards), cp (context parallel), tp (tensor parallel, innermost: consecutive ranks, inside one node). A pipeline's
processes, one of each stage, are therefore `world_size / pp` ranks apart, and a cp x tp group is consecutive.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class ParallelDims:
    """One process's place in the mesh. The plan makes it from its choices (`of` the degrees it chose, `split_for`
    the data-parallel mode) and keeps its `layout` as the plan's `mesh`; `of(layout, env)` builds it from that."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    env: DistEnv
    _meshes: dict = field(default_factory=dict, compare=False, repr=False)  # the DeviceMesh, built on first use

    def __post_init__(self):
        sizes = dict(zip(NAMES, self.sizes))
        if min(sizes.values()) < 1:
            raise ConfigError(f"the device mesh's degrees must be at least 1: {sizes}")
        product = functools.reduce(int.__mul__, self.sizes)
        if product != self.env.world_size:
            raise ConfigError(f"the device mesh {' x '.join(f'{n} {s}' for n, s in sizes.items())} holds {product} "
                              f"processes, the job {self.env.world_size}")
        if self.tp > 1 and self.env.local_world_size % self.tp:
            raise ConfigError(f"tensor_parallel: {self.tp} does not divide the {self.env.local_world_size} "
                              f"processes of a node (a tensor-parallel group stays inside a node)")

    @classmethod
    def of(cls, layout: dict[str, int], env: DistEnv) -> ParallelDims:
        """From the run plan's `mesh` (names to degrees; pp absent for 1). Without data-parallel degrees (a plan
        built by hand, or the plan before it chose the data-parallel mode) the processes left over are replicas."""
        pp, cp, tp = (layout.get(name, 1) for name in ("pp", "cp", "tp"))
        if "dp_replicate" in layout or "dp_shard" in layout:
            replicate, shard = layout.get("dp_replicate", 1), layout.get("dp_shard", 1)
        else:
            replicate, shard = max(env.world_size // (pp * cp * tp), 1), 1
        return cls(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, env=env)

    def split_for(self, parallel: str, hsdp_shard: int | None) -> ParallelDims:
        """These degrees with the data-parallel processes (`reducing`) split as `parallel` runs them: ddp's all
        replicas, hsdp's replicas of `hsdp_shard` processes, zero2's and zero3's one shard of them all. A cp group
        lies inside a shard (sharded modes) or among the replicas (ddp)."""
        procs = self.reducing
        shard = {"ddp": 1, "hsdp": hsdp_shard or 1}.get(parallel, procs)
        replicate, shard = (procs // self.cp, 1) if shard % self.cp else (procs // shard, shard // self.cp)
        return ParallelDims(pp=self.pp, dp_replicate=replicate, dp_shard=shard, cp=self.cp, tp=self.tp, env=self.env)

    @property
    def layout(self) -> dict[str, int]:
        """The degrees as the run plan's `mesh` keeps them (`of`'s argument): names to degrees, outermost first, pp
        only where there is a pipeline."""
        return ({"pp": self.pp} if self.pp > 1 else {}) | dict(zip(NAMES[1:], self.sizes[1:]))

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp

    # -- where a rank lies ---------------------------------------------------------------------------------------

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """`rank`'s (this process's by default) index along each dimension."""
        rank = self.env.rank if rank is None else rank
        place = {}
        for name, size in reversed(list(zip(NAMES, self.sizes))):
            rank, place[name] = divmod(rank, size)
        return {name: place[name] for name in NAMES}

    def rank_at(self, **coordinates: int) -> int:
        """The global rank at these coordinates (the others 0)."""
        rank = 0
        for name, size in zip(NAMES, self.sizes):
            rank = rank * size + coordinates.get(name, 0)
        return rank

    def ranks_along(self, *names: str, rank: int | None = None) -> list[int]:
        """The ranks that differ from `rank` only along `names`: its group in those dimensions, in rank order."""
        place = self.coordinates(rank)
        groups = [[]]
        for name, size in zip(NAMES, self.sizes):
            span = range(size) if name in names else [place[name]]
            groups = [g + [(name, i)] for g in groups for i in span]
        return sorted(self.rank_at(**dict(g)) for g in groups)

    # -- the data ------------------------------------------------------------------------------------------------

    @property
    def per_stage(self) -> int:
        """The processes of one pipeline stage."""
        return self.env.world_size // self.pp

    @property
    def model_parallel(self) -> int:
        """The processes that take the same micro-batches inside a stage: a cp x tp group."""
        return self.cp * self.tp

    @property
    def data_size(self) -> int:
        """The data's ranks: dp_replicate x dp_shard, each taking its own micro-batches."""
        return self.dp_replicate * self.dp_shard

    def data_rank_of(self, rank: int) -> int:
        """The data rank whose micro-batches `rank` takes: its place along dp_replicate x dp_shard."""
        place = self.coordinates(rank)
        return place["dp_replicate"] * self.dp_shard + place["dp_shard"]

    @property
    def data_rank(self) -> int:
        return self.data_rank_of(self.env.rank)

    def data_peers(self, rank: int | None = None) -> list[int]:
        """The ranks that take the same micro-batches as `rank`: its stages' and its cp x tp group's."""
        return self.ranks_along("pp", "cp", "tp", rank=rank)

    @property
    def counts_batch(self) -> bool:
        """Whether this rank counts its micro-batches (targets, tokens, FLOPs): the first of its data peers."""
        return self.env.rank == self.data_peers()[0]

    @property
    def owns_loss(self) -> bool:
        """Whether this rank's loss enters the step's sum: a cp process holds the loss of its share of the
        positions, a tensor-parallel peer a copy of its group's."""
        return self.coordinates()["tp"] == 0

    @property
    def reducing(self) -> int:
        """The processes the data-parallel wrapper averages gradients over in a stage: the data's ranks x cp (each
        cp process's loss is a partial sum of its rows')."""
        return self.data_size * self.cp

    def stage_ranks(self, rank: int | None = None) -> list[int]:
        """The processes of `rank`'s pipeline stage (every process without a pipeline)."""
        return self.ranks_along("dp_replicate", "dp_shard", "cp", "tp", rank=rank)

    def pipeline_ranks(self, rank: int | None = None) -> list[int]:
        """`rank`'s pipeline: one process of each stage, `per_stage` ranks apart."""
        return self.ranks_along("pp", rank=rank)

    def reducing_env(self) -> DistEnv:
        """The process as the data-parallel wrapper sees it: its place among the `reducing` processes it averages
        gradients over (and FSDP2 shards over), a stage's, a tensor-parallel group as one, with the node's share of
        them."""
        return self.share_of_stage(self.data_rank * self.cp + self.coordinates()["cp"], self.reducing, self.tp)

    def data_env(self) -> DistEnv:
        """The process as the data sees it: the data rank among `data_size`, with the node's share of them (a
        stage's processes within the node, a cp x tp group as one)."""
        return self.share_of_stage(self.data_rank, self.data_size, self.model_parallel)

    def share_of_stage(self, rank: int, world_size: int, group: int) -> DistEnv:
        """The process as `rank` of `world_size`, each `group` consecutive processes of its stage one of them: the
        stages are outermost, so the node's share is its processes of this stage (all of them without a pipeline),
        `group` at a time. A stage that fills part of a node (12 processes, 4 a node, pp 2: 4 of stage 0 on node 0,
        2 on node 1) has no one count a node: the share is the greatest common divisor of a stage's and a node's
        processes, the largest groups of one count that never cross a node."""
        env, per_stage = self.env, self.per_stage
        if self.pp == 1 and group == 1:  # every process one of them: the process's own view
            return env
        share = math.gcd(env.local_world_size, per_stage)  # min of the two where one divides the other
        return replace(env, rank=rank, world_size=world_size, local_rank=env.local_rank % share // group,
                       local_world_size=max(share // group, 1))

    # -- the device mesh -----------------------------------------------------------------------------------------

    @property
    def mesh(self) -> DeviceMesh:
        """The whole device mesh, built on first use (a collective of every process: all ask in the same order),
        with every dimension named, also those of size 1, and the flattened `dp` (dp_replicate x dp_shard)."""
        if "world" not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.env.device.type, self.sizes, mesh_dim_names=NAMES)
            # kept as torch asks: a flattened dimension is no longer sliced from the root
            self._meshes["dp"] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
            self._meshes["world"] = mesh
        return self._meshes["world"]

    def sub_mesh(self, *names: str) -> DeviceMesh:
        """The mesh of this process's group along `names` (one name, or several in mesh order), or "dp", the data's
        ranks flattened into one dimension."""
        mesh = self.mesh  # built on first use, "dp" with it
        if names == ("dp",):
            return self._meshes["dp"]
        return mesh[names[0] if len(names) == 1 else names]

    def pipeline_mesh(self) -> DeviceMesh:
        """(pp, dp): the stages, and a stage's processes as one data-parallel dimension (a pipeline's stages are
        data-parallel only: dp_replicate x dp_shard, cp and tp 1). Built on first use, in place of the whole mesh
        (a collective of every process)."""
        if "pipeline" not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes["pipeline"] = init_device_mesh(self.env.device.type, (self.pp, self.per_stage),
                                                        mesh_dim_names=("pp", "dp"))
        return self._meshes["pipeline"]

    def fsdp_dims(self, parallel: str) -> tuple[tuple[str, ...], ...]:
        """FSDP2's mesh dimensions, outermost first, each as the run's dimensions it spans: hsdp's replicas, then the
        shards. A cp group's processes shard together (each holds partial gradients of its share of the positions),
        as torchtitan's dp_shard_cp."""
        shards = ("dp_shard", "cp")
        return (("dp_replicate",), shards) if parallel == "hsdp" else (shards,)

    def fsdp_mesh(self, parallel: str) -> DeviceMesh:
        """The processes FSDP2 shards over (`fsdp_dims`): replicas of shards for hsdp (2-D), the shards otherwise.
        Under cp, flattened once (a collective of every process) and kept, as torch asks of a flattened mesh."""
        hsdp = parallel == "hsdp"
        if self.cp == 1:
            return self.sub_mesh("dp_replicate", "dp_shard") if hsdp else self.sub_mesh("dp_shard")
        key = "hsdp" if hsdp else "shards"
        if key not in self._meshes:
            if hsdp:  # the replicas' and the shards' processes in one dimension, cut into (replicas, dp_shard x cp)
                flat = self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
                self._meshes[key] = flat._unflatten(0, (self.dp_replicate, self.dp_shard * self.cp),
                                                    ("dp_replicate", "dp_shard_cp"))
            else:
                self._meshes[key] = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return self._meshes[key]
