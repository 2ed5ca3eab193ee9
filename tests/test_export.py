"""The saved final/ loads back with transformers / peft and gives the trained model's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import base_config
from meshtune.checkpoint import CheckpointError, verify
from meshtune.config import build_config
from meshtune.data.chat_template import render_chatml
from meshtune.errors import MeshtuneError
from meshtune.model.final_weights import export_kind, verify_export
from meshtune.model.parallel import unwrap
from meshtune.train.loop import run


def probe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("method", ["lora", "full"])
def test_final_dir_reloads_with_the_trained_logits(tmp_path, tiny_model_dir, tiny_dataset, method):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", finetuning_type=method,
                                   max_steps=3, learning_rate=1e-2, val_size=4, plot_loss=True))
    result = run(cfg, keep_model=True)
    final = result.final_dir
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    trained = probe_logits(unwrap(result.model), ids)
    base = probe_logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids)
    assert not torch.allclose(trained, base, atol=1e-4), "training changed nothing"

    if method == "lora":
        assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
        adapter_cfg = json.loads((final / "adapter_config.json").read_text())
        assert adapter_cfg["r"] == 4 and adapter_cfg["peft_type"] == "LORA"
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(final))
    else:
        assert (final / "config.json").is_file() and any(final.glob("*.safetensors"))
        reloaded = AutoModelForCausalLM.from_pretrained(str(final))
    torch.testing.assert_close(probe_logits(reloaded, ids), trained, rtol=1e-5, atol=1e-5)
    served = AutoTokenizer.from_pretrained(str(final))
    assert served.pad_token_id is not None
    conversation = [{"role": "user", "content": "the quick fox"}]  # trained with the built-in ChatML: served so
    assert served.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        render_chatml(conversation, add_generation_prompt=True)

    kind = "PEFT adapter" if method == "lora" else "Hugging Face model"
    assert verify_export(final) == [] and export_kind(final) == kind
    assert verify(final) == [] and (final / "COMPLETE").is_file()  # sealed, and loadable as it is (above)
    weights = next(final.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-10])
    assert verify_export(final) == [f"{weights.name} is truncated: {weights.stat().st_size:,} bytes, its header "
                                    f"describes {weights.stat().st_size + 10:,}"]

    out = tmp_path / "out"
    assert (out / "config.yaml").is_file() and (out / "loss.png").stat().st_size > 1000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "eval_loss" in records[-1]
    for key in ("epoch", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "peak_mem_gib"):
        assert key in records[0]


def test_save_final_false_writes_no_model_and_says_so(tmp_path, tiny_model_dir, tiny_dataset, capsys):
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2, save_final=False,
                                   logging_steps=5))
    result = run(cfg)
    assert result.final_dir is None and not (tmp_path / "out" / "final").exists()
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
    out = capsys.readouterr().out
    assert "saved          nothing (save_final: false)" in out
    assert "train loss     " in out and "(one logged step)" in out and " -> " not in out.split("train loss")[1]


def test_ckpt_verify_knows_a_final_export_from_a_checkpoint(tmp_path, tiny_model_dir, capfd):
    """`ckpt verify` on final/ says what it is and checks its files, instead of 'no COMPLETE marker'."""
    import shutil

    from conftest import run_cli_here

    final = tmp_path / "final"
    shutil.copytree(tiny_model_dir, final)
    result = run_cli_here(["ckpt", "verify", str(final)], capfd)
    assert result.returncode == 0 and "a final export (Hugging Face model), not a checkpoint: valid" in result.stdout
    (final / "model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{x")
    result = run_cli_here(["ckpt", "verify", str(final)], capfd)
    assert result.returncode == 1 and "model.safetensors is not a readable safetensors file" in result.stdout
    staged = tmp_path / "out" / "final.tmp"  # what a final save killed before it sealed and renamed final/ leaves
    shutil.copytree(tiny_model_dir, staged)
    result = run_cli_here(["ckpt", "verify", str(staged)], capfd)
    assert result.returncode == 1 and "INVALID" in result.stdout and "final.tmp/ is final/ being written, or left " \
        "by a writer that died" in result.stdout


def dies_midway(model, weights, tokenizer, directory, chat_template):
    """The final save of a process killed after the weights, before the tokenizer."""
    unwrap(model).save_pretrained(str(directory), state_dict=weights, safe_serialization=True)
    raise OSError("killed while writing")


def test_final_appears_only_complete_and_export_falls_back_to_the_newest_checkpoint(tmp_path, tiny_model_dir,
                                                                                      tiny_dataset, monkeypatch,
                                                                                      capfd):
    import meshtune.train.loop as loop
    from conftest import run_cli_here
    from meshtune.export.merge import export

    out = tmp_path / "out"
    cfg = build_config(base_config(tiny_model_dir, tiny_dataset, out, max_steps=4, save_steps=2))
    real = loop.save_final
    monkeypatch.setattr(loop, "save_final", dies_midway)
    with pytest.raises(CheckpointError, match=r"writing the trained model failed, so .*final was not written: "
                                              r"killed while writing"):
        run(cfg)
    assert not (out / "final").exists() and not (out / "final.tmp").exists()

    notes = []
    (out / "final.tmp").mkdir()  # what a writer killed outright leaves
    (out / "final.tmp" / "adapter_model.safetensors").write_bytes(b"half")
    export(out, tmp_path / "e1", merge=False, dtype=None, force=False, note=notes.append)
    assert notes == [f"meshtune: {out} has no final/: exporting checkpoint-4, the newest complete checkpoint"]
    (out / "final").mkdir()  # a final/ written in place and cut short: weights and README, no config, no marker
    (out / "final" / "README.md").write_text("x")
    shutil.copy(out / "final.tmp" / "adapter_model.safetensors", out / "final")
    export(out, tmp_path / "e2", merge=False, dtype=None, force=False, note=notes.append)
    assert notes[1].startswith(f"meshtune: {out / 'final'} is incomplete (no COMPLETE marker") and \
        notes[1].endswith("exporting checkpoint-4, the newest complete checkpoint")
    shutil.rmtree(out / "final")

    monkeypatch.setattr(loop, "save_final", real)
    assert run(cfg).final_dir == out / "final"  # the rerun resumes at step 4 and writes final/ again
    assert verify(out / "final") == [] and not (out / "final.tmp").exists()
    result = run_cli_here(["ckpt", "verify", str(out / "final")], capfd)
    assert result.returncode == 0 and "a final export (PEFT adapter), not a checkpoint: valid (COMPLETE, every " \
        "file's size and sha256 match manifest.json" in result.stdout
    notes.clear()
    assert f"in {tmp_path / 'e3'}" in export(out, tmp_path / "e3", merge=False, dtype=None, force=False,
                                             note=notes.append)
    assert notes == []  # final/ itself

    first = (out / "final").stat().st_ino
    monkeypatch.setattr(loop, "save_final", dies_midway)
    with pytest.raises(CheckpointError, match=r"so .*final keeps the previous run's model"):
        run(cfg)
    assert (out / "final").stat().st_ino == first and verify(out / "final") == []
    monkeypatch.setattr(loop, "save_final", real)
    run(cfg)
    assert (out / "final").stat().st_ino != first and verify(out / "final") == []
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("final")) == ["final"]

    weights = out / "final" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(data)
    result = run_cli_here(["ckpt", "verify", str(out / "final")], capfd)
    assert result.returncode == 1 and "INVALID" in result.stdout
    assert "  - checksum mismatch in adapter_model.safetensors" in result.stdout
    with pytest.raises(MeshtuneError, match="does not verify .checksum mismatch in adapter_model.safetensors"):
        export(out, tmp_path / "e4", merge=False, dtype=None, force=False)
