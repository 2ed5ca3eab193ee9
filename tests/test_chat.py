"""`meshtune chat`: the demo's trained model answers held-out prompts through stdin, from every form meshtune saves
it in, with the conversation's history in each prompt; what it cannot load is named with the fix."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import base_config, run_cli_here, write_config
from meshtune.cli import main
from meshtune.demo.dataset import heldout_examples
from meshtune.export.chat import ChatOptions, run_chat

SHOWN = 6  # held-out prompts asked in each test


@pytest.fixture(scope="module")
def trained_demo(tmp_path_factory) -> dict:
    """`meshtune demo` run through, its training in this process: one process with the accumulation doubled trains
    the same global batches as the demo's two (tests/test_demo.py holds the two to the same losses), plus a
    checkpoint at the last step. Its stdout, directory and held-out (prompt, answer) pairs.

    One thread, as each demo process has: two intra-op threads on two busy cores make the training ten times slower.
    """
    work = tmp_path_factory.mktemp("demo")

    def train_here(cfg, argv, **_):
        return main([*argv, "nproc_per_node=1", "gradient_accumulation_steps=2", "save_steps=1000"])

    out, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
            patch.setattr("meshtune.launch.supervise.launch_training", train_here)
            assert main(["demo", "--dir", str(work)]) == 0
    finally:
        torch.set_num_threads(threads)
    return {"stdout": out.getvalue(), "dir": work, "examples": heldout_examples(work / "data" / "heldout.jsonl")}


def chat(args: list[str], stdin: str, capfd, monkeypatch) -> tuple[int, str, str]:
    """`meshtune chat ARGS` in this process with `stdin` piped in: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capfd.readouterr()
    code = main(["chat", *args])
    out, err = capfd.readouterr()
    return code, out, err


def one_at_a_time(prompts: list[str]) -> str:
    """Each prompt in a conversation of its own, as the demo trained them."""
    return "".join(f"{prompt}\n/reset\n" for prompt in prompts)


def asked(trained_demo: dict) -> tuple[list[str], list[str]]:
    examples = trained_demo["examples"][:SHOWN]
    assert {answer for _, answer in examples} == {"positive", "negative"}
    return [prompt for prompt, _ in examples], [answer for _, answer in examples]


def test_the_demo_names_the_command_and_it_answers_held_out_prompts(trained_demo, capfd, monkeypatch):
    match = re.search(r"held-out accuracy .*: before (\d+)%, after (\d+)%", trained_demo["stdout"])
    assert match and int(match.group(2)) >= 80, trained_demo["stdout"][-2000:]
    command = re.search(r"talk to it: +meshtune chat (\S+)", trained_demo["stdout"])
    assert command, trained_demo["stdout"][-1000:]
    assert Path(command.group(1)) == trained_demo["dir"] / "output"
    prompts, answers = asked(trained_demo)
    code, out, err = chat([command.group(1)], one_at_a_time(prompts), capfd, monkeypatch)
    assert code == 0, err[-2000:]
    assert out.splitlines() == answers, (out, err[-2000:])


def test_each_prompt_holds_the_conversation_so_far(trained_demo, capfd, monkeypatch):
    (first, _), (second, _), (third, _) = trained_demo["examples"][:3]
    code, out, err = chat([str(trained_demo["dir"] / "output" / "final"), "--system", "Answer in one word.",
                           "--show-prompt"], f"{first}\n{second}\n/reset\n{third}\n", capfd, monkeypatch)
    assert code == 0, err[-2000:]
    replies = out.splitlines()
    assert len(replies) == 3 and all(replies), out
    prompts = re.findall(r"--- prompt ---\n(.*?)\n--- end of prompt ---", err, re.S)
    system = "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    assert prompts == [
        f"{system}<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n",
        f"{system}<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n{replies[0]}<|im_end|>\n"
        f"<|im_start|>user\n{second}<|im_end|>\n<|im_start|>assistant\n",
        f"{system}<|im_start|>user\n{third}<|im_end|>\n<|im_start|>assistant\n",  # /reset keeps the system prompt
    ]


def test_on_a_terminal_it_greets_and_stops_at_exit(trained_demo, capsys):
    (first, expected), (second, _) = trained_demo["examples"][:2]
    code = run_chat(trained_demo["dir"] / "output", ChatOptions(), [first, "/exit", second], interactive=True)
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("meshtune chat: the adapter in "), out
    assert "chat template: the one saved with it" in lines[0], out
    assert "/reset starts a new conversation, /exit or Ctrl-D ends it" in lines[1]
    assert lines[2:] == [f"Assistant: {expected}"], out  # nothing after /exit


def test_an_adapter_on_its_base_and_the_exports_answer_alike(trained_demo, capfd, monkeypatch, tmp_path):
    demo, (prompts, answers) = trained_demo["dir"], asked(trained_demo)
    for form in ("adapter", "merged"):
        result = run_cli_here(["export", str(demo / "output"), "--output", str(tmp_path / form),
                               *(["--merge"] if form == "merged" else [])], capfd)
        assert result.returncode == 0, result.stdout
    for args in ([str(demo / "model"), "--adapter", str(demo / "output" / "final")],
                 [str(demo / "model"), "--adapter", str(demo / "output")],
                 [str(tmp_path / "adapter")], [str(tmp_path / "merged")]):
        code, out, err = chat(args, one_at_a_time(prompts), capfd, monkeypatch)
        assert code == 0, (args, err[-2000:])
        assert out.splitlines() == answers, (args, out)


def test_an_output_dir_without_final_answers_from_its_newest_checkpoint(trained_demo, capfd, monkeypatch, tmp_path):
    output = tmp_path / "output"
    shutil.copytree(trained_demo["dir"] / "output" / "checkpoint-180", output / "checkpoint-180")
    prompts, answers = asked(trained_demo)
    code, out, err = chat([str(output)], one_at_a_time(prompts), capfd, monkeypatch)
    assert code == 0, err[-2000:]
    assert f"{output} has no final/: exporting checkpoint-180" in err
    assert out.splitlines() == answers, (out, err[-2000:])


def test_a_full_fine_tuning_checkpoint_answers_as_its_final_model(tiny_model_dir, tiny_dataset, tmp_path, capfd,
                                                                  monkeypatch):
    output = tmp_path / "full"
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, output, finetuning_type="full",
                                                  max_steps=2, save_steps=2))
    assert run_cli_here(["train", str(config)], capfd).returncode == 0
    prompts = "the quick fox\n/reset\nseven small birds\n"
    code, from_final, err = chat([str(output / "final"), "--max-new-tokens", "5"], prompts, capfd, monkeypatch)
    assert code == 0, err[-2000:]
    shutil.rmtree(output / "final")
    code, from_checkpoint, err = chat([str(output), "--max-new-tokens", "5"], prompts, capfd, monkeypatch)
    assert code == 0, err[-2000:]
    assert "exporting checkpoint-2" in err
    assert len(from_final.splitlines()) == 2 and from_checkpoint == from_final


def test_what_cannot_be_loaded_is_named_with_the_fix(trained_demo, capfd, monkeypatch, tmp_path):
    demo = trained_demo["dir"]
    (prompt, answer), = trained_demo["examples"][:1]

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    code, _, err = chat([str(tmp_path / "notes")], prompt, capfd, monkeypatch)
    assert code == 1 and "is none of what meshtune chat loads" in err and "adapter_config.json" in err, err

    code, _, err = chat([str(tmp_path / "missing")], prompt, capfd, monkeypatch)
    assert code == 1 and "does not exist" in err, err

    # the demo's base model was never trained on a conversation: its tokenizer has no template
    code, _, err = chat([str(demo / "model")], prompt, capfd, monkeypatch)
    assert code == 1 and "has no chat template" in err and "--template NAME" in err and "chatml" in err, err
    code, out, err = chat([str(demo / "model"), "--template", "chatml", "--max-new-tokens", "3"], prompt, capfd,
                          monkeypatch)
    assert code == 0 and len(out.splitlines()) == 1, err[-2000:]

    moved = tmp_path / "adapter"
    shutil.copytree(demo / "output" / "final", moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    code, _, err = chat([str(moved)], prompt, capfd, monkeypatch)
    assert code == 1 and "base model of the adapter" in err and "pass --base DIR" in err, err
    code, out, err = chat([str(moved), "--base", str(demo / "model")], prompt, capfd, monkeypatch)
    assert code == 0 and out.splitlines() == [answer], err[-2000:]

    code, _, err = chat([str(demo / "output" / "final"), "--adapter", str(moved)], prompt, capfd, monkeypatch)
    assert code == 1 and "DIR is the base model" in err, err


def test_the_options_decide_the_answer_also_through_an_adapter(trained_demo, capfd, monkeypatch, tmp_path):
    """An adapter that changes nothing (LoRA's B starts at zero) on the untrained base: its answers run to
    --max-new-tokens, the greedy one a prefix of the longer; sampled answers differ from it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = trained_demo["dir"] / "model"
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(str(tmp_path / "a"))
    prompts = "".join(f"{prompt}\n/reset\n" for prompt, _ in trained_demo["examples"][:4])

    def answers(*options: str) -> list[str]:
        code, out, err = chat([str(base), "--adapter", str(tmp_path / "a"), "--template", "chatml", *options],
                              prompts, capfd, monkeypatch)
        assert code == 0, err[-2000:]
        return out.splitlines()

    short, long = answers("--max-new-tokens", "3"), answers("--max-new-tokens", "12")
    assert len(short) == len(long) == 4
    assert all(len(s) < len(g) and g.startswith(s) for s, g in zip(short, long)), (short, long)
    assert answers("--max-new-tokens", "12", "--temperature", "1.5", "--top-p", "0.95") != long


def test_options_out_of_range_are_refused(trained_demo, capfd, monkeypatch):
    final = str(trained_demo["dir"] / "output" / "final")
    for option, words in ((["--temperature", "-1"], "not below 0"), (["--top-p", "0"], "--top-p 0.0"),
                          (["--max-new-tokens", "0"], "at least 1 token"),
                          (["--template", "nope"], "chatml, tokenizer"), (["--device", "nowhere"], "not a device")):
        code, _, err = chat([final, *option], "hi\n", capfd, monkeypatch)
        assert code == 1 and words in err, (option, err)
