"""Weights read once per job: rank 0 loads the files, the other ranks build an empty model and receive rank 0's
values, whole under ddp and as their shard under FSDP2, buffers included. Two real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtune.demo.model import build_tiny_model
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.distributed import DistEnv
from meshtune.errors import ModelError
from meshtune.model.loading import load_model, model_skeleton
from meshtune.model.parallel import wrap_model
from meshtune.model.rank0_weights import check_same_model, full_state, receive_replicated, receive_shards
from ranks import run_ranks


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    """Tied input and output embeddings, as the small Qwen2.5 models: one tensor under two names."""
    tokenizer = train_tokenizer(["a few words to train a tokenizer on"] * 20, vocab_size=300)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("tied"), seed=3, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def receive_job(rank: int, world_size: int, workdir: Path) -> None:
    task = json.loads((workdir / "task.json").read_text())
    env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"))
    if rank == 0:
        model = load_model(task["model"])
    else:
        model = model_skeleton(task["model"], getattr(torch, task.get("dtype", "float32")))
        assert all(p.is_meta for p in model.parameters())
    check_same_model(model, env)
    if task["parallel"] == "ddp":
        receive_replicated(model, env)
        values = dict(model.state_dict())
    else:
        state = full_state(model, env)
        model = wrap_model(model, task["parallel"], env, bf16=False)
        receive_shards(model, state, env)
        values = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    values.update({f"buffer:{name}": b for name, b in model.named_buffers()})  # non-persistent ones too
    values = {k: v.detach().clone() for k, v in values.items()}  # before the step changes them in place
    values["tied"] = torch.tensor(model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    one_step(model)
    trained = (dict(model.state_dict()) if task["parallel"] == "ddp"
               else get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    values.update({f"trained:{name}": t for name, t in trained.items()})
    torch.save({k: v.detach().clone() for k, v in values.items()}, workdir / f"rank{rank}.pt")


def one_step(model: torch.nn.Module) -> None:
    """The same batch on every rank, so the averaged gradient is the single-process one."""
    ids = torch.arange(24).reshape(2, 12) % 50 + 3
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.5 * param.grad


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "zero3"])
def test_the_other_rank_ends_with_rank_0s_weights_and_buffers_and_trains_the_same(tmp_path, tied_model_dir,
                                                                                     parallel):
    (tmp_path / "task.json").write_text(json.dumps({"model": str(tied_model_dir), "parallel": parallel}))
    run_ranks(receive_job, 2, tmp_path)
    loaded, received = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    reference = load_model(tied_model_dir)
    assert sorted(received) == sorted(loaded)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(received[name], tensor), name
    for name, buffer in reference.named_buffers():  # rotary frequencies: not in the state dict
        assert torch.equal(received[f"buffer:{name}"], buffer), name
    assert received["tied"] and loaded["tied"]
    one_step(reference)  # one process, no wrapper: what both ranks must have after their step
    for name, tensor in reference.state_dict().items():
        for values in (loaded, received):
            assert torch.allclose(values[f"trained:{name}"], tensor, rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_a_different_empty_model_stops_every_rank_naming_the_tensor(tmp_path, tied_model_dir):
    (tmp_path / "task.json").write_text(json.dumps({"model": str(tied_model_dir), "parallel": "ddp",
                                                    "dtype": "bfloat16"}))
    with pytest.raises(AssertionError):
        run_ranks(receive_job, 2, tmp_path)
    for rank in (0, 1):
        error = (tmp_path / f"rank{rank}.error").read_text()
        assert ModelError.__name__ in error and "differs from the one rank 0 loaded" in error, error
    assert "model.embed_tokens.weight is [283, 32] torch.float32 on rank 0" in error, error
    assert "[283, 32] torch.bfloat16 on rank 1" in error and "load_weights_on: every_rank" in error, error
