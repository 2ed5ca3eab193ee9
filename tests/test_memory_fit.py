"""gradient_checkpointing_ratio auto on two real ranks under FSDP2: the measured steps run the sharded forward and
backward on every rank, and the largest figures of all ranks decide, so every rank recomputes the same blocks."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest

from conftest import base_config
from ranks import run_ranks


def rank_main(job: tuple, rank: int, world_size: int, port: int, out: Path) -> None:
    """One rank of a 2-rank run (zero2, or DDP's wrapper) on a stand-in card: with every block recomputed a step
    peaks at 100 bytes on rank 0 and 120 on rank 1, and one kept block does not move that peak (as in full fine-tuning,
    whose peak comes in backward) but holds 10 more bytes when the forward ends. A budget of 135 leaves rank 1 room for
    one block (rank 0 alone would keep both; the peaks alone would keep every block)."""
    model_dir, dataset, method, parallel = job
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        from meshtune.config import build_config
        from meshtune.model.loading import transformer_blocks
        from meshtune.model.parallel import unwrap
        from meshtune.train import memory_fit
        from meshtune.train.loop import run

        seen: dict = {}

        def stand_in(step, device):  # (peak, bytes held when the forward ended)
            step()  # the real sharded forward and backward, with their collectives
            kept = [b for b in transformer_blocks(unwrap(seen["model"])) if not b.gradient_checkpointing]
            return 100.0 + 20.0 * rank, 40.0 + 5.0 * rank + 10.0 * len(kept)

        fit = memory_fit.fit_recomputation

        def recorded_fit(model, *args):
            seen["model"] = model
            result = fit(model, *args)
            seen["recomputed"] = [i for i, b in enumerate(transformer_blocks(unwrap(model)))
                                  if b.gradient_checkpointing]
            seen["fit"] = [result.kept, result.peak_all, result.per_block]
            return result

        memory_fit.fit_recomputation = recorded_fit
        memory_fit.can_measure = lambda device: True
        import meshtune.plan

        meshtune.plan.memory_measurable = lambda device: True  # a GPU, as the plan sees it
        memory_fit.smallest_gpu_memory = lambda device, limit: 1000.0
        memory_fit.pending_optimizer_bytes = lambda optimizer, params: 0
        memory_fit.measured = stand_in
        memory_fit.allocated = lambda device: 0.0
        cfg = build_config(base_config(Path(model_dir), Path(dataset), Path(out), finetuning_type=method,
                                       parallel=parallel, nproc_per_node=2, gradient_checkpointing=True,
                                       lora_dropout=0.0, memory_budget=0.135, max_steps=2))
        records = run(cfg).records
        Path(out, f"rank{rank}.json").write_text(json.dumps({**{k: seen[k] for k in ("recomputed", "fit")},
                                                              "losses": [r["loss"] for r in records]}))
    except BaseException:
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    os._exit(0)  # as the checkpoint tests: no interpreter teardown with gloo threads alive


@pytest.mark.slow
@pytest.mark.parametrize("method,parallel", [("full", "zero2"), ("lora", "ddp")])
def test_every_rank_recomputes_the_blocks_the_largest_rank_needs(tmp_path, tiny_model_dir, tiny_dataset, method,
                                                                 parallel):
    out = tmp_path / "out"
    out.mkdir()
    run_ranks((str(tiny_model_dir), str(tiny_dataset), method, parallel), 2, out, entry=rank_main)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # room = 135 x 0.97 - 120 = 10.95: one block of 10 kept, the other recomputed, on both ranks
    assert ranks[0]["fit"] == ranks[1]["fit"] == [1, 120.0, 10.0]
    assert ranks[0]["recomputed"] == ranks[1]["recomputed"] == [0]
    assert len(ranks[0]["losses"]) == 2


def test_the_largest_micro_batch_is_found_over_the_steps_left():
    import numpy as np

    from meshtune.data.sampler import GlobalBatchPlan
    from meshtune.train.memory_fit import largest_micro_batch

    lengths = np.array([10, 90, 20, 30, 40, 50, 60, 70])
    plan = GlobalBatchPlan(lengths, seed=3, micro_batch=2, accumulation=1, dp_size=1)
    rows = [plan.rows(0)[i:i + 2] for i in range(0, 8, 2)]  # the 4 steps' micro-batches, in order
    tokens = [sum(int(lengths[s]) for row in pair for s in row) for pair in rows]
    padded = [2 * max(int(lengths[s]) for row in pair for s in row) for pair in rows]
    assert largest_micro_batch(plan, 0, 4, 0, padding_free=True) == rows[tokens.index(max(tokens))]
    assert largest_micro_batch(plan, 0, 4, 0, padding_free=False) == rows[padded.index(max(padded))]
    assert largest_micro_batch(plan, 2, 4, 0, padding_free=True) == rows[2 + tokens[2:].index(max(tokens[2:]))]
    assert largest_micro_batch(plan, 4, 4, 0, padding_free=True) == []  # resumed at the end
