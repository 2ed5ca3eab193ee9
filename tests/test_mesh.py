"""The run's mesh as one object (meshtune/mesh.py): the ranks that share a process's data, who counts the batch and
owns the loss, the groups of each dimension, for the layouts the run plan makes; the data's view the plan gives
the loop; the degrees refused where they do not fill the job. No process group: rank arithmetic only."""

from __future__ import annotations

from unittest import mock

import pytest

from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.errors import ConfigError
from meshtune.mesh import ParallelDims
from meshtune.plan import machine_of
from meshtune.plan.layout import resolve_mesh
from plans import QWEN_7B, env, plan_for


def dims_of(plan, world_size: int, local: int | None = None) -> list[ParallelDims]:
    return [plan.dims(env(world_size, local, rank)) for rank in range(world_size)]


def answers(all_dims: list[ParallelDims]) -> dict[str, list]:
    return {"data": [d.data_rank for d in all_dims], "counts": [d.counts_batch for d in all_dims],
            "loss": [d.owns_loss for d in all_dims], "peers": [d.data_peers() for d in all_dims],
            "stage": [d.stage_ranks() for d in all_dims]}


def test_pipeline_peers_are_a_stage_apart_and_the_first_stage_counts_the_batch():
    """pp 2 x dp 2 on 2 nodes of 2: ranks 0 and 2, 1 and 3 are one pipeline and take the same micro-batches."""
    plan = plan_for({"pipeline_parallel": 2, "finetuning_type": "full", "gradient_accumulation_steps": 4}, 4, 2)
    all_dims = dims_of(plan, 4, 2)
    got = answers(all_dims)
    assert got["data"] == [0, 1, 0, 1] and got["counts"] == [True, True, False, False]
    assert got["loss"] == [True] * 4
    assert got["peers"] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert got["stage"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [d.pipeline_ranks() for d in all_dims] == got["peers"]
    assert {(d.data_size, d.reducing, d.per_stage) for d in all_dims} == {(2, 2, 2)}
    assert [d.coordinates()["pp"] for d in all_dims] == [0, 0, 1, 1]


def test_a_tensor_parallel_group_is_consecutive_ranks_of_one_data_rank_and_one_loss():
    plan = plan_for({"tensor_parallel": 2, "finetuning_type": "full", "parallel": "zero3"}, 4)
    got = answers(dims_of(plan, 4))
    assert got["data"] == [0, 0, 1, 1] and got["counts"] == [True, False, True, False]
    assert got["loss"] == [True, False, True, False]  # a tp peer's loss is a copy
    assert got["peers"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert got["stage"] == [[0, 1, 2, 3]] * 4
    dims = plan.dims(env(4, rank=3))
    assert (dims.data_size, dims.reducing) == (2, 2)
    assert dims.ranks_along("tp") == [2, 3] and dims.ranks_along("dp_shard") == [1, 3]


def test_a_cp_group_takes_one_data_rank_and_each_process_owns_its_share_of_the_loss():
    layout = {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}  # zero3's over 4 (tests/test_context_parallel.py)
    got = answers([ParallelDims.of(layout, env(4, rank=rank)) for rank in range(4)])
    assert got["data"] == [0, 0, 1, 1] and got["counts"] == [True, False, True, False]
    assert got["loss"] == [True] * 4
    assert got["peers"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    dims = ParallelDims.of(layout, env(4, rank=2))
    assert (dims.data_size, dims.reducing) == (2, 4)  # gradients averaged over data ranks x cp
    assert dims.ranks_along("cp") == [2, 3] and dims.ranks_along("dp_replicate", "dp_shard", "cp") == [0, 1, 2, 3]


def test_hsdp_replicas_of_shards_are_each_their_own_data_rank():
    """2 nodes of 2: a node's processes shard, the nodes replicate; every process takes its own micro-batches."""
    plan = plan_for({"finetuning_type": "full", "parallel": "hsdp"}, 4, 2)
    assert plan.mesh == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}
    all_dims = dims_of(plan, 4, 2)
    got = answers(all_dims)
    assert got["data"] == [0, 1, 2, 3] and got["counts"] == [True] * 4 and got["loss"] == [True] * 4
    assert got["peers"] == [[0], [1], [2], [3]]
    assert [d.ranks_along("dp_shard") for d in all_dims] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [d.ranks_along("dp_replicate") for d in all_dims] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(d.data_env() == d.env for d in all_dims)  # the data's view is the process's own


def test_the_data_view_matches_the_ranks_the_data_is_dealt_to():
    """The loop's `data_env` is the object's: data rank, data size and the node's share of the data ranks."""
    plan = plan_for({"pipeline_parallel": 2, "finetuning_type": "full", "gradient_accumulation_steps": 4}, 8, 4)
    for rank in range(8):
        dims = plan.dims(env(8, 4, rank))
        data = plan.data_env(env(8, 4, rank))
        assert (data.rank, data.world_size, data.local_world_size) == (dims.data_rank, 4, 4)


def test_a_stage_that_spans_part_of_a_node_counts_only_its_processes_there():
    """12 processes, 4 a node, pp 2: stage 0 is node 0 and half of node 1, stage 1 the other half and node 2. A
    stage's processes on a node come in the same count on every node only as the greatest common divisor of a
    stage's and a node's (2): groups of that many never cross a node, whatever the stage."""
    plan = plan_for({"pipeline_parallel": 2, "finetuning_type": "full", "parallel": "ddp",
                     "gradient_accumulation_steps": 2}, 12, 4)
    views = [plan.dims(env(12, 4, rank)).data_env() for rank in range(12)]
    assert [v.local_world_size for v in views] == [2] * 12
    assert [v.local_rank for v in views] == [0, 1] * 6
    for rank, view in enumerate(views):  # a group of local_world_size consecutive ranks lies inside one node
        first = rank - view.local_rank
        assert first // 4 == (first + view.local_world_size - 1) // 4
    aligned = plan_for({"pipeline_parallel": 2, "finetuning_type": "full", "parallel": "ddp",
                        "gradient_accumulation_steps": 2}, 16, 4)
    assert {aligned.dims(env(16, 4, rank)).data_env().local_world_size for rank in range(16)} == {4}


@pytest.mark.parametrize("layout, world, local, message", [
    ({"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}, 8, 8, "holds 4 processes, the job 8"),
    ({"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 4}, 8, 2, "tensor_parallel: 4 does not divide the 2"),
    ({"dp_replicate": 0, "dp_shard": 2, "cp": 1, "tp": 1}, 2, 2, "at least 1"),
])
def test_degrees_that_do_not_fill_the_job_are_refused(layout, world, local, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims.of(layout, env(world, local))


FULL, LORA = {"finetuning_type": "full"}, {"finetuning_type": "lora"}
VIEW_LAYOUTS = [  # (config, processes, a node's, device): cp needs a CUDA job described to the plan
    (LORA, 1, 1, "cpu"),
    (LORA | {"parallel": "ddp"}, 4, 2, "cpu"),
    (FULL | {"parallel": "zero3", "tensor_parallel": 2}, 4, 4, "cpu"),
    (LORA | {"parallel": "ddp", "tensor_parallel": 2}, 8, 4, "cpu"),  # FSDP2 over whole replicas
    (FULL | {"parallel": "hsdp"}, 8, 4, "cpu"),
    (FULL | {"parallel": "hsdp", "tensor_parallel": 2}, 16, 8, "cpu"),
    (FULL | {"parallel": "zero2", "pipeline_parallel": 2, "gradient_accumulation_steps": 4}, 4, 2, "cpu"),
    (FULL | {"parallel": "zero2", "pipeline_parallel": 4, "gradient_accumulation_steps": 4}, 8, 4, "cpu"),  # 2 a node
    (FULL | {"parallel": "ddp", "pipeline_parallel": 2, "gradient_accumulation_steps": 2}, 8, 2, "cpu"),  # 2 nodes
    (FULL | {"parallel": "zero3", "context_parallel": 2, "bf16": False}, 8, 4, "cuda"),
    (FULL | {"parallel": "hsdp", "context_parallel": 2, "bf16": False}, 8, 4, "cuda"),
    (LORA | {"parallel": "ddp", "context_parallel": 2, "bf16": False}, 4, 4, "cuda"),
]


@pytest.mark.parametrize("values, world, local, device", VIEW_LAYOUTS)
def test_the_plans_views_of_the_processes_are_the_meshs_groups(values, world, local, device):
    """The processes the plan sizes the data-parallel wrapper by (`procs`: a stage's, a tp group as one) and the
    data's ranks (`dp`), for every rank: each the place and the size of this rank's group as the ranks the mesh names
    make it up, and the node's share of that group."""
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **values})
    for rank in range(world):
        process = env(world, local, rank, device)
        with mock.patch("meshtune.plan.smallest_gpu_memory", return_value=80 * 2**30):
            layout = resolve_mesh(cfg, process, machine_of(cfg, process, lambda: QWEN_7B), {})
        dims = ParallelDims.of(layout.mesh, process)  # the loop's, from the plan's mesh
        assert layout.dims == dims

        def on_node(ranks: list[int]) -> list[int]:
            return [r for r in ranks if r // local == rank // local]

        reducing = dims.ranks_along("dp_replicate", "dp_shard", "cp")  # this rank's place in its tp group fixed
        stage = dims.stage_ranks()
        assert layout.procs == DistEnv(reducing.index(rank), len(reducing), on_node(reducing).index(rank),
                                       len(on_node(reducing)), process.device), rank
        assert len(stage) == layout.procs.world_size * dims.tp and set(reducing) <= set(stage)
        data_ranks = sorted({dims.data_rank_of(r) for r in on_node(stage)})
        assert layout.dp == DistEnv(dims.data_rank, dims.data_size, data_ranks.index(dims.data_rank), len(data_ranks),
                                    process.device), rank
        assert layout.dp == dims.data_env() and layout.procs.world_size == dims.reducing


def test_a_plan_without_data_degrees_makes_the_rest_replicas():
    dims = ParallelDims.of({"tp": 2}, env(8, rank=5))
    assert (dims.dp_replicate, dims.dp_shard, dims.data_rank) == (4, 1, 2)
    assert ParallelDims.of({}, env(1)).sizes == (1, 1, 1, 1, 1)


def old_fsdp_groups(parallel: str, world: int, shard: int, rank: int) -> list[list[int]]:
    """The groups of the mesh FSDP2 sharded over when it was built on its own: one dimension of every rank, or hsdp's
    (replicate, shard), `shard` consecutive ranks a replica."""
    if parallel != "hsdp":
        return [list(range(world))]
    first = rank // shard * shard
    return [list(range(rank % shard, world, shard)), list(range(first, first + shard))]


def old_cp_group(cp: int, rank: int) -> list[int]:
    """The cp group of the (dp, cp) mesh context parallel built on its own: `cp` consecutive ranks."""
    first = rank // cp * cp
    return list(range(first, first + cp))


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_the_fsdp_and_cp_groups_are_those_the_meshes_built_on_their_own_had(world):
    """For every mode, hsdp shard size and cp degree the plan lays out on `world` processes, each rank's FSDP2 and cp
    groups are the ones the separate meshes gave it: a checkpoint and a bit-exact resume see the same shards."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    modes = [("zero2", world), ("zero3", world), ("ddp", 1)] + [("hsdp", shard) for shard in divisors]
    for parallel, shard in modes:
        for cp in [d for d in divisors if (world if parallel == "ddp" else shard) % d == 0]:
            for rank in range(world):
                dims = ParallelDims.of({"cp": cp}, env(world, rank=rank)).split_for(parallel, shard)
                assert dims.ranks_along("cp") == old_cp_group(cp, rank), (parallel, shard, cp, rank)
                if parallel != "ddp":
                    groups = [dims.ranks_along(*names) for names in dims.fsdp_dims(parallel)]
                    assert groups == old_fsdp_groups(parallel, world, shard, rank), (parallel, shard, cp, rank)


LAYOUTS = [{"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1},
           {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1},
           {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2},
           {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 1}]


def mesh_job(rank: int, world_size: int, workdir) -> None:
    """Each layout's DeviceMesh on the gloo ranks: every named group holds the ranks the arithmetic names, and an
    all-reduce over the flattened dp group sums the data ranks' values only; FSDP2's meshes (cp flattened into the
    shards) hold the groups `fsdp_dims` names."""
    import torch
    import torch.distributed as dist

    for layout in LAYOUTS:
        dims = ParallelDims.of(layout, env(world_size, rank=rank))
        for names in (("pp",), ("dp_replicate",), ("dp_shard",), ("cp",), ("tp",)):
            assert sorted(dims.sub_mesh(*names).mesh.flatten().tolist()) == dims.ranks_along(*names), (layout, names)
        dp = dims.sub_mesh("dp")
        assert sorted(dp.mesh.flatten().tolist()) == dims.ranks_along("dp_replicate", "dp_shard")
        for parallel in ("zero3", "hsdp"):
            fsdp = dims.fsdp_mesh(parallel)
            groups = [sorted(dist.get_process_group_ranks(fsdp.get_group(i))) for i in range(fsdp.ndim)]
            assert groups == [dims.ranks_along(*names) for names in dims.fsdp_dims(parallel)], (layout, parallel)
            assert dims.cp == 1 or dims.fsdp_mesh(parallel) is fsdp  # flattened once: the reference shards on it too
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=dp.get_group())
        assert total.item() == sum(dims.ranks_along("dp_replicate", "dp_shard")), layout
        assert dims.mesh is dims.mesh  # built once
        if dims.cp > 1:
            split_takes_its_chunks(dims)
        if dims.pp > 1:
            pipeline = dims.pipeline_mesh()
            assert pipeline.mesh_dim_names == ("pp", "dp") and pipeline.get_local_rank("pp") == dims.coordinates()["pp"]
            assert sorted(pipeline["pp"].mesh.tolist()) == dims.pipeline_ranks()
            assert sorted(pipeline["dp"].mesh.tolist()) == dims.stage_ranks()


def split_takes_its_chunks(dims: ParallelDims) -> None:
    """Context parallel's split (train/sequence_split.py) over the run's cp group, on CPU: process c of the group keeps
    chunks c and 2cp-1-c of each row's 2 x cp (torch's load balancing). The ring's attention itself needs CUDA
    (tests/test_context_parallel.py); the split of the buffers does not."""
    import numpy as np
    import torch

    from meshtune.data.collate import collate
    from meshtune.train.sequence_split import SequenceSplit, row_multiple

    rows = [(np.arange(3, 3 + n), np.arange(3, 3 + n)) for n in (100, 60)]
    batch = collate([[0], [1]], dataset=rows, pad_id=0, packed=False, pad_to_multiple=row_multiple(dims.cp, 1),
                    padding_free=False)
    chunk, c = batch.input_ids.shape[1] // (2 * dims.cp), dims.coordinates()["cp"]
    kept = torch.cat([torch.arange(c * chunk, (c + 1) * chunk),
                      torch.arange((2 * dims.cp - 1 - c) * chunk, (2 * dims.cp - c) * chunk)])
    with SequenceSplit(dims)(batch) as local:
        assert torch.equal(local.input_ids, batch.input_ids[:, kept]), (dims.env.rank, local.input_ids)
        assert torch.equal(local.targets, batch.targets[:, kept])


@pytest.mark.slow
def test_the_device_mesh_groups_are_the_ranks_the_object_names(tmp_path):
    from ranks import run_ranks

    run_ranks(mesh_job, 4, tmp_path)
