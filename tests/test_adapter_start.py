"""Continuing an adapter (`adapter_name_or_path`, LLaMA-Factory's key; Qwen's `--lora_weight_path`): the run
starts from the adapter's weights, with its LoRA settings, alike on one process, under zero3 on two ranks (rank 0
reads, the others receive) and under Q-LoRA (every process reads it as it fills its blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_config, read_metrics
from meshtune.compat.job_config import load_job_config
from meshtune.config import build_config
from meshtune.errors import ConfigError, ModelError
from meshtune.model.loading import load_model
from meshtune.model.lora import add_lora, starting_adapter
from meshtune.train.loop import run

STILL = 1e-12  # a learning rate that leaves the weights as they start (AdamW's first steps move them by about it)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_model_dir, tiny_dataset) -> Path:
    """4 steps of LoRA (r 4, alpha 8, q_proj and v_proj), evaluated at its last step: its final/ is the adapter
    the runs below continue."""
    out = tmp_path_factory.mktemp("first") / "run"
    run(build_config(base_config(tiny_model_dir, tiny_dataset, out, max_steps=4, learning_rate=5e-2, val_size=8,
                                 lora_target=["q_proj", "v_proj"])))
    return out


def continued(tiny_model_dir, tiny_dataset, out: Path, adapter: Path, **extra) -> dict:
    """A run's values continuing `adapter` for one step that changes nothing, evaluated at once."""
    return base_config(tiny_model_dir, tiny_dataset, out, max_steps=1, learning_rate=STILL, val_size=8, eval_steps=1,
                       adapter_name_or_path=str(adapter), lora_rank=4, lora_target=["q_proj", "v_proj"], **extra)


def eval_loss(out: Path) -> float:
    return [record["eval_loss"] for record in read_metrics(out) if "eval_loss" in record][-1]


def assert_same_adapter(a: Path, b: Path) -> None:
    first, second = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=1e-9)


def test_a_run_continuing_an_adapter_starts_at_its_loss(first_run, tmp_path, tiny_model_dir, tiny_dataset):
    out = tmp_path / "continued"
    run(build_config(continued(tiny_model_dir, tiny_dataset, out, first_run / "final")))
    assert_same_adapter(out / "final", first_run / "final")
    assert eval_loss(out) == pytest.approx(eval_loss(first_run), rel=1e-6)
    fresh = tmp_path / "fresh"
    values = continued(tiny_model_dir, tiny_dataset, fresh, first_run / "final")
    del values["adapter_name_or_path"]
    run(build_config(values))
    assert eval_loss(fresh) > eval_loss(first_run) + 0.05, "the first run learned: a new adapter starts higher"


def zero3_job(rank: int, world_size: int, workdir: Path) -> None:
    import os

    from meshtune.train.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what torchrun sets; the process group already exists
    train(build_config(json.loads((workdir / "task.json").read_text())))


@pytest.mark.slow
def test_two_ranks_under_zero3_continue_the_adapter_rank_0_read(first_run, tmp_path, tiny_model_dir, tiny_dataset):
    from ranks import run_ranks

    values = continued(tiny_model_dir, tiny_dataset, tmp_path / "run", first_run / "final", parallel="zero3",
                       per_device_train_batch_size=1)
    (tmp_path / "task.json").write_text(json.dumps(values))
    run_ranks(zero3_job, 2, tmp_path)
    assert_same_adapter(tmp_path / "run" / "final", first_run / "final")
    assert eval_loss(tmp_path / "run") == pytest.approx(eval_loss(first_run), rel=1e-6)


def test_qlora_continues_the_adapter_on_its_quantized_base(first_run, tmp_path, tiny_model_dir, tiny_dataset):
    pytest.importorskip("torchao")
    out = tmp_path / "qlora"
    run(build_config(continued(tiny_model_dir, tiny_dataset, out, first_run / "final", finetuning_type="qlora")))
    assert_same_adapter(out / "final", first_run / "final")


def test_the_adapters_lora_settings_are_the_runs_and_a_given_value_it_replaces_is_named(first_run, tmp_path):
    """As LLaMA-Factory continues an adapter: its r, alpha, dropout and targets, whatever the YAML says."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = json.loads((first_run / "final" / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 16, "lora_alpha": 32,
                                                              "lora_dropout": 0.05}))
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"model_name_or_path: /m\ndataset: d.json\nfinetuning_type: lora\nlora_rank: 8\n"
                         f"lora_target: all\nadapter_name_or_path: {adapter}\n")
    loaded = load_job_config(yaml_file)
    cfg = loaded.config
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target) == (16, 32, 0.05, ["q_proj", "v_proj"])
    assert loaded.warnings == [f"lora_rank: 8 is replaced by the adapter's own 16: the run continues {adapter} as "
                               f"it was trained, as LLaMA-Factory does"]
    flags = load_job_config(None, flags={"model_name_or_path": "/m", "data_path": "d.json", "use_lora": True,
                                         "lora_r": 16, "lora_weight_path": str(adapter)}).config
    assert (flags.adapter_name_or_path, flags.lora_rank, flags.lora_alpha) == (str(adapter), 16, 32)


@pytest.mark.parametrize("change, error", [
    ({"use_dora": True}, r"has use_dora: true, which meshtune's LoRA does not compute"),
    ({"modules_to_save": "lm_head"}, r"has modules_to_save: \"lm_head\"; meshtune continues a list of module names"),
    ({"target_modules": ".*q_proj"}, r"selects its target_modules by the pattern"),
    ({"target_modules": None}, r"names no target_modules"),
    ({"init_lora_weights": "pissa"}, r"init_lora_weights: \"pissa\" \(its base is a changed copy"),
    ({"peft_type": "IA3"}, r"is a IA3 adapter; meshtune continues LoRA adapters only"),
])
def test_an_adapter_meshtune_cannot_continue_is_refused_naming_why(first_run, tmp_path, change, error):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = json.loads((first_run / "final" / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=error):
        load_job_config(None, ["model_name_or_path=/m", "dataset=d.json", f"adapter_name_or_path={adapter}"])


def test_several_adapters_a_missing_one_and_full_fine_tuning_are_refused(first_run, tmp_path):
    final = first_run / "final"
    with pytest.raises(ConfigError, match=r"2 adapters .* meshtune continues one. Merge the others into the base"):
        load_job_config(None, ["model_name_or_path=/m", "dataset=d.json", f"adapter_name_or_path={final},{final}"])
    with pytest.raises(ConfigError, match=r"adapter_config.json not found; give a PEFT LoRA adapter directory"):
        load_job_config(None, ["model_name_or_path=/m", "dataset=d.json", f"adapter_name_or_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"finetuning_type: full does not train; continue it with finetuning_type"):
        load_job_config(None, ["model_name_or_path=/m", "dataset=d.json", "finetuning_type=full",
                               f"adapter_name_or_path={final}"])


def test_an_adapter_that_does_not_fit_the_run_is_named(first_run, tmp_path, tiny_model_dir, tiny_dataset):
    """A config built without reading the adapter (the Python API) that disagrees with it is stopped by name."""
    values = continued(tiny_model_dir, tiny_dataset, tmp_path / "o", first_run / "final")
    model = add_lora(load_model(tiny_model_dir), build_config({**values, "lora_target": ["q_proj", "k_proj"]}))
    with pytest.raises(ModelError, match=r"does not fit the run's LoRA layers: it lacks .*k_proj.lora_A.weight"):
        starting_adapter(model, build_config({**values, "lora_target": ["q_proj", "k_proj"]}))
    with pytest.raises(ModelError, match=r"the run's lora_rank 8 \(the adapter's is 4\)"):
        starting_adapter(model, build_config({**values, "lora_rank": 8}))


def test_the_demos_adapter_continues_at_its_last_evaluation_loss(tmp_path, capfd):
    """`meshtune demo`'s config (lora_target: all, whose adapter peft writes with every layer's module path),
    shortened: the run continuing its final/ evaluates, on the same held-out samples, to the loss it ended at."""
    from conftest import run_cli_here

    work = tmp_path / "demo"
    assert run_cli_here(["demo", "--prepare", str(work)], capfd).returncode == 0
    config = work / "config.yaml"
    short = ["nproc_per_node=1", "max_steps=4", "eval_steps=4", "logging_steps=1"]
    first = run_cli_here(["train", str(config), *short], capfd)
    assert first.returncode == 0, first.stdout[-3000:]
    written = work / "output"
    targets = json.loads((written / "final" / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.mlp.down_proj" in targets  # full module paths, as peft writes all-linear
    again = tmp_path / "again"
    result = run_cli_here(["train", str(config), "nproc_per_node=1", "max_steps=1", f"learning_rate={STILL}",
                           f"adapter_name_or_path={written / 'final'}", f"output_dir={again}"], capfd)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "LoRA continues the adapter" in result.stdout
    assert eval_loss(again) == pytest.approx(eval_loss(written), rel=1e-6)
    assert_same_adapter(again / "final", written / "final")


def test_a_qwen_flags_adapter_continues_with_its_embedding_and_head(tmp_path, tiny_model_dir, capfd, monkeypatch):
    """finetune.py's flags on a base model (its path does not say "chat"): the adapter trains the embedding and the
    head in full (peft's modules_to_save: embed_tokens, lm_head). --lora_weight_path continues all of it."""
    from conftest import run_cli_here

    data = Path(__file__).parent / "fixtures" / "compat" / "qwen" / "train.json"
    monkeypatch.chdir(tmp_path)
    flags = ["--model_name_or_path", str(tiny_model_dir), "--data_path", str(data), "--eval_data_path", str(data),
             "--use_lora", "--model_max_length", "128", "--per_device_train_batch_size", "1",
             "--gradient_accumulation_steps", "2", "--report_to", "none", "--seed", "7"]
    written = tmp_path / "written"
    first = run_cli_here(["train", *flags, "--learning_rate", "5e-3", "--max_steps", "2", "--save_steps", "2",
                          "--output_dir", str(written)], capfd)
    assert first.returncode == 0, first.stdout[-3000:]
    assert json.loads((written / "final" / "adapter_config.json").read_text())["modules_to_save"] == [
        "embed_tokens", "lm_head"]
    again = tmp_path / "again"
    result = run_cli_here(["train", *flags, "--learning_rate", str(STILL), "--max_steps", "1",
                           "--lora_weight_path", str(written / "final"), "--output_dir", str(again)], capfd)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "is replaced by the adapter's own" not in result.stdout  # finetune.py's defaults are the adapter's
    assert eval_loss(again) == pytest.approx(eval_loss(written), rel=1e-6)
    assert_same_adapter(again / "final", written / "final")
    # the same adapter as `meshtune export` writes it from the run's last checkpoint
    exported = tmp_path / "exported"
    assert run_cli_here(["export", str(written / "checkpoint-2"), "--output", str(exported)], capfd).returncode == 0
    from_export = tmp_path / "from-export"
    result = run_cli_here(["train", *flags, "--learning_rate", str(STILL), "--max_steps", "1",
                           "--lora_weight_path", str(exported), "--output_dir", str(from_export)], capfd)
    assert result.returncode == 0, result.stdout[-3000:]
    assert eval_loss(from_export) == pytest.approx(eval_loss(written), rel=1e-6)


def test_a_llamafactory_adapter_continues_from_its_leaf_names_and_modules_to_save(first_run, tmp_path,
                                                                                  tiny_model_dir, tiny_dataset):
    """LLaMA-Factory writes target_modules as leaf names and modules_to_save as its additional_target gives them."""
    from peft import LoraConfig, get_peft_model

    adapter = tmp_path / "lf"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(load_model(tiny_model_dir), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:  # a trained adapter: B and the head's copy moved
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    model.save_pretrained(adapter)
    cfg = load_job_config(None, ["model_name_or_path=" + str(tiny_model_dir), "dataset=d.json",
                                 f"adapter_name_or_path={adapter}"]).config
    assert (cfg.lora_target, cfg.additional_target) == (["q_proj", "v_proj"], ["lm_head"])
    out = tmp_path / "continued"
    run(build_config(continued(tiny_model_dir, tiny_dataset, out, adapter, additional_target=["lm_head"],
                               lora_alpha=8)))
    assert_same_adapter(out / "final", adapter)
