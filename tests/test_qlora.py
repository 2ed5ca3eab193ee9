"""Q-LoRA: the frozen linear weights of the blocks in 4-bit NF4 (torchao), LoRA adapters in full precision on top.
The real loading, quantizing, training, checkpointing and export code on a small model whose linear layers are
large enough to quantize in whole NF4 scale groups."""

from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from conftest import base_config, read_metrics, run_cli, sentence, write_config
from meshtune.config import build_config
from meshtune.demo.model import build_tiny_model
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.model.lora import add_lora
from meshtune.model.loading import load_model, transformer_blocks
from meshtune.model.parallel import unwrap
from meshtune.model.qlora import nf4_quantizer, quantize_frozen_linears
from meshtune.train.loop import run

LINEARS_PER_BLOCK = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def qlora_model_dir(tmp_path_factory):
    """Every block linear holds a whole number of NF4 scale groups (64 x 256 values): 128 wide, 256 in the MLP."""
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 5, 30) for _ in range(300)], vocab_size=320)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("qlora-model"), seed=2, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)


def qlora_values(model_dir, dataset, out, **extra) -> dict:
    return base_config(model_dir, dataset, out, finetuning_type="qlora", learning_rate=1e-2, **extra)


def probe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_only_the_frozen_block_linears_become_nf4_at_an_eighth_of_their_fp32_bytes(qlora_model_dir, tiny_dataset, tmp_path):
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
    assert losses[-1] < losses[0], losses
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


@pytest.mark.slow
def test_qlora_on_two_processes_matches_one_process_with_accumulation(qlora_model_dir, tiny_dataset, tmp_path):
    """ddp over gloo: the NF4 weights stay out of DDP (each rank quantized the same files), the adapters'
    gradients are all-reduced, and the losses are one process's with two micro-steps."""
    losses = {}
    for nproc, accumulation in ((1, 2), (2, 1)):
        out = tmp_path / f"{nproc}x{accumulation}"
        out.mkdir()
        values = qlora_values(qlora_model_dir, tiny_dataset, out / "output", nproc_per_node=nproc,
                              gradient_accumulation_steps=accumulation, tokenized_path=str(tmp_path / "tokenized"))
        result, _ = run_cli(["train", str(write_config(out, **values))], timeout=300)
        assert result.returncode == 0, result.stdout[-4000:]
        assert "qlora: 14 frozen linear weights of the transformer blocks in 4-bit NF4" in result.stdout
        losses[nproc] = [r["loss"] for r in read_metrics(out / "output")]
    for one, two in zip(losses[1], losses[2]):
        assert abs(one - two) / abs(one) < 1e-4, losses


def test_without_torchao_qlora_says_what_to_install(monkeypatch):
    from meshtune.errors import ConfigError

    for name in [n for n in list(sys.modules) if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(ConfigError, match=r"qlora needs torchao.*pip install 'meshtune\[qlora\]'"):
        nf4_quantizer()
