"""Q-LoRA: the frozen linear weights of the blocks in 4-bit NF4 (torchao), LoRA adapters in full precision on top.
The real loading, quantizing, training, checkpointing and export code on a small model whose linear layers are
large enough to quantize in whole NF4 scale groups."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from conftest import (LLAMAFACTORY_DATA, base_config, kill_tree, needs_gpus, read_metrics, run_cli_here, sentence,
                      write_config)
from meshtune.config import build_config
from meshtune.demo.model import build_tiny_model
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.model.lora import add_lora
from meshtune.model.loading import load_model, transformer_blocks
from meshtune.model.parallel import unwrap
from meshtune.model.qlora import nf4_quantizer, quantize_block
from meshtune.train.loop import run
from ranks import run_meshtune_ranks, wait_for_port

LINEARS_PER_BLOCK = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def qlora_model_dir(tmp_path_factory):
    """Every block linear holds a whole number of NF4 scale groups (64 x 256 values) for each of up to 4 processes
    sharding it: 256 wide, 512 in the MLP."""
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 5, 30) for _ in range(300)], vocab_size=320)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("qlora-model"), seed=2, hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)


def quantize_frozen_linears(model, device: torch.device) -> tuple[int, int, int]:
    """A model loaded whole, quantized block by block as training quantizes it: the reference the block loader is
    held to, and how a trained adapter's model is rebuilt. Returns (layers, bytes before, bytes after)."""
    totals = [0, 0, 0]
    for block in transformer_blocks(model):
        block.to(device)
        totals = [a + b for a, b in zip(totals, quantize_block(block))]
    return totals[0], totals[1], totals[2]


def qlora_values(model_dir, dataset, out, **extra) -> dict:
    return base_config(model_dir, dataset, out, finetuning_type="qlora", learning_rate=1e-2, **extra)


def probe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_only_the_frozen_block_linears_become_nf4_at_an_eighth_of_their_fp32_bytes(
        qlora_model_dir, tiny_dataset, tmp_path):
    NF4Tensor = type(nf4_quantizer()(torch.ones(64 * 256)))
    cfg = build_config(qlora_values(qlora_model_dir, tiny_dataset, tmp_path / "o"))
    plain = load_model(qlora_model_dir)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    reference = probe_logits(plain, ids)
    torch.manual_seed(0)
    model = add_lora(load_model(qlora_model_dir), cfg)
    count, before, after = quantize_frozen_linears(model, torch.device("cpu"))
    blocks = transformer_blocks(model)
    assert count == LINEARS_PER_BLOCK * len(blocks) and len(blocks) == 2
    assert 0.12 < after / before < 0.14, (before, after)  # 4 bits a value and its scales, from 32 (a quarter of bf16)
    for name, param in model.named_parameters():
        is_block_base = ".layers." in name and "base_layer.weight" in name
        assert isinstance(param, NF4Tensor) == is_block_base, name
        assert param.requires_grad == ("lora_" in name), name
    assert type(model.get_input_embeddings().weight) is torch.nn.Parameter  # embeddings and head as loaded
    assert type(model.get_output_embeddings().weight) is torch.nn.Parameter
    plain_layers = dict(transformer_blocks(plain)[0].named_modules())
    checked = 0
    for name, layer in blocks[0].named_modules():
        if name.endswith(".base_layer"):  # NF4 keeps each layer's output within about 9% on random weights
            twin = plain_layers[name.removesuffix(".base_layer")]
            x = torch.randn(3, twin.in_features)
            error = (layer(x) - twin(x)).norm() / twin(x).norm()
            assert 0.01 < error < 0.15, (name, error)
            checked += 1
    assert checked == LINEARS_PER_BLOCK
    assert not torch.allclose(probe_logits(model, ids), reference)  # LoRA B starts at zero: the quantized base


def test_qlora_trains_checkpoints_resumes_exactly_and_exports_a_peft_adapter(qlora_model_dir, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    values = qlora_values(qlora_model_dir, tiny_dataset, out, max_steps=6, save_steps=3)
    result = run(build_config(values), keep_model=True)
    losses = [r["loss"] for r in read_metrics(out)]
    assert sum(losses[3:]) < sum(losses[:3]), losses  # batches of 4 are noisy: the last three against the first
    model = unwrap(result.model)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "base_layer" in n)

    # the checkpoint holds the adapters and optimizer only: the base is the model files, quantized again on resume
    saved = json.loads((out / "checkpoint-3" / "manifest.json").read_text())
    assert saved["finetuning_type"] == "qlora"
    shutil.rmtree(out / "checkpoint-6")
    shutil.rmtree(out / "final")
    run(build_config(values))
    assert [r["loss"] for r in read_metrics(out)] == losses  # steps 4-6 again, from checkpoint-3: the same

    # final/: a standard PEFT adapter. Loaded by peft onto the model files, then quantized as in training, it
    # gives the trained model's logits: the adapter is exactly what trained
    final = out / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    trained = probe_logits(model, ids)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qlora_model_dir), str(final))
    assert quantize_frozen_linears(reloaded, torch.device("cpu"))[0] == 2 * LINEARS_PER_BLOCK  # not the adapters
    torch.testing.assert_close(probe_logits(reloaded, ids), trained, rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(qlora_model_dir).requires_grad_(False)
    assert quantize_frozen_linears(base, torch.device("cpu"))[0] == 2 * LINEARS_PER_BLOCK
    assert not torch.allclose(probe_logits(base, ids), trained, atol=1e-3)  # and it changed the model


# (parallel, processes, gradient_accumulation_steps, extra keys) against ddp 1 x 4: global batch 8 in each. Each
# run starts its own processes (most of its time), so each Q-LoRA property runs once:
# - ddp 2 x 2: every process quantizes and holds the whole NF4 model, which DDP leaves out of its broadcast and
#   checks; none of that depends on the number of processes (the ddp math over 4 ranks: test_topology);
# - zero3 2 x 2 and 4 x 1: the NF4 weights sharded over 2 and 4 processes, with and without accumulation;
# - hsdp 4 x 1 as 2 replicas x 2 shards: the NF4 weights sharded within a replica, the adapters' gradients
#   all-reduced across replicas. (hsdp on 2 processes has one replica of 2 shards: zero3 2 x 2's sharding.)
LAYOUTS_BY_MODE = [("ddp", 2, 2, {}), ("zero3", 2, 2, {}), ("zero3", 4, 1, {}), ("hsdp", 4, 1, {"hsdp_shard_size": 2})]
RUNS: dict[tuple, tuple[list[float], str]] = {}


def layout_values(model_dir, dataset, out, tokenized, parallel, nproc, accumulation, **extra) -> dict:
    return qlora_values(model_dir, dataset, out, **{
        "parallel": parallel, "nproc_per_node": nproc, "gradient_accumulation_steps": accumulation,
        "tokenized_path": str(tokenized), "val_size": 6, "per_device_eval_batch_size": 2, "save_final": False, **extra})


# Runs in flight at once. Most of a run is single-threaded: the launcher's and torchrun's start-up, then each
# worker importing torch; two runs side by side keep both cores busy. Each run is its own job (own output_dir,
# free port, processes); the tokenized cache they share is built under a file lock.
PARALLEL_RUNS = 2


def layout_runs(tmp_path_factory, capfd, model_dir, dataset, runs: list[tuple[str, int, int, dict]]) -> None:
    """Runs the (parallel, processes, accumulation, extra) not yet in RUNS: those that start torchrun
    PARALLEL_RUNS at a time, the ones with the most processes first; meanwhile the one-process runs here, in this
    thread (they train in this process: see layout_run)."""
    todo = [run for run in runs if (run[0], run[1], run[2], tuple(sorted(run[3].items()))) not in RUNS]
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        futures = [pool.submit(layout_run, tmp_path_factory, capfd, model_dir, dataset, parallel, nproc,
                               accumulation, **extra)
                   for parallel, nproc, accumulation, extra in sorted(todo, key=lambda r: -r[1]) if nproc > 1]
        for parallel, nproc, accumulation, extra in todo:
            if nproc == 1:
                layout_run(tmp_path_factory, capfd, model_dir, dataset, parallel, nproc, accumulation, **extra)
        for future in futures:
            future.result()


def layout_run(tmp_path_factory, capfd, model_dir, dataset, parallel, nproc, accumulation,
               **extra) -> tuple[list, str]:
    """Per-step losses then the final eval loss, and the output, of one layout (each runs once per session).
    `capfd` holds the output of a one-process run, which trains in this process."""
    key = (parallel, nproc, accumulation, tuple(sorted(extra.items())))
    if key not in RUNS:
        out = tmp_path_factory.mktemp(f"qlora-{parallel}-{nproc}x{accumulation}")
        values = layout_values(model_dir, dataset, out / "output", tmp_path_factory.getbasetemp() / "qlora-tokenized",
                               parallel, nproc, accumulation, **extra)
        config = str(write_config(out, **values))
        if nproc == 1:  # `meshtune train` trains in its own process, which may as well be this one: no start-up
            result = run_cli_here(["train", config], capfd)
        else:  # the ranks torchrun would start, forked from a process that has imported the training code
            result = run_meshtune_ranks(["train", config], nproc, out / "ranks", timeout=300)
        assert result.returncode == 0, result.stdout[-4000:]
        records = read_metrics(out / "output")
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        held_out = [records[-1]["eval_loss"]] if "eval_loss" in records[-1] else []  # none with val_size 0
        RUNS[key] = [r["loss"] for r in records] + held_out, result.stdout
    return RUNS[key]


def assert_close(losses: list[float], reference: list[float], what: str) -> None:
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        name = f"step {step} loss" if step <= 5 else "final eval loss"
        assert abs(got - want) / abs(want) < 1e-4, f"{what}: {name} {got} vs 1x4 ddp {want}"


def nf4_sizes(output: str) -> tuple[float, float | None]:
    """The whole NF4 bytes and this process's share, from the line the build logs."""
    line = next(line for line in output.splitlines() if line.startswith("qlora: 14 frozen linear weights"))
    sizes = [float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
             for number, unit in re.findall(r"([\d.,]+) (KiB|MiB|GiB)", line.replace(",", ""))]
    return sizes[1], sizes[2] if len(sizes) > 2 else None


@pytest.mark.slow
def test_sharded_qlora_gives_the_same_losses_in_every_layout_and_keeps_a_shard_of_the_nf4_weights_per_process(
        qlora_model_dir, tiny_dataset, tmp_path_factory, capfd):
    """ddp, zero3 and hsdp over 2 x 2 and 4 x 1 (processes x accumulation, LAYOUTS_BY_MODE) against 1 x 4: the same
    losses. Under ddp every process holds the whole 4-bit model; under zero3 each keeps 1 / processes of it, under
    hsdp 1 / shard size."""
    layout_runs(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, [("ddp", 1, 4, {}), *LAYOUTS_BY_MODE])
    reference, output = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "ddp", 1, 4)
    assert reference[4] < reference[0], f"the loss should fall over 5 steps: {reference}"
    whole, share = nf4_sizes(output)
    assert share is None
    for parallel, nproc, accumulation, extra in LAYOUTS_BY_MODE:  # on one process they run as ddp (test_choices)
        losses, output = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, parallel, nproc,
                                    accumulation, **extra)
        assert_close(losses, reference, f"{parallel} {nproc}x{accumulation}")
        shards = 1 if parallel == "ddp" else extra.get("hsdp_shard_size", nproc)
        assert nf4_sizes(output)[0] == whole
        if shards > 1:
            assert abs(nf4_sizes(output)[1] * shards / whole - 1) < 0.01, (parallel, nproc, output[-3000:])
        else:
            assert nf4_sizes(output)[1] is None, (parallel, nproc, output[-3000:])  # the whole model here


@pytest.mark.slow
def test_sharded_qlora_with_compiled_recomputed_blocks_trains_the_losses_of_one_process(
        qlora_model_dir, tiny_dataset, tmp_path_factory, capfd):
    """zero3 over 2 processes, every block compiled and recomputed: FSDP2 gathers the NF4 weights inside the
    compiled block's forward and again in its recompute. On CPU this trains the one-process losses; the plan keeps
    the blocks uncompiled by default on CUDA only, where the recompute failed (test below on 2 GPUs)."""
    # no held-out set: its no-grad forward would compile every block's graphs once more; a row a micro-step: no
    # padding, so the training steps pass the blocks no attention mask (padded batches' masks, alternating with
    # none, compiled the blocks' graphs twice more: 4 graphs a rank, 2 now)
    one_row = {"val_size": 0, "per_device_train_batch_size": 1}
    compiled = ("zero3", 2, 2, {"gradient_checkpointing_ratio": 1.0, "torch_compile": True, **one_row})
    layout_runs(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, [("ddp", 1, 4, one_row), compiled])
    reference, _ = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "ddp", 1, 4, **one_row)
    losses, output = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, *compiled[:3], **compiled[3])
    assert re.search(r"torch_compile\s+on", output) and "CheckpointError" not in output
    assert len(losses) == len(reference) == 5
    assert_close(losses, reference, "zero3 2x2, compiled and recomputed")


@needs_gpus(2)
@pytest.mark.slow
def test_sharded_qlora_with_compiled_recomputed_blocks_on_two_gpus(qlora_model_dir, tiny_dataset, tmp_path_factory,
                                                                   capfd):
    """The same on CUDA (bf16): the compiled blocks' recompute under FSDP2's NF4 gathers either trains the eager
    run's losses or fails with torch.utils.checkpoint's CheckpointError, the failure the plan's default avoids."""
    runs = [layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "zero3", 2, 2,
                       gradient_checkpointing_ratio=1.0, torch_compile=compiled) for compiled in (False, True)]
    (eager, _), (compiled, output) = runs
    assert "CheckpointError" not in output
    for step, (a, b) in enumerate(zip(compiled, eager), start=1):
        assert abs(a - b) / abs(b) < 2e-2, f"step {step}: compiled {a} against eager {b}"


PIPELINES = [("ddp", 2, 4, {"pipeline_parallel": 2}), ("ddp", 4, 2, {"pipeline_parallel": 2}),
             ("zero2", 4, 2, {"pipeline_parallel": 2}), ("zero3", 4, 2, {"pipeline_parallel": 2})]


@pytest.mark.slow
def test_qlora_under_pipeline_parallel_gives_the_losses_of_one_process_each_stage_quantizing_its_own_blocks(
        qlora_model_dir, tiny_dataset, tmp_path_factory, capfd):
    """pp 2 (a block a stage) and pp 2 x 2 (ddp, zero2, zero3) against 1 x 4: the same losses and held-out loss.
    Each process reads and quantizes only its stage's block: 7 of the 14 linear weights, half the 4-bit bytes, and
    under zero2 / zero3 keeps half of those. The held-out set's last batch is a row on one replica of a stage and two
    on the other: padded to one shape, so FSDP2 gathers the stage's weights as often on both."""
    layout_runs(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, [("ddp", 1, 4, {}), *PIPELINES])
    reference, output = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "ddp", 1, 4)
    whole = nf4_sizes(output)[0]
    for parallel, nproc, accumulation, extra in PIPELINES:
        losses, output = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, parallel, nproc,
                                    accumulation, **extra)
        assert_close(losses, reference, f"pp 2 {parallel} {nproc}x{accumulation}")
        line = next(line for line in output.splitlines() if line.startswith("qlora: "))
        assert line.startswith("qlora: 7 frozen linear weights"), line  # rank 0's: stage 0's block
        sizes = [float(number) * {"KiB": 2**10, "MiB": 2**20}[unit]
                 for number, unit in re.findall(r"([\d.]+) (KiB|MiB)", line.replace(",", ""))]
        assert abs(sizes[1] * 2 / whole - 1) < 0.01, line
        if parallel == "ddp":
            assert len(sizes) == 2, line  # the stage's whole 4-bit block
        else:
            assert abs(sizes[2] * 4 / whole - 1) < 0.01, line


@pytest.mark.slow
def test_zero3_qlora_on_two_nodes_matches_one_node_and_resumes_exactly_after_a_failure(
        qlora_model_dir, tiny_dataset, tmp_path_factory, tmp_path, capfd):
    """`meshtune train cfg.yaml finetuning_type=qlora parallel=zero3` on each of two simulated nodes of one
    process (the 4-bit weights sharded across the nodes): a worker fails after step 3, torchrun restarts the job,
    which resumes from checkpoint-2. Its losses are bit for bit those of the uninterrupted zero3 run on one node of
    2, and those of 1 process x 4 within rounding. The checkpoint then resumes on one process."""
    single, _ = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "zero3", 2, 2)
    reference, _ = layout_run(tmp_path_factory, capfd, qlora_model_dir, tiny_dataset, "ddp", 1, 4)
    values = layout_values(qlora_model_dir, tiny_dataset, tmp_path / "output",
                           tmp_path_factory.getbasetemp() / "qlora-tokenized", "ddp", 1, 2, save_steps=2,
                           max_restarts=1, rdzv_timeout=60, ddp_timeout=60)
    del values["nproc_per_node"], values["finetuning_type"], values["parallel"]
    config = write_config(tmp_path, **values)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MESHTUNE_FAULT": "raise:3:1"}
    command = [sys.executable, "-m", "meshtune", "train", str(config), "finetuning_type=qlora", "parallel=zero3"]
    nodes: list[subprocess.Popen] = []
    try:
        for rank in (0, 1):
            nodes.append(subprocess.Popen(command, env={**common, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
            if rank == 0:  # node 0 hosts the rendezvous store
                wait_for_port(port, nodes[0], timeout=120)
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node.pid)
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}:\n{output[-4000:]}"
    assert "fails after step 3" in "".join(outputs) and "resumed from" in "".join(outputs), outputs[0][-3000:]
    whole, share = nf4_sizes(outputs[0])
    assert share is not None and abs(share * 2 / whole - 1) < 0.01, outputs[0][-3000:]  # half on each node
    records = read_metrics(tmp_path / "output")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    losses = [r["loss"] for r in records] + [records[-1]["eval_loss"]]
    assert losses == single
    assert_close(losses, reference, "zero3 on 2 nodes x 1")

    # the checkpoint 2 processes wrote, resumed by one, this one (four micro-steps keep the global batch of 8)
    for late in ("checkpoint-4", "checkpoint-5"):
        shutil.rmtree(tmp_path / "output" / late)
    result = run_cli_here(["train", str(config), "finetuning_type=qlora", "parallel=zero3", "nproc_per_node=1"], capfd)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stdout[-3000:]
    records = read_metrics(tmp_path / "output")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert_close([r["loss"] for r in records] + [records[-1]["eval_loss"]], reference, "resumed on 1 process")


def test_without_torchao_qlora_says_what_to_install(monkeypatch):
    from meshtune.errors import ConfigError

    for name in [n for n in list(sys.modules) if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(ConfigError, match=r"qlora needs torchao.*pip install 'meshtune\[qlora\]'"):
        nf4_quantizer()


def built_empty(model_dir, cfg):
    from meshtune.model.loading import model_skeleton

    return add_lora(model_skeleton(model_dir), cfg)


def test_the_block_loader_builds_from_the_files_the_model_a_plain_load_would_quantize(qlora_model_dir, tiny_dataset,
                                                                                     tmp_path):
    """Filled block by block from the files (rotary frequencies rebuilt from the config), the empty model gives
    the logits of the loaded model quantized the old way: the adapters start at B = 0, so only the base counts."""
    from meshtune.model.block_loading import BlockLoader

    cfg = build_config(qlora_values(qlora_model_dir, tiny_dataset, tmp_path / "o"))
    model = built_empty(qlora_model_dir, cfg)
    loader = BlockLoader(model, qlora_model_dir, torch.device("cpu"), seed=7, shards=1)
    loader.load_all(model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert loader.quantized[0] == 2 * LINEARS_PER_BLOCK and "read block by block" in loader.describe(model)
    plain = add_lora(load_model(qlora_model_dir), cfg)
    quantize_frozen_linears(plain, torch.device("cpu"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    torch.testing.assert_close(probe_logits(model, ids), probe_logits(plain, ids), rtol=0, atol=0)
    again = built_empty(qlora_model_dir, cfg)
    BlockLoader(again, qlora_model_dir, torch.device("cpu"), seed=7, shards=1).load_all(again)
    other_seed = built_empty(qlora_model_dir, cfg)
    BlockLoader(other_seed, qlora_model_dir, torch.device("cpu"), seed=8, shards=1).load_all(other_seed)
    name = next(n for n, _ in model.named_parameters() if "lora_A" in n)
    assert torch.equal(model.get_parameter(name), again.get_parameter(name))  # the seed and the name decide
    assert not torch.equal(model.get_parameter(name), other_seed.get_parameter(name))
    assert model.get_parameter(name).abs().max() <= (1 / model.get_parameter(name).shape[1]) ** 0.5  # Kaiming bound


def test_the_block_loader_names_a_missing_tensor_a_wrong_shape_and_a_layer_that_cannot_be_split(
        qlora_model_dir, tiny_dataset, tmp_path):
    from safetensors.torch import load_file, save_file

    from meshtune.errors import ModelError
    from meshtune.model.block_loading import BlockLoader

    cfg = build_config(qlora_values(qlora_model_dir, tiny_dataset, tmp_path / "o"))
    broken = tmp_path / "broken"
    shutil.copytree(qlora_model_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    model = built_empty(broken, cfg)
    with pytest.raises(ModelError, match=r"model.layers.1.mlp.up_proj.weight is in the model its config.json "
                                         r"describes but in none of the weight files of .*broken"):
        BlockLoader(model, broken, torch.device("cpu"), 7, 1).load_all(model)

    config = json.loads((broken / "config.json").read_text())
    shutil.copy(qlora_model_dir / "model.safetensors", broken / "model.safetensors")
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 768}))
    model = built_empty(broken, cfg)
    with pytest.raises(ModelError, match=r"model.layers.0.mlp.gate_proj.weight in .*model.safetensors is \[512, 256\], "
                                         r"the model's config makes it \[768, 256\]"):
        BlockLoader(model, broken, torch.device("cpu"), 7, 1).load_all(model)

    model = built_empty(qlora_model_dir, cfg)
    with pytest.raises(ModelError, match=r"qlora: .*self_attn.q_proj.base_layer \(\[256, 256\]\) cannot be split "
                                         r"over 8 processes .* it splits over 1, 2, 4\. Shard over one of those"):
        BlockLoader(model, qlora_model_dir, torch.device("cpu"), 7, 8).load_all(model)

    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"qlora reads the model one block at a time from safetensors files.*"
                                         r"safe_serialization=True"):
        BlockLoader(built_empty(qlora_model_dir, cfg), broken, torch.device("cpu"), 7, 1)


@pytest.mark.slow
def test_qlora_dpo_trains_against_its_nf4_base_with_the_adapters_off_and_precomputes_the_same(
        qlora_model_dir, tmp_path):
    """stage: dpo with Q-LoRA: the reference is the 4-bit base with the adapters off, so the first step's policy is
    its reference (margin 0, loss ln 2); the policy then moves from it; a run with the reference's log-probs
    precomputed trains the same losses."""
    records = {}
    for precompute in (False, True):
        out = tmp_path / f"precompute-{precompute}"
        values = qlora_values(qlora_model_dir, "dpo_en_demo", out, stage="dpo", dataset_dir=str(LLAMAFACTORY_DATA),
                              cutoff_len=128, per_device_train_batch_size=2, max_steps=2,
                              precompute_ref_log_probs=precompute)
        assert run(build_config(values)).final_dir is not None
        records[precompute] = read_metrics(out)
        plan = json.loads((out / "run_plan.json").read_text())
        assert plan["why"]["reference"].startswith("precomputed" if precompute else "the model itself with its LoRA")
    in_step, precomputed = records[False], records[True]
    assert in_step[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and in_step[0]["rewards/margins"] == 0
    assert in_step[-1]["rewards/margins"] != 0
    for got, want in zip(precomputed, in_step):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), got["step"]
