"""`meshtune export`: LoRA adapters from final/ or any checkpoint-N, as a PEFT directory or merged into the base
model's own (sharded) safetensors files, loading in transformers with the trained model's logits; Q-LoRA merged
into the bf16 base; a full fine-tuning checkpoint written by 4 ranks as a model directory equal to final/. Every
export carries the chat template trained with, and is written in the base's dtype unless --dtype says another."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import base_config
from meshtune.cli import main
from meshtune.config import build_config
from meshtune.data.chat_template import ChatTemplate
from meshtune.errors import MeshtuneError
from meshtune.export.merge import export
from meshtune.model.model_dir import load_tokenizer
from meshtune.train.loop import run

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64, 2, 31]]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick fox"}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, tiny_dataset):
    """A LoRA run on a base model saved in several safetensors files (with an index), checkpoints at 2 and 4."""
    work = tmp_path_factory.mktemp("export")
    base = work / "base"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(base, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert (base / "model.safetensors.index.json").is_file()
    cfg = build_config(base_config(base, tiny_dataset, work / "run", max_steps=4, save_steps=2, learning_rate=5e-2))
    run(cfg)
    return work


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPTS)).logits


def peft_logits(base, adapter_dir) -> torch.Tensor:
    return logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir).eval())


def test_merged_export_loads_in_transformers_with_the_trained_logits(trained, tmp_path):
    out = tmp_path / "merged"
    assert main(["export", str(trained / "run"), "--output", str(out), "--merge"]) == 0  # the fp32 base's dtype
    assert (out / "model.safetensors.index.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    want = peft_logits(trained / "base", trained / "run" / "final")
    assert torch.allclose(logits(merged), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(trained / "base")), want, atol=1e-3)
    assert (out / "tokenizer_config.json").is_file() and (out / "chat_template.jinja").is_file()
    bf16 = export(trained / "run", tmp_path / "bf16", merge=True, dtype="bf16", force=False)
    assert "bf16" in bf16 and json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_any_checkpoint_exports_its_adapters_and_merges(trained, tmp_path):
    final = load_file(trained / "run" / "final" / "adapter_model.safetensors")
    export(trained / "run" / "checkpoint-4", tmp_path / "ckpt4", merge=False, dtype="bf16", force=False)
    from_checkpoint = load_file(tmp_path / "ckpt4" / "adapter_model.safetensors")
    assert from_checkpoint.keys() == final.keys()
    assert all(torch.equal(from_checkpoint[key], final[key]) for key in final)
    export(trained / "run" / "checkpoint-2", tmp_path / "ckpt2", merge=False, dtype="bf16", force=False)
    export(trained / "run" / "checkpoint-2", tmp_path / "ckpt2_merged", merge=True, dtype="fp32", force=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt2_merged").eval()
    want = peft_logits(trained / "base", tmp_path / "ckpt2")
    assert torch.allclose(logits(merged), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, peft_logits(trained / "base", trained / "run" / "final"), atol=1e-4)


def test_export_refuses_what_it_cannot_do_with_what_to_do(trained, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(MeshtuneError, match=r"is not empty; choose another --output or add --force"):
        export(trained / "run", tmp_path / "busy", merge=True, dtype="fp32", force=False)
    export(trained / "run", tmp_path / "busy", merge=False, dtype="fp32", force=True)
    assert not (tmp_path / "busy" / "x").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(MeshtuneError, match=r"holds no LoRA adapters"):
        export(tmp_path / "empty", tmp_path / "none", merge=False, dtype="fp32", force=False)
    with pytest.raises(MeshtuneError, match=r"does not exist"):
        export(trained / "missing", tmp_path / "none", merge=False, dtype="fp32", force=False)


def zero3_job(rank: int, world_size: int, workdir) -> None:
    """One LoRA run under zero3 on the gloo ranks: a checkpoint whose adapter shards two ranks wrote."""
    import os

    from meshtune.train.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what torchrun sets; the process group already exists
    train(build_config(json.loads((workdir / "task.json").read_text())))


@pytest.mark.slow
def test_a_checkpoint_two_ranks_wrote_under_zero3_exports_the_adapters_of_final(tmp_path, tiny_model_dir,
                                                                                tiny_dataset):
    from ranks import run_ranks

    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "run", max_steps=2, save_steps=2,
                         parallel="zero3", learning_rate=5e-2)
    (tmp_path / "task.json").write_text(json.dumps(values))
    run_ranks(zero3_job, 2, tmp_path)
    export(tmp_path / "run" / "checkpoint-2", tmp_path / "adapter", merge=False, dtype="bf16", force=False)
    final = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[key], final[key]) for key in final)


@pytest.mark.slow
def test_a_full_checkpoint_four_ranks_wrote_under_zero3_exports_a_model_equal_to_final(tmp_path, tiny_model_dir,
                                                                                       tiny_dataset):
    from ranks import run_ranks

    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "run", max_steps=2, save_steps=2,
                         finetuning_type="full", parallel="zero3", per_device_train_batch_size=1,
                         gradient_accumulation_steps=1, learning_rate=1e-3)
    (tmp_path / "task.json").write_text(json.dumps(values))
    run_ranks(zero3_job, 4, tmp_path)
    with pytest.raises(MeshtuneError, match=r"already a Hugging Face model directory"):
        export(tmp_path / "run" / "final", tmp_path / "from_final", merge=False, dtype="fp32", force=False)
    assert "full model" in export(tmp_path / "run" / "checkpoint-2", tmp_path / "model", merge=False, dtype="fp32",
                                  force=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert exported.keys() == final.keys() and all(torch.equal(exported[key], final[key]) for key in final)
    assert (tmp_path / "model" / "tokenizer_config.json").is_file()


def test_qlora_adapters_merge_into_the_unquantized_base(tmp_path, tiny_model_dir, tiny_dataset):
    """Q-LoRA trains against NF4 block weights; the merge adds its adapters to the base's original weights, so the
    merged model's logits are those of the original base plus the adapters."""
    pytest.importorskip("torchao")
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "run", finetuning_type="qlora",
                                   max_steps=2, learning_rate=5e-2))
    run(cfg)
    export(tmp_path / "run", tmp_path / "merged", merge=True, dtype="fp32", force=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = peft_logits(tiny_model_dir, tmp_path / "run" / "final")
    assert torch.allclose(logits(merged), want, atol=1e-5, rtol=1e-5)


def served_prompt(folder) -> str:
    """What serving renders from the exported tokenizer: its own chat template, as vLLM and transformers use it."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_every_export_of_a_checkpoint_carries_the_chat_template_trained_with(trained, tmp_path):
    """The base tokenizer has no chat template: training rendered with the written-out ChatML, which final/ saves;
    the adapter and the merged model exported from a checkpoint-N render prompts the same way."""
    trained_with = ChatTemplate(load_tokenizer(trained / "base"), None).render_prompt(CONVERSATION)
    with pytest.raises(ValueError, match="chat template"):
        served_prompt(trained / "base")
    assert served_prompt(trained / "run" / "final") == trained_with
    for merge in (False, True):
        out = tmp_path / f"merge-{merge}"
        export(trained / "run" / "checkpoint-2", out, merge=merge, dtype=None, force=False)
        assert (out / "chat_template.jinja").is_file(), merge
        assert served_prompt(out) == trained_with, merge


def test_a_checkpoint_exports_the_template_its_manifest_keeps(trained, tmp_path):
    """The template is kept in each checkpoint's manifest, so an export writes what that run trained with; a
    manifest without it (written before checkpoints kept it) has the run's template rendered again."""
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(trained / "run" / "checkpoint-2", checkpoint)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["chat_template"] == ChatTemplate(load_tokenizer(trained / "base"), None).jinja
    manifest["chat_template"] = "{% for message in messages %}[{{ message['content'] }}]{% endfor %}"
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    export(checkpoint, tmp_path / "kept", merge=False, dtype=None, force=False)
    assert served_prompt(tmp_path / "kept") == "[Be brief.][the quick fox]"
    del manifest["chat_template"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    export(checkpoint, tmp_path / "rendered", merge=False, dtype=None, force=False)
    assert served_prompt(tmp_path / "rendered") == served_prompt(trained / "run" / "final")


def test_a_full_checkpoint_exports_with_its_template_in_the_base_dtype(tmp_path, tiny_model_dir, tiny_dataset):
    """A full run trained with llama3's written-out template: checkpoint-2 exports as final/ does, with that
    template, in the fp32 of its base unless --dtype says otherwise."""
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "run", finetuning_type="full",
                                   template="llama3", cutoff_len=256, max_steps=2, save_steps=2,
                                   learning_rate=1e-3))
    run(cfg)
    trained_with = ChatTemplate(load_tokenizer(tiny_model_dir), "llama3").render_prompt(CONVERSATION)
    assert trained_with.startswith("<|start_header_id|>system") and served_prompt(tmp_path / "run" / "final") == \
        trained_with
    assert "fp32" in export(tmp_path / "run" / "checkpoint-2", tmp_path / "model", merge=False, dtype=None,
                            force=False)
    assert served_prompt(tmp_path / "model") == trained_with
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == "float32"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert all(torch.equal(exported[key], final[key]) for key in final)
    export(tmp_path / "run" / "checkpoint-2", tmp_path / "bf16", merge=False, dtype="bf16", force=False)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def tensor_dtypes(folder) -> set[torch.dtype]:
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            dtypes |= {reader.get_tensor(key).dtype for key in reader.keys()}
    return dtypes


def test_a_merge_is_written_in_the_base_models_dtype_unless_told_another(trained, tmp_path):
    """An fp32 base merges to fp32 and a bf16 base to bf16 (config.json's dtype, as LLaMA-Factory exports);
    --dtype overrides; the index's total size is that of the weights written."""
    export(trained / "run", tmp_path / "fp32", merge=True, dtype=None, force=False)
    assert tensor_dtypes(tmp_path / "fp32") == {torch.float32}
    bf16_base = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(trained / "base").to(torch.bfloat16).save_pretrained(
        bf16_base, max_shard_size="60KB")
    assert json.loads((bf16_base / "config.json").read_text())["dtype"] == "bfloat16"
    assert "bf16" in export(trained / "run", tmp_path / "bf16", merge=True, dtype=None, force=False,
                            base_model=str(bf16_base))
    assert tensor_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    export(trained / "run", tmp_path / "fp16", merge=True, dtype="fp16", force=False)
    assert tensor_dtypes(tmp_path / "fp16") == {torch.float16}
    index = json.loads((tmp_path / "fp16" / "model.safetensors.index.json").read_text())
    weights = sum(tensor.numel() * tensor.itemsize for path in (tmp_path / "fp16").glob("*.safetensors")
                  for tensor in load_file(path).values())
    assert index["metadata"]["total_size"] == weights
