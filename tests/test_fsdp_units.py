"""fsdp_blocks_per_unit: consecutive transformer blocks sharded as one FSDP2 unit. Two real gloo ranks: the grouped
model gathers each unit's parameters in one collective, and one training step gives the weights of one unit per
block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtune.demo.model import build_tiny_model
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.distributed import DistEnv
from meshtune.model.loading import load_model, model_size
from meshtune.model.parallel import edge_units, finish_gradient_sync, fsdp_units, gradient_sync, wrap_model
from meshtune.plan import EACH, ONCE, default_blocks_per_unit
from ranks import run_ranks
from test_rank0_weights import one_step


@pytest.fixture(scope="module")
def five_block_model(tmp_path_factory) -> Path:
    """Five blocks: with two blocks a unit, the last unit holds one."""
    tokenizer = train_tokenizer(["a few words to train a tokenizer on"] * 20, vocab_size=300)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("five"), seed=5, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=5)


@contextmanager
def counted_all_gathers() -> Iterator[list[int]]:
    """A list that gains one entry for each all-gather FSDP2 calls while the block runs."""
    name = next(n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(torch.distributed, n))
    original, gathers = getattr(torch.distributed, name), []  # what FSDP2 calls: all_gather_single from torch 2.12 on
    setattr(torch.distributed, name, lambda *a, **k: gathers.append(1) or original(*a, **k))
    try:
        yield gathers
    finally:
        setattr(torch.distributed, name, original)


def units_job(rank: int, world_size: int, workdir: Path) -> None:
    task = json.loads((workdir / "task.json").read_text())
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"))
    blocks_per_unit = task["blocks_per_unit"] or default_blocks_per_unit(model_size(task["model"]).block_parameters)
    model = wrap_model(load_model(task["model"]), task["parallel"], env, bf16=False, blocks_per_unit=blocks_per_unit,
                       prefetch=task["prefetch"])
    with counted_all_gathers() as gathers, torch.no_grad():  # one per unit (and one for the root) in a forward
        model(input_ids=torch.arange(12).reshape(1, 12) + 3)
    # the FSDP state each block belongs to: blocks of one unit share it
    states = [id(block._get_fsdp_state()) for block in model.model.layers]  # private: no public accessor
    edges = [id(module._get_fsdp_state()) for module in (model.get_input_embeddings(), model.get_output_embeddings())]
    one_step(model)
    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save({"gathers": len(gathers), "states": states, "edges": edges,
                "trained": {k: v.detach().clone() for k, v in trained.items()}}, workdir / f"rank{rank}.pt")


def run_units(tmp_path: Path, model_dir: Path, parallel: str, blocks_per_unit: int | None, prefetch: int = 0) -> dict:
    work = tmp_path / f"{parallel}-{blocks_per_unit}-{prefetch}"
    work.mkdir()
    (work / "task.json").write_text(json.dumps({"model": str(model_dir), "parallel": parallel,
                                                "blocks_per_unit": blocks_per_unit, "prefetch": prefetch}))
    run_ranks(units_job, 2, work)
    return torch.load(work / "rank1.pt")


def test_blocks_are_grouped_in_order_and_the_last_unit_takes_the_rest():
    assert fsdp_units(list("abcde"), 2) == [["a", "b"], ["c", "d"], ["e"]]
    assert fsdp_units(list("abcde"), 1) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert fsdp_units(list("abc"), 8) == [["a", "b", "c"]]


def test_the_embedding_and_head_are_units_of_their_own_unless_they_share_a_weight(tmp_path, five_block_model):
    untied = load_model(five_block_model)
    assert edge_units(untied) == (untied.get_input_embeddings(), untied.get_output_embeddings())
    tokenizer = train_tokenizer(["a few words to train a tokenizer on"] * 20, vocab_size=300)
    tied = build_tiny_model(tokenizer, tmp_path, seed=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)
    assert edge_units(load_model(tied)) == (None, None)  # one tensor: the root holds it


@pytest.mark.slow
@pytest.mark.parametrize("parallel,prefetch", [("zero3", 0), ("zero2", 1)])
def test_grouped_units_gather_once_per_unit_and_train_the_same(tmp_path, five_block_model, parallel, prefetch):
    one = run_units(tmp_path, five_block_model, parallel, 1, prefetch)
    two = run_units(tmp_path, five_block_model, parallel, 2, prefetch)
    assert len(set(one["states"])) == 5 and one["gathers"] == 8  # five blocks, the embedding, the head, the root
    assert len(set(one["states"]) | set(one["edges"])) == 7  # the embedding and the head: units of their own
    assert two["states"][0] == two["states"][1] != two["states"][2] == two["states"][3] != two["states"][4]
    assert two["gathers"] == 6  # three units of blocks, the embedding, the head and the root
    if parallel == "zero3":  # left open, as the run plan resolves it: the tiny blocks go four a unit
        default = run_units(tmp_path, five_block_model, parallel, None, prefetch)
        assert default["gathers"] == 5 and len(set(default["states"][:4])) == 1
        assert default["states"][3] != default["states"][4]
        for name, tensor in default["trained"].items():
            assert torch.allclose(tensor, two["trained"][name], rtol=1e-5, atol=1e-7), name
    reference = load_model(five_block_model)
    one_step(reference)  # one process, no wrapper
    for name, tensor in reference.state_dict().items():
        for result in (one, two):
            assert torch.allclose(result["trained"][name], tensor, rtol=1e-5, atol=1e-7), name


def regather_job(rank: int, world_size: int, workdir: Path) -> None:
    """All-gathers of one training step's forward and backward under zero3, one block a unit."""
    task = json.loads((workdir / "task.json").read_text())
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"))
    model = wrap_model(load_model(task["model"]), "zero3", env, bf16=False, blocks_per_unit=1)
    with counted_all_gathers() as gathers:
        ids = torch.arange(24).reshape(2, 12) % 50 + 3
        loss = model(input_ids=ids, labels=ids).loss
        forward = len(gathers)
        loss.backward()
    (workdir / f"rank{rank}.json").write_text(json.dumps({"forward": forward, "backward": len(gathers) - forward}))


@pytest.mark.slow
def test_zero3_gathers_every_unit_again_for_backward_but_the_last_block_the_head_and_the_root(tmp_path,
                                                                                               five_block_model):
    """Backward begins with the head and the last block: freeing them after forward would only gather them again at
    once, so they stay whole, as the root (the final norm) does; the other four blocks and the embedding, used last,
    are gathered again."""
    (tmp_path / "task.json").write_text(json.dumps({"model": str(five_block_model)}))
    run_ranks(regather_job, 2, tmp_path)
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"forward": 8, "backward": 5}


def accumulation_job(rank: int, world_size: int, workdir: Path) -> None:
    """Two micro-steps of one optimizer step under zero2, each rank its own micro-batches: the all-gathers of each
    micro-step, and the gradients after both."""
    task = json.loads((workdir / "task.json").read_text())
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"))
    model = wrap_model(load_model(task["model"]), "zero2", env, bf16=False, blocks_per_unit=1)
    per_micro_step = []
    with counted_all_gathers() as gathers:
        for m in range(2):
            before = len(gathers)
            with gradient_sync(model, last=m == 1, reduction=task["reduction"], keep_gathered=task["keep"]):
                ids = accumulation_batch(rank, m)
                model(input_ids=ids, labels=ids).loss.backward()
            per_micro_step.append(len(gathers) - before)
    finish_gradient_sync(model)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    torch.save({"gathers": per_micro_step, "grads": grads}, workdir / f"rank{rank}.pt")


def accumulation_batch(rank: int, micro_step: int) -> torch.Tensor:
    return (torch.arange(24).reshape(2, 12) * (3 + 2 * rank + micro_step)) % 50 + 3


@pytest.mark.slow
@pytest.mark.parametrize("reduction", [ONCE, EACH])
def test_zero2_gathers_the_weights_once_an_optimizer_step_under_accumulation(tmp_path, five_block_model, reduction):
    """Weights zero2 keeps whole from forward to backward stay whole into the next micro-step: only the first
    all-gathers (five blocks, the embedding, the head, the root); the gradients are those of the weights resharded
    after each micro-step, and the single-process sum of all four micro-batches, averaged over the two ranks."""
    results = {}
    for keep in (True, False):
        work = tmp_path / f"keep-{keep}"
        work.mkdir()
        (work / "task.json").write_text(json.dumps({"model": str(five_block_model), "reduction": reduction,
                                                    "keep": keep}))
        run_ranks(accumulation_job, 2, work)
        results[keep] = torch.load(work / "rank1.pt")
    assert results[True]["gathers"] == [8, 0] and results[False]["gathers"] == [8, 8]
    reference = load_model(five_block_model)
    for rank in range(2):
        for m in range(2):
            ids = accumulation_batch(rank, m)
            (reference(input_ids=ids, labels=ids).loss / 2).backward()
    for name, param in reference.named_parameters():
        assert torch.equal(results[True]["grads"][name], results[False]["grads"][name]), name
        assert torch.allclose(results[True]["grads"][name], param.grad, rtol=1e-5, atol=1e-7), name


def ddp_buckets_job(rank: int, world_size: int, workdir: Path) -> None:
    task = json.loads((workdir / "task.json").read_text())
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"))
    model = wrap_model(load_model(task["model"]), "ddp", env, bf16=False, bucket_cap_mb=task["cap"])
    ids = torch.arange(24).reshape(2, 12) % 50 + 3
    model(input_ids=ids, labels=ids).loss.backward()
    # a bucket view is a view of the bucket's flat buffer; a gradient of its own has no base tensor
    in_buckets = all(p.grad._base is not None for p in model.parameters() if p.grad is not None)
    (workdir / f"rank{rank}.json").write_text(json.dumps({"cap": model.bucket_bytes_cap, "views": in_buckets}))


@pytest.mark.slow
def test_ddp_buckets_take_bucket_cap_mb_and_hold_the_gradients_themselves(tmp_path, five_block_model):
    """ddp_bucket_cap_mb reaches DDP, and every gradient is a view of its bucket (no copy into the buckets, no
    second gradient buffer)."""
    (tmp_path / "task.json").write_text(json.dumps({"model": str(five_block_model), "cap": 50}))
    run_ranks(ddp_buckets_job, 2, tmp_path)
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"cap": 50 * 2**20, "views": True}
