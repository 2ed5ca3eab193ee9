"""A model folder with code of its own (config.json / tokenizer_config.json `auto_map`, as Qwen(1)'s Qwen-7B-Chat has):
every command that would load it refuses it by name before anything loads it, never asks "Do you wish to run the
custom code?" (here stdin would answer y), and no file of the folder is imported (each writes a marker file first)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import base_config, run_cli_here, write_config
from meshtune.errors import ModelError
from meshtune.model.custom_code import refuse_custom_code

MODULES = {"configuration_qwen.py": "QWenConfig", "modeling_qwen.py": "QWenLMHeadModel",
           "tokenization_qwen.py": "QWenTokenizer"}
CODE = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig


class {name}(PretrainedConfig):
    model_type = "qwen"
"""


@pytest.fixture
def custom_code_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny model, dressed as Qwen-7B-Chat: model_type qwen, its classes in Python files of the folder."""
    folder = tmp_path / "Qwen-7B-Chat"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="qwen", architectures=["QWenLMHeadModel"],
                  auto_map={"AutoConfig": "configuration_qwen.QWenConfig",
                            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"})
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for module, name in MODULES.items():
        (folder / module).write_text(CODE.format(marker=str(tmp_path / f"ran-{module}"), name=name))
    return folder


def markers(tmp_path: Path) -> list[str]:
    return sorted(path.name for path in tmp_path.glob("ran-*"))


def assert_refused(result, folder: Path, tmp_path: Path) -> None:
    assert result.returncode != 0, result.stdout
    assert f"{folder} is a custom-code model (config.json auto_map: AutoConfig -> configuration_qwen.QWenConfig, " \
           "AutoModelForCausalLM -> modeling_qwen.QWenLMHeadModel; tokenizer_config.json auto_map: AutoTokenizer " \
           "-> tokenization_qwen.QWenTokenizer)" in result.stdout
    assert "Qwen1.5 (Qwen/Qwen1.5-7B-Chat for Qwen-7B-Chat)" in result.stdout
    assert "Do you wish to run the custom code" not in result.stdout
    assert "Traceback" not in result.stdout
    assert markers(tmp_path) == []


@pytest.fixture
def answers_yes(monkeypatch):
    """stdin answers "y" to any question, as a user at a terminal might."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 20))


@pytest.mark.parametrize("command", ["train", "preview", "doctor"])
def test_a_custom_code_model_is_refused_before_anything_loads_it(custom_code_dir, tiny_dataset, tmp_path, capfd,
                                                                 answers_yes, command):
    config = write_config(tmp_path, **base_config(custom_code_dir, tiny_dataset, tmp_path / "out"))
    assert_refused(run_cli_here([command, str(config)], capfd), custom_code_dir, tmp_path)


def test_qwen_flags_on_qwen_7b_chat_are_refused(custom_code_dir, tiny_dataset, tmp_path, capfd, answers_yes,
                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli_here(["train", "--model_name_or_path", str(custom_code_dir), "--data_path", str(tiny_dataset),
                           "--use_lora", "True", "--trust_remote_code", "True", "--output_dir", str(tmp_path / "out")],
                          capfd)
    assert_refused(result, custom_code_dir, tmp_path)


def test_chat_refuses_a_custom_code_model(custom_code_dir, tmp_path, capfd, answers_yes):
    assert_refused(run_cli_here(["chat", str(custom_code_dir)], capfd), custom_code_dir, tmp_path)


def test_export_refuses_a_custom_code_base(custom_code_dir, tiny_model_dir, tmp_path, capfd, answers_yes):
    from peft import LoraConfig, get_peft_model

    from meshtune.model.loading import load_model

    adapter = tmp_path / "adapter"
    get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    result = run_cli_here(["export", str(adapter), "--output", str(tmp_path / "merged"), "--merge", "--base-model",
                           str(custom_code_dir)], capfd)
    assert_refused(result, custom_code_dir, tmp_path)
    assert not (tmp_path / "merged").exists()


def test_loads_never_run_a_folders_code_even_past_the_check(custom_code_dir, tmp_path, answers_yes, monkeypatch):
    """Every load passes trust_remote_code=False: with the check out of the way, transformers refuses the model by
    itself (the tokenizer loads from tokenizer.json, without the folder's class), and asks nothing."""
    from meshtune.model import loading, model_dir

    monkeypatch.setattr(loading, "refuse_custom_code", lambda *args, **kwargs: None)
    monkeypatch.setattr(model_dir, "refuse_custom_code", lambda *args, **kwargs: None)
    for load in (loading.model_skeleton, loading.load_model):
        with pytest.raises((ValueError, OSError, ModelError)):
            load(custom_code_dir)
    model_dir.load_tokenizer(custom_code_dir)
    assert markers(tmp_path) == []


def test_a_model_without_an_auto_map_passes(tiny_model_dir):
    refuse_custom_code(tiny_model_dir)
