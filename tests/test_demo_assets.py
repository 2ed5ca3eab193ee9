"""The demo's assets: everything `meshtune demo` trains on must be built locally, loadable and reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshtune.compat.job_config import load_config
from meshtune.demo.assets import (DEMO_TRAINING, build_tiny_model, demo_layout, generate_answers, heldout_examples,
                                  prepare, write_task_dataset)
from meshtune.demo.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    prepare(out, seed=0)
    return out


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_writes_a_loadable_qwen2_model_and_tokenizer(demo_dir):
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model", local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert not model.config.tie_word_embeddings
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert (demo_dir / "model" / "model.safetensors").is_file()


def test_datasets_are_messages_with_disjoint_heldout_prompts(demo_dir):
    train = read_jsonl(demo_dir / "data" / "train.jsonl")
    heldout = read_jsonl(demo_dir / "data" / "heldout.jsonl")
    for row in train + heldout:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][1]["content"] in {"positive", "negative"}
    prompts = {row["messages"][0]["content"] for row in train}
    assert len(prompts) == len(train)
    assert not prompts & {row["messages"][0]["content"] for row in heldout}
    expected = [(row["messages"][0]["content"], row["messages"][1]["content"]) for row in heldout]
    assert heldout_examples(demo_dir / "data" / "heldout.jsonl") == expected
    assert {answer for _, answer in expected} == {"positive", "negative"}


def test_config_has_absolute_paths_and_validates(demo_dir):
    values = yaml.safe_load((demo_dir / "config.yaml").read_text())
    for key in ("model_name_or_path", "dataset", "output_dir"):
        assert Path(values[key]).is_absolute()
    assert Path(values["model_name_or_path"]) == demo_dir.resolve() / "model"
    assert Path(values["dataset"]) == demo_dir.resolve() / "data" / "train.jsonl"
    assert Path(values["output_dir"]) == demo_dir.resolve() / "output"
    assert (demo_dir / "config.yaml").read_text().startswith("#")
    config = load_config(demo_dir / "config.yaml")
    assert (config.finetuning_type, config.nproc_per_node, config.parallel) == ("lora", 2, "ddp")


def test_the_demo_fits_its_processes_to_the_machine_and_keeps_its_global_batch():
    """2 processes on CPU and on 2 GPUs or more; on one GPU one process that accumulates two micro-batches, so that
    every step trains on the same 16 samples."""
    def global_batch(layout: dict) -> int:
        return DEMO_TRAINING["per_device_train_batch_size"] * layout["nproc_per_node"] * \
            layout["gradient_accumulation_steps"]

    assert demo_layout(0) == demo_layout(2) == demo_layout(8) == {"nproc_per_node": 2,
                                                                  "gradient_accumulation_steps": 1}
    assert demo_layout(1) == {"nproc_per_node": 1, "gradient_accumulation_steps": 2}
    assert {global_batch(demo_layout(gpus)) for gpus in (0, 1, 2, 8)} == {16}


def test_the_config_prepared_for_a_one_gpu_machine_runs_one_process(tmp_path):
    config = load_config(prepare(tmp_path, seed=0, gpus=1))
    assert (config.nproc_per_node, config.gradient_accumulation_steps) == (1, 2)


def test_prepare_is_deterministic_for_a_seed(demo_dir, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    prepare(again, seed=0)
    prepare(other, seed=1)
    first, second = files_of(demo_dir), files_of(again)
    config = first.pop("config.yaml").decode().replace(str(demo_dir.resolve()), "DIR")
    assert second.pop("config.yaml").decode().replace(str(again.resolve()), "DIR") == config
    assert first == second
    third = files_of(other)
    assert third["model/model.safetensors"] != first["model/model.safetensors"]
    assert third["data/train.jsonl"] != first["data/train.jsonl"]


def test_build_tiny_model_takes_overrides_and_leaves_the_global_rng_alone(tmp_path):
    tokenizer = train_tokenizer(["a few words to learn a tokenizer from, and a few more"], vocab_size=300)
    state = torch.random.get_rng_state()
    path = build_tiny_model(tokenizer, tmp_path / "m", seed=3, hidden_size=32, intermediate_size=64)
    assert torch.equal(torch.random.get_rng_state(), state)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (32, 64, len(tokenizer))


def test_write_task_dataset_sizes(tmp_path):
    train, heldout = write_task_dataset(tmp_path, seed=5, n_train=30, n_heldout=6)
    assert (len(read_jsonl(train)), len(read_jsonl(heldout))) == (30, 6)


def test_generate_answers_returns_strings_for_plain_and_peft_models(demo_dir):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model", local_files_only=True)
    prompts = [prompt for prompt, _ in heldout_examples(demo_dir / "data" / "heldout.jsonl")[:3]]
    model.train()
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens=4)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    assert model.training, "the train/eval mode is restored"
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert generate_answers(peft_model, tokenizer, prompts, max_new_tokens=4) == answers  # LoRA B starts at 0


class Scripted(torch.nn.Module):
    """Answers with a fixed token sequence whatever the input, to check decoding and stopping."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.prompt_len: int | None = None

    def forward(self, input_ids):
        self.prompt_len = self.prompt_len or input_ids.shape[1]
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, self.script[input_ids.shape[1] - self.prompt_len]] = 1.0
        return type("Output", (), {"logits": logits})


def test_generate_answers_stops_at_im_end(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model", local_files_only=True)
    answer = tokenizer("positive", add_special_tokens=False).input_ids
    script = answer + [tokenizer.eos_token_id] + answer
    assert generate_answers(Scripted(script, len(tokenizer)), tokenizer, ["hi"], max_new_tokens=8) == ["positive"]
    cut = generate_answers(Scripted(script, len(tokenizer)), tokenizer, ["hi"], max_new_tokens=1)
    assert cut == [tokenizer.decode(answer[:1])]
