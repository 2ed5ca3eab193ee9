"""Modules trained in full beside LoRA (additional_target, PEFT's modules_to_save; Qwen's finetune.py trains a base
model's embedding and head so): the fused loss trains the head's trainable copy as the plain loss does, the copies
are fp32 master weights over a bf16 base, final/ and every export carry them, a tied head is untied on merge."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import base_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.export.adapters import Adapters
from meshtune.export.merge import export, merge_into
from meshtune.model.loading import load_model
from meshtune.model.lora import add_lora, trained_in_full
from meshtune.model.loss_head import install_loss_head, targets_for
from meshtune.train.loop import run

BOTH = ["embed_tokens", "lm_head"]


def lora_model(model_dir, fused: bool, dtype=torch.float32, targets=BOTH):
    model = load_model(model_dir, dtype)
    if fused:
        assert install_loss_head(model)
    torch.manual_seed(0)
    cfg = build_config(dict(model_name_or_path=str(model_dir), dataset="d.json", lora_rank=4,
                            additional_target=targets))
    return add_lora(model, cfg)


def trained_copy(model, name: str) -> torch.nn.Module:
    wrapper = next(m for n, m in model.named_modules() if n.endswith(name) and hasattr(m, "modules_to_save"))
    return wrapper.modules_to_save["default"]


def test_fused_loss_trains_the_heads_trainable_copy_as_the_plain_loss_does(tiny_model_dir):
    fused, plain = lora_model(tiny_model_dir, fused=True), lora_model(tiny_model_dir, fused=False)
    vocab = fused.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(24).reshape(2, 12)[:, :-1].reshape(-1)
    with targets_for(fused, positions, ids[:, 1:].reshape(-1)):
        fused_loss = fused(input_ids=ids, use_cache=False).logits
    logits = plain(input_ids=ids, use_cache=False).logits[:, :-1]
    plain_loss = F.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum")
    (fused_loss + 0).backward()
    plain_loss.backward()
    assert fused_loss.ndim == 0 and torch.allclose(fused_loss, plain_loss, rtol=1e-6)
    for name in BOTH:
        got, want = trained_copy(fused, name).weight.grad, trained_copy(plain, name).weight.grad
        # fp32 sums in another order: an entry near 0 of a gradient whose largest is ~5 may be off by ~4e-7 (AMD EPYC)
        atol = 1e-6 * want.abs().max().item()
        assert got.abs().sum() > 0 and torch.allclose(got, want, rtol=1e-4, atol=atol), name
    originals = [m.original_module for m in fused.modules() if hasattr(m, "original_module")]
    assert len(originals) == 2 and all(p.grad is None and not p.requires_grad
                                       for m in originals for p in m.parameters())


def test_trained_copies_are_fp32_master_weights_over_a_bf16_base(tiny_model_dir):
    model = lora_model(tiny_model_dir, fused=True, dtype=torch.bfloat16)
    for name in BOTH:
        weight = trained_copy(model, name).weight
        assert weight.dtype == torch.float32 and weight.requires_grad
    originals = [m.original_module for m in model.modules() if hasattr(m, "original_module")]
    assert len(originals) == 2 and all(m.weight.dtype == torch.bfloat16 for m in originals)


def test_qwens_names_are_the_models_embedding_and_head(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert trained_in_full(["wte", "lm_head"], model) == BOTH
    assert trained_in_full(["embed_tokens", "wte"], model) == ["embed_tokens"]
    with pytest.raises(ConfigError, match=r"additional_target: c_head is not a module of the model; .* e\.g\. "
                                          r"embed_tokens \(the embedding\) or lm_head \(the output head\)"):
        trained_in_full(["c_head"], model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, tiny_dataset):
    """LoRA with the embedding and head trained in full, fused and plain loss, checkpoints at 2 and 4."""
    work = tmp_path_factory.mktemp("in_full")
    losses = {}
    for fused in (True, False):
        cfg = build_config(base_config(tiny_model_dir, tiny_dataset, work / f"fused{fused}", max_steps=4,
                                       save_steps=2, learning_rate=5e-2, additional_target=BOTH, fused_loss=fused))
        losses[fused] = [r["loss"] for r in run(cfg).records]
    return work, losses


def test_runs_train_the_copies_with_the_plain_losses_and_save_them_in_the_adapter(trained, tiny_model_dir):
    work, losses = trained
    assert losses[True] == pytest.approx(losses[False], rel=1e-5) and len(losses[True]) == 4
    final = work / "fusedTrue" / "final"
    assert sorted(json.loads((final / "adapter_config.json").read_text())["modules_to_save"]) == BOTH
    saved = load_file(final / "adapter_model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        assert saved[f"base_model.model.{key}"].dtype == torch.float32
        assert not torch.allclose(saved[f"base_model.model.{key}"], base[key].float()), f"{key} did not train"


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_every_export_carries_the_copies(trained, tiny_model_dir, tmp_path):
    work, _ = trained
    run_dir = work / "fusedTrue"
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    want = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                            run_dir / "final").eval(), ids)
    assert not torch.allclose(want, logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids), atol=1e-3)
    assert "2 modules trained in full" in export(run_dir / "checkpoint-4", tmp_path / "adapter", merge=False,
                                                 dtype="fp32", force=False)
    from_checkpoint = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    final = load_file(run_dir / "final" / "adapter_model.safetensors")
    assert from_checkpoint.keys() == final.keys() and all(torch.equal(from_checkpoint[k], final[k]) for k in final)
    for source in (run_dir, run_dir / "checkpoint-4"):
        out = tmp_path / f"merged-{source.name}"
        export(source, out, merge=True, dtype="fp32", force=False)
        assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids), want, atol=1e-5)


def tied_base(tiny_model_dir, into):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=True)
    model.tie_weights()
    model.save_pretrained(into)
    assert "lm_head.weight" not in load_file(into / "model.safetensors")
    return into


@pytest.mark.parametrize("trained_keys", [["model.embed_tokens.weight", "lm_head.weight"],
                                          ["model.embed_tokens.weight"]])
def test_a_head_tied_to_the_embedding_is_untied_when_either_trained_apart(tiny_model_dir, tmp_path, trained_keys):
    base = tied_base(tiny_model_dir, tmp_path / "base")
    embedding = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    new = {key: torch.randn(embedding.shape, generator=torch.Generator().manual_seed(i))
           for i, key in enumerate(trained_keys)}
    (tmp_path / "out").mkdir()
    merge_into(Adapters({}, 1.0, 4, 4.0, 0.0, str(base), dict(new)), base, tmp_path / "out", torch.float32)
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(merged["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
    assert torch.equal(merged["lm_head.weight"], new.get("lm_head.weight", embedding))
