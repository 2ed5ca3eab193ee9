"""Jobs brought from other tools run as they are: LLaMA-Factory YAMLs, DeepSpeed JSONs, Qwen's finetune.py flags.

Each test runs on the repo's own fixtures (tests/fixtures/compat, written in each tool's format) and, where the
real files are present in ../shared/compat, on those too.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import read_metrics, run_cli_here
from meshtune.compat.deepspeed import translate_deepspeed
from meshtune.compat.flags import split_flags
from meshtune.compat.foreign import FAMILIES, FOREIGN, foreign_handler
from meshtune.compat.job_config import load_job_config
from meshtune.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "compat"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "compat"
SOURCES = [pytest.param(FIXTURES, id="fixtures"),
           pytest.param(SHARED, id="shared", marks=pytest.mark.skipif(
               not SHARED.is_dir(), reason=f"{SHARED} is absent (it is not part of a clone)"))]


def llamafactory_tree(source: Path, into: Path) -> Path:
    """A LLaMA-Factory checkout's layout (examples/train_*/x.yaml, examples/deepspeed/*.json, data/), from which
    its YAMLs are run unchanged; `source` holds them in that layout (fixtures) or flat (the shared copies)."""
    lf = source / "llamafactory"
    (into / "examples" / "train").mkdir(parents=True)
    shutil.copytree(lf / "data", into / "data")
    shutil.copytree(lf / "examples" / "deepspeed" if (lf / "examples" / "deepspeed").is_dir() else lf / "examples",
                    into / "examples" / "deepspeed", ignore=shutil.ignore_patterns("*.yaml", "train", "accelerate"))
    for yaml_file in lf.glob("examples/**/*.yaml"):
        shutil.copy(yaml_file, into / "examples" / "train" / yaml_file.name)
    return into


def ds_files(source: Path) -> dict[str, Path]:
    return {path.name: path for path in [*(source / "llamafactory").glob("examples/**/ds_*.json"),
                                          *(source / "qwen").glob("ds_*.json")]}


# ---- DeepSpeed JSON

@pytest.mark.parametrize("source", SOURCES)
def test_every_deepspeed_file_translates_to_its_parallel_mode(source):
    expected = {"ds_z0_config.json": ("ddp", None), "ds_z2_config.json": ("zero2", None),
                "ds_z2_offload_config.json": ("zero2", True), "ds_z3_config.json": ("zero3", None),
                "ds_z3_offload_config.json": ("zero3", True), "ds_config_zero2.json": ("zero2", None),
                "ds_config_zero3.json": ("zero3", None)}
    files = ds_files(source)
    assert set(files) == set(expected)
    for name, path in files.items():
        out = translate_deepspeed(json.loads(path.read_text()), name, {}, {})
        assert out.problems == [], name
        assert (out.values["parallel"], out.values.get("cpu_offload")) == expected[name], name
        assert "fp16.loss_scale" in out.unhonoured, name
        assert all(key not in out.values for key in ("learning_rate", "per_device_train_batch_size", "bf16")), \
            "every 'auto' takes meshtune's value"


def test_deepspeed_explicit_values_apply_and_conflicts_name_both():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 64,
          "gradient_clipping": 0.5, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                     "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100,
                                                             "warmup_type": "linear", "warmup_max_lr": "auto"}},
          "zero_optimization": {"stage": 1}}
    out = translate_deepspeed(ds, "ds.json", {}, {})
    assert out.problems == []
    assert out.values == {"parallel": "zero2", "bf16": True, "per_device_train_batch_size": 4,
                          "gradient_accumulation_steps": 2, "train_batch_size": 64, "max_grad_norm": 0.5,
                          "learning_rate": 3e-4, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
                          "weight_decay": 0.1, "lr_scheduler_type": "deepspeed_warmup_decay_lr", "warmup_steps": 10,
                          "max_steps": 100, "warmup_type": "linear"}
    same = translate_deepspeed(ds, "ds.json", {"per_device_train_batch_size": 4}, {})
    assert same.problems == [] and "per_device_train_batch_size" not in same.values
    clash = translate_deepspeed(ds, "ds.json", {"per_device_train_batch_size": 2, "parallel": "zero3"},
                                {"per_device_train_batch_size": "command line"})
    assert clash.problems == [
        "ds.json: zero_optimization.stage is \"zero2\" but parallel is 'zero3' (config); set one of them to the "
        "other's value, or the DeepSpeed entry to \"auto\"",
        "ds.json: train_micro_batch_size_per_gpu is 4 but per_device_train_batch_size is 2 (command line); set one of "
        "them to the other's value, or the DeepSpeed entry to \"auto\""]


def test_deepspeed_settings_meshtune_cannot_run_are_errors():
    bad = {"fp16": {"enabled": True}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
           "optimizer": {"type": "Lamb"}, "scheduler": {"type": "OneCycle"}}
    problems = "\n".join(translate_deepspeed(bad, "ds.json", {}, {}).problems)
    for expected in ("bf16.enabled and fp16.enabled are both true", "offload_param.device nvme is not supported",
                     "optimizer.type 'Lamb'",
                     "scheduler.type 'OneCycle' is not supported"):
        assert expected in problems
    stage0 = translate_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
                                 "ds.json", {}, {})
    assert "need ZeRO stage 1, 2 or 3" in stage0.problems[0]


def test_deepspeed_scheduler_gives_way_to_an_explicit_lr_scheduler_type_and_says_so(tmp_path):
    out = translate_deepspeed(json.loads((FIXTURES / "qwen" / "ds_config_zero2.json").read_text()), "z2.json",
                              {"lr_scheduler_type": "cosine"}, {"lr_scheduler_type": "command line"})
    assert "lr_scheduler_type" not in out.values and out.problems == []
    assert any("scheduler WarmupLR (lr_scheduler_type deepspeed_warmup_lr) is not used: lr_scheduler_type 'cosine' "
               "(command line)" in note for note in out.notes)
    alone = translate_deepspeed(json.loads((FIXTURES / "qwen" / "ds_config_zero2.json").read_text()), "z2.json", {}, {})
    assert alone.values["lr_scheduler_type"] == "deepspeed_warmup_lr"
    assert "warmup_type" not in alone.values  # not written: DeepSpeed's log


def test_deepspeed_schedulers_without_warmup_type_warm_up_as_deepspeed_does(tmp_path, tiny_model_dir, capfd):
    """WarmupDecayLR with warmup_type left out trains DeepSpeed's log warmup, step for step: the lr of every step in
    metrics.jsonl against DeepSpeed's lr_schedules.py arithmetic (the first step at warmup_min_lr, then step k at
    log(k) / log(W) of the peak, then (T - k + 1) / (T - W))."""
    import math

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto",
                              "scheduler": {"type": "WarmupDecayLR", "params": {
                                  "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                  "total_num_steps": "auto"}}}))
    peak, total, warmup = 1e-3, 8, 4
    (tmp_path / "train.yaml").write_text(f"model_name_or_path: {tiny_model_dir}\n"
                                         f"dataset: {FIXTURES / 'qwen' / 'train.json'}\ndeepspeed: {ds}\n")
    result = run_cli_here(["train", str(tmp_path / "train.yaml"), f"output_dir={tmp_path / 'out'}",
                           f"max_steps={total}", f"warmup_steps={warmup}", f"learning_rate={peak}", "logging_steps=1",
                           "save_final=false", "plot_loss=false"], capfd)
    assert result.returncode == 0, result.stdout
    assert "lr schedule (deepspeed_warmup_decay_lr, as DeepSpeed's WarmupDecayLR computes it): log warmup" \
        in result.stdout
    deepspeed = [0.0] + [math.log(k) / math.log(warmup) for k in range(1, warmup + 1)] + [
        (total - k + 1) / (total - warmup) for k in range(warmup + 1, total)]
    assert [r["lr"] for r in read_metrics(tmp_path / "out") if "loss" in r] == pytest.approx(
        [peak * ratio for ratio in deepspeed], rel=1e-12, abs=0)
    for kind in ("WarmupLR", "WarmupCosineLR"):
        out = translate_deepspeed({"scheduler": {"type": kind, "params": {"warmup_num_steps": 5}}}, "ds.json", {}, {})
        assert (out.values["lr_scheduler_type"], out.problems) == (
            f"deepspeed_{'warmup_lr' if kind == 'WarmupLR' else 'warmup_cosine_lr'}", [])
        assert not [note for note in out.notes if "warmup_type" in note]


def test_deepspeed_scheduler_entries_left_out_take_deepspeeds_defaults():
    """Absent (not "auto", which HF Trainer fills in): DeepSpeed's constructor defaults, 1000 warmup steps and
    WarmupDecayLR's peak of 0.001; WarmupCosineLR ends at its cos_min_ratio."""
    out = translate_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}}}, "ds.json",
                              {}, {})
    assert out.values == {"parallel": "ddp", "lr_scheduler_type": "deepspeed_warmup_decay_lr", "warmup_steps": 1000,
                          "learning_rate": 0.001, "max_steps": 2000}
    assert any("gives no warmup_num_steps: 1000 warmup steps, DeepSpeed's default" in note for note in out.notes)
    overruled = translate_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": {
        "type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, "ds.json", {}, {})
    assert overruled.problems == ["ds.json: scheduler WarmupDecayLR gives no warmup_max_lr, so DeepSpeed peaks at its "
                                  "default 0.001, not optimizer.params.lr 0.0003; set scheduler.params.warmup_max_lr "
                                  "to the peak you mean (or \"auto\")"]
    clash = translate_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
                                "ds.json", {"learning_rate": 2e-5}, {})
    assert clash.problems == ["ds.json: scheduler.params.warmup_max_lr (absent: DeepSpeed's default) is 0.001 but "
                              "learning_rate is 2e-05 (config); set one of them to the other's value, or the "
                              "DeepSpeed entry to \"auto\""]
    cosine = translate_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 10, "cos_min_ratio": 0.1, "warmup_type": "linear"}}}, "ds.json", {}, {})
    assert cosine.values == {"parallel": "ddp", "lr_scheduler_type": "deepspeed_warmup_cosine_lr", "warmup_steps": 10,
                             "warmup_type": "linear", "cos_min_ratio": 0.1}
    odd = translate_deepspeed({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                                            "warmup_type": "exp"}}}, "ds.json", {}, {})
    assert odd.values["warmup_type"] == "log" and "is neither log nor linear: log" in odd.notes[0]
    with pytest.raises(ConfigError, match="warmup_type: log shapes the warmup of DeepSpeed's schedules"):
        load_job_config(None, ["model_name_or_path=m", "dataset=d.json", "warmup_type=log"])


def test_deepspeed_file_is_found_next_to_the_config_and_errors_name_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    shutil.copy(FIXTURES / "qwen" / "ds_config_zero3.json", tmp_path / "cfg" / "ds.json")
    (tmp_path / "cfg" / "train.yaml").write_text("model_name_or_path: /m\ndataset: d.json\ndeepspeed: ds.json\n")
    loaded = load_job_config(tmp_path / "cfg" / "train.yaml")
    assert loaded.config.parallel == "zero3"
    assert any("not applied" in line and "zero_optimization.stage3_max_live_parameters" in line
               for line in loaded.warnings)
    with pytest.raises(ConfigError, match=r"command line: deepspeed: missing.json not found \(looked at"):
        load_job_config(tmp_path / "cfg" / "train.yaml", ["deepspeed=missing.json"])


# ---- LLaMA-Factory YAML and foreign keys

def test_keys_of_other_tools_are_ignored_with_the_reason_or_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: /m\ndataset: d.json\noverwrite_output_dir: true\nlogging_dir: runs\n"
                      "plot_loss: true\nstage: sft\ndo_train: true\n")
    loaded = load_job_config(config)
    assert loaded.warnings == [
        "overwrite_output_dir is HF TrainingArguments'; ignored because output_dir is never cleared: a run resumes "
        "its newest complete checkpoint (resume_from_checkpoint: auto); set resume_from_checkpoint: none to start over",
        "logging_dir is HF TrainingArguments'; ignored because metrics go to output_dir/metrics.jsonl, and with "
        "report_to: tensorboard to output_dir/tensorboard/"]
    config.write_text("model_name_or_path: /m\ndataset: d.json\nplot_loss: false\n")
    assert load_job_config(config).config.plot_loss is False  # LLaMA-Factory's key, meshtune's too: no loss.png
    config.write_text("model_name_or_path: /m\ndataset: d.json\nstage: ppo\nuse_dft_loss: true\npure_bf16: true\n"
                      "quantization_bit: 8\ntemplate: qwen2_vl\nlearning_rat: 1\n")
    with pytest.raises(ConfigError) as err:
        load_job_config(config)
    lines = str(err.value).splitlines()
    assert len(lines) == 6, lines
    for expected in ("ppo: PPO is another trainer's; meshtune trains supervised fine-tuning (sft), continued "
                     "pre-training on raw text (pt), DPO-family preference training on pairs (dpo) and KTO",
                     "use_dft_loss: True", "pure_bf16: True", "quantization_bit: 8",
                     "template: qwen2_vl is a vision-language template",
                     "unknown key 'learning_rat'; did you mean 'learning_rate'?"):
        assert any(expected in line for line in lines), expected


def test_foreign_keys_no_longer_get_a_misleading_did_you_mean(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: /m\ndataset: d.json\nuse_lora: true\nmax_samples: 10\n")
    cfg = load_job_config(config).config
    assert cfg.finetuning_type == "lora" and cfg.max_samples == 10
    config.write_text("model_name_or_path: /m\ndataset: d.json\nfinetuning_type: lora\nquantization_bit: 4\n")
    assert load_job_config(config).config.finetuning_type == "qlora"
    config.write_text("model_name_or_path: /m\ndataset: d.json\nfinetuning_type: full\nuse_lora: true\n")
    with pytest.raises(ConfigError, match=r"use_lora: True means finetuning_type: 'lora', but finetuning_type sets "
                                          r"finetuning_type: 'full'"):
        load_job_config(config)


def test_qlora_under_deepspeed_zero3_is_sharded_qlora_and_its_offload_is_refused(tmp_path, monkeypatch):
    tree = llamafactory_tree(FIXTURES, tmp_path / "lf")
    monkeypatch.chdir(tree)
    cfg = load_job_config("examples/train/lora_sft_otfq.yaml",
                          ["deepspeed=examples/deepspeed/ds_z3_config.json"]).config
    assert (cfg.finetuning_type, cfg.parallel) == ("qlora", "zero3")
    with pytest.raises(ConfigError, match=r"cpu_offload: true with finetuning_type: qlora is not supported"):
        load_job_config("examples/train/lora_sft_otfq.yaml", ["deepspeed=examples/deepspeed/ds_z3_offload_config.json"])


@pytest.mark.parametrize("source", SOURCES)
def test_accelerate_fsdp_config_is_refused_with_meshtune_equivalents(source):
    path = next((source / "llamafactory").glob("examples/**/fsdp_config*.yaml"))
    with pytest.raises(ConfigError) as err:
        load_job_config(path)
    message = str(err.value)
    assert "is an accelerate launch config (distributed_type: FSDP)" in message
    for key in ("parallel: zero3", "nnodes: 2", "nproc_per_node: 8", "master_addr: ", "master_port: 29500"):
        assert key in message


REFUSED = {"qwen3_lora_reward.yaml": r"rm: reward-model training \(rm\) is another trainer's",
           "fsdp_config.yaml": "is an accelerate launch config",
           "fsdp_config_multiple_nodes.yaml": "is an accelerate launch config"}
EXPECTED = {  # file: (parallel, finetuning_type, cpu_offload)
    "lora_sft.yaml": ("auto", "lora", False), "full_sft_ds3.yaml": ("zero3", "full", False),
    "lora_sft_otfq.yaml": ("auto", "qlora", False), "toolcall_lora_sft.yaml": ("ddp", "lora", False),
    "qwen3_lora_sft.yaml": ("auto", "lora", False), "qwen3_full_sft.yaml": ("zero3", "full", False),
    "qwen3_lora_sft_ds3.yaml": ("zero3", "lora", False), "qwen3_lora_sft_otfq.yaml": ("auto", "qlora", False),
    "lora_pretrain.yaml": ("auto", "lora", False), "qwen3_lora_pretrain.yaml": ("auto", "lora", False),
    "dpo.yaml": ("auto", "lora", False), "qwen3_lora_dpo.yaml": ("auto", "lora", False),
    "lora_kto.yaml": ("auto", "lora", False), "qwen3_lora_kto.yaml": ("auto", "lora", False)}


# one step of 8 micro-batches of pairs (DPO) or of samples and their KL batch (KTO) up to 2048 tokens each (the tiny
# tokenizer's tokens are short) is enough
STEPS = {"qwen3_lora_dpo.yaml": 1, "qwen3_lora_kto.yaml": 1}


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_every_llamafactory_yaml_trains_three_steps_or_is_refused(source, tmp_path, monkeypatch, tiny_model_dir):
    """Unchanged but for the model path and output_dir (and max_steps to keep it short), from the root of a
    LLaMA-Factory-like checkout, as its users run them."""
    from meshtune.train.loop import run

    tree = llamafactory_tree(source, tmp_path / "lf")
    monkeypatch.chdir(tree)
    yamls = sorted((tree / "examples" / "train").glob("*.yaml"))
    assert {path.name for path in yamls} <= set(EXPECTED) | set(REFUSED)
    for path in yamls:
        steps = STEPS.get(path.name, 3)
        overrides = [f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'out' / path.stem}",
                     f"max_steps={steps}", "logging_steps=1"]
        if path.name in REFUSED:
            with pytest.raises(ConfigError, match=REFUSED[path.name]):
                load_job_config(path.relative_to(tree), overrides)
            continue
        cfg = load_job_config(path.relative_to(tree), overrides).config
        assert (cfg.parallel, cfg.finetuning_type, cfg.cpu_offload) == EXPECTED[path.name], path.name
        records = run(cfg).records
        assert [r["step"] for r in records if "loss" in r][-1] == steps, path.name
        if cfg.stage == "kto":  # TRL's metrics, the KL estimate among them
            assert all({"kl", "logps/chosen", "logps/rejected"} <= set(r) for r in records if "loss" in r), path.name
        final = tmp_path / "out" / path.stem / "final"
        assert (final / "tokenizer_config.json").is_file(), path.name


def test_llamafactory_yaml_through_the_command_line(tmp_path, tiny_model_dir, monkeypatch, capfd):
    tree = llamafactory_tree(FIXTURES, tmp_path / "lf")
    out = tmp_path / "out"
    monkeypatch.chdir(tree)
    result = run_cli_here(["train", "examples/train/lora_sft.yaml", f"model_name_or_path={tiny_model_dir}",
                           f"output_dir={out}", "max_steps=2", "save_steps=0"], capfd)
    assert result.returncode == 0, result.stdout
    assert "overwrite_output_dir is HF TrainingArguments'; ignored because" in result.stdout
    assert [r["step"] for r in read_metrics(out) if "loss" in r][-1] == 2


# ---- Qwen's finetune.py flags

def test_flags_are_split_from_the_command_and_parsed_as_yaml():
    rest, flags, given = split_flags(["cfg.yaml", "lr=1", "--bf16", "True", "--use_lora", "--lora_target_modules",
                                      "c_attn", "w1", "--max_steps=-1", "--debug", "--weight_decay", "0.1",
                                      "nproc_per_node=2"], {"--debug"})
    assert rest == ["cfg.yaml", "lr=1", "--debug", "nproc_per_node=2"]
    assert flags == {"bf16": True, "use_lora": True, "lora_target_modules": ["c_attn", "w1"], "max_steps": -1,
                     "weight_decay": 0.1}
    assert given == ["--bf16", "True", "--use_lora", "--lora_target_modules", "c_attn", "w1", "--max_steps=-1",
                     "--weight_decay", "0.1"]


def test_a_bare_flag_ends_at_the_commands_own_short_option():
    """`meshtune preview ... --use_lora -n 1`: -n is preview's, not a value of --use_lora; -1 stays a value."""
    from meshtune.cli import parse_args

    args = parse_args(["preview", "--data_path", "t.json", "--use_lora", "-n", "1", "--max_steps", "-1",
                       "--learning_rate", "-1e-5"])
    assert args.flags == {"data_path": "t.json", "use_lora": True, "max_steps": -1, "learning_rate": -1e-5}
    assert args.samples == 1
    rest, flags, _ = split_flags(["--use_lora", "-x", "--weight_decay", "-.5"], set())
    assert (rest, flags) == (["-x"], {"use_lora": True, "weight_decay": -0.5})


def test_qwen_finetune_flags_train_as_its_lora_script_passes_them(tmp_path, tiny_model_dir, monkeypatch, capfd):
    """The flags of Qwen's finetune_lora_ds.sh, with its ZeRO-2 DeepSpeed JSON and data format."""
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    result = run_cli_here(
        ["train", "--model_name_or_path", str(tiny_model_dir), "--data_path", str(FIXTURES / "qwen" / "train.json"),
         "--bf16", "True", "--output_dir", str(out), "--num_train_epochs", "5", "--per_device_train_batch_size", "1",
         "--per_device_eval_batch_size", "1", "--gradient_accumulation_steps", "2", "--evaluation_strategy", "no",
         "--save_strategy", "steps", "--save_steps", "1000", "--save_total_limit", "10", "--learning_rate", "3e-4",
         "--weight_decay", "0.1", "--adam_beta2", "0.95", "--warmup_ratio", "0.01", "--lr_scheduler_type", "cosine",
         "--logging_steps", "1", "--report_to", "none", "--model_max_length", "128", "--lazy_preprocess", "True",
         "--use_lora", "--gradient_checkpointing", "--deepspeed", str(FIXTURES / "qwen" / "ds_config_zero2.json"),
         "--max_steps", "2"], capfd)
    assert result.returncode == 0, result.stdout
    plan = json.loads((out / "run_plan.json").read_text())
    assert plan["parallel"] == "ddp" and "zero2 with LoRA runs as ddp" in plan["why"]["parallel"]  # the ZeRO-2 JSON
    assert "scheduler WarmupLR (lr_scheduler_type deepspeed_warmup_lr) is not used: lr_scheduler_type 'cosine'" \
        in result.stdout
    saved = (out / "config.yaml").read_text()
    for line in ("finetuning_type: lora", "cutoff_len: 128", "adam_beta2: 0.95", "lr_scheduler_type: cosine",
                 "lora_rank: 64", "lora_alpha: 16.0", "lora_dropout: 0.05"):
        assert line in saved
    assert [r["step"] for r in read_metrics(out) if "loss" in r][-1] == 2
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (64, 16, 0.05)
    # a base model (its path does not say "chat"): finetune.py trains its embedding and head in full too
    assert sorted(adapter["modules_to_save"]) == ["embed_tokens", "lm_head"]
    assert ("its defaults apply where no flag sets them: lora_rank: 64, lora_alpha: 16, lora_dropout: 0.05"
            in result.stdout)
    assert "template: chatml, default_system: 'You are a helpful assistant.'" in result.stdout
    assert "Qwen's finetune.py also trains each turn's <|im_start|>" in result.stdout


def test_qwen_full_parameter_script_trains_every_parameter(tmp_path, tiny_model_dir, monkeypatch, capfd):
    """finetune_ds.sh passes no --use_lora: finetune.py then trains every parameter, here too."""
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    result = run_cli_here(
        ["train", "--model_name_or_path", str(tiny_model_dir), "--data_path", str(FIXTURES / "qwen" / "train.json"),
         "--bf16", "True", "--output_dir", str(out), "--per_device_train_batch_size", "1",
         "--gradient_accumulation_steps", "2", "--learning_rate", "1e-5", "--weight_decay", "0.1",
         "--adam_beta2", "0.95", "--warmup_ratio", "0.01", "--model_max_length", "128", "--gradient_checkpointing",
         "True", "--lazy_preprocess", "True", "--deepspeed", str(FIXTURES / "qwen" / "ds_config_zero3.json"),
         "--max_steps", "1"], capfd)
    assert result.returncode == 0, result.stdout
    assert "finetuning_type: full" in (out / "config.yaml").read_text()
    trained, total = re.search(r"trainable parameters ([\d,]+) of ([\d,]+)", result.stdout).groups()
    assert trained == total
    assert (out / "final" / "model.safetensors").is_file() and not (out / "final" / "adapter_config.json").exists()
    assert "finetuning_type: full (without --use_lora finetune.py trains every parameter)" in result.stdout


@pytest.mark.parametrize("model, flags, in_full", [
    ("/models/Qwen-7B", {"use_lora": True}, ["wte", "lm_head"]),
    ("/models/Qwen-7B-Chat", {"use_lora": True}, []),
    ("/models/Qwen-7B", {"use_lora": True, "q_lora": True}, []),
    ("/models/Qwen-7B", {"use_lora": True, "additional_target": "lm_head"}, ["lm_head"]),
    ("/models/Qwen-7B", {}, []),
])
def test_qwen_lora_trains_a_base_models_embedding_and_head_in_full(model, flags, in_full):
    """finetune.py: `modules_to_save = None if q_lora or 'chat' in model_name_or_path.lower() else [wte, lm_head]`"""
    cfg = load_job_config(None, [], {"model_name_or_path": model, "data_path": "train.json", **flags}).config
    assert cfg.additional_target == in_full


@pytest.mark.parametrize("flags, expected", [
    ({"use_lora": True, "q_lora": True}, ("qlora", 64, 16.0, 0.05)),
    ({"use_lora": True, "lora_r": 8, "lora_dropout": 0.0}, ("lora", 8, 16.0, 0.0)),
    ({"use_lora": True, "lora_alpha": 32, "lora_target_modules": ["c_attn"]}, ("lora", 64, 32.0, 0.05)),
    ({"use_lora": False}, ("full", 8, None, 0.0)),
    ({"finetuning_type": "lora"}, ("lora", 64, 16.0, 0.05)),
])
def test_qwen_flag_sets_get_finetune_py_defaults_and_explicit_flags_win(flags, expected):
    cfg = load_job_config(None, ["model_name_or_path=m"], {"data_path": "train.json", **flags}).config
    assert (cfg.finetuning_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == expected


@pytest.mark.parametrize("source", SOURCES)
def test_qwens_qlora_script_reads_as_finetune_py_runs_it(source):
    """finetune_qlora_ds.sh: --fp16 True (GPUs without bf16), --use_lora --q_lora, its ZeRO-2 JSON."""
    flags = {"model_name_or_path": "/models/Qwen-7B-Chat-Int4", "data_path": "train.json", "fp16": True,
             "use_lora": True, "q_lora": True, "gradient_checkpointing": True, "model_max_length": 512,
             "deepspeed": str(source / "qwen" / "ds_config_zero2.json")}
    cfg = load_job_config(None, [], flags).config
    assert (cfg.finetuning_type, cfg.fp16, cfg.parallel, cfg.lora_rank, cfg.lora_dropout, cfg.additional_target) == (
        "qlora", True, "zero2", 64, 0.05, [])


def test_native_configs_keep_meshtunes_own_defaults():
    loaded = load_job_config(None, ["model_name_or_path=m", "dataset=train.json"])
    cfg = loaded.config
    assert (cfg.finetuning_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == ("lora", 8, None, 0.0)
    assert not any("finetune.py" in line for line in loaded.warnings)


def test_qwen_q_lora_without_use_lora_is_refused():
    """finetune.py ignores --q_lora without --use_lora; the intent is unclear, so the job does not start."""
    with pytest.raises(ConfigError, match=r"q_lora: True without use_lora: finetune.py then ignores q_lora"):
        load_job_config(None, ["model_name_or_path=m"], {"data_path": "train.json", "q_lora": True})


def test_a_lora_target_naming_no_layer_of_the_model_is_refused_naming_its_layers(tiny_model_dir):
    """As peft refuses it; Qwen(1)'s names on a Qwen2 model are not read as other layers, the error says which."""
    from meshtune.model.lora import linear_module_names, lora_targets
    from meshtune.model.loading import load_model

    available = linear_module_names(load_model(tiny_model_dir))
    layers = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(ConfigError) as error:
        lora_targets(["c_attn"], available)
    assert str(error.value) == (f"lora_target: c_attn names no linear layer of the model; its linear layers are "
                                f"{layers} (or use lora_target: all). c_attn is Qwen(1)'s name for q_proj, k_proj, "
                                f"v_proj here: lora_target: q_proj,k_proj,v_proj trains those")
    with pytest.raises(ConfigError, match=r"lora_target: c_attn, w2 names no linear layer .*: lora_target: "
                                          r"q_proj,k_proj,v_proj,o_proj,gate_proj trains those"):
        lora_targets(["c_attn", "o_proj", "w2"], available)
    with pytest.raises(ConfigError, match=rf"lora_target: qkv names no linear layer of the model; its linear layers "
                                          rf"are {layers} \(or use lora_target: all\)$"):
        lora_targets(["qkv"], available)
    assert lora_targets(["q_proj", "v_proj"], available) == ["q_proj", "v_proj"]


def test_migration_guide_lists_every_key_of_the_other_tools():
    guide = (Path(__file__).parents[1] / "docs" / "migration.md").read_text()
    family_keys = [key for family in FAMILIES for key in (*family.keys, *([family.switch] if family.switch else []))]
    prefixes = [f"{prefix}*" for family in FAMILIES for prefix in family.prefixes]
    missing = [key for key in [*FOREIGN, *family_keys, *prefixes]
               if f"`{key}`" not in guide and f"`--{key}`" not in guide]
    assert not missing, f"docs/migration.md lacks {missing}"


# ---- keys of methods meshtune does not have: named as their method's, never read as a look-alike key of ours

@pytest.mark.parametrize("key, value, message", [
    ("use_dft_loss", True, "use_dft_loss: True is LLaMA-Factory's; meshtune cannot run it: it turns on the DFT loss"),
    ("use_galore", True, "it turns on GaLore (low-rank projection of full fine-tuning's gradients): meshtune trains "
                         "LoRA, Q-LoRA or full"),
    ("use_apollo", True, "it turns on the APOLLO optimizer"),
    ("use_badam", True, "it turns on the BAdam optimizer"),
    ("pissa_init", True, "it turns on PiSSA initialisation"),
    ("loraplus_lr_ratio", 16.0, "it turns on LoRA+"),
    ("use_llama_pro", True, "it turns on LLaMA Pro"),
    ("use_adam_mini", True, "it turns on the Adam-mini optimizer"),
    ("use_muon", True, "it turns on the Muon optimizer"),
    ("pure_bf16", True, "the nearest meshtune has is master_weights: bf16"),
    ("disable_shuffling", True, "every epoch's order is a permutation drawn from the seed"),
    ("early_stopping_steps", 3, "training runs all its steps"),
])
def test_keys_that_turn_on_another_method_are_refused_as_that_method(key, value, message):
    with pytest.raises(ConfigError) as error:
        load_job_config(None, ["model_name_or_path=m", "dataset=d.json"], {key: value})
    assert message in str(error.value)
    assert "did you mean" not in str(error.value)


@pytest.mark.parametrize("key, value, message", [
    ("galore_rank", 16, "galore_rank is LLaMA-Factory's; ignored because it is a GaLore setting, read only with "
                        "use_galore: true: meshtune trains LoRA, Q-LoRA or full"),
    ("apollo_rank", 16, "it is an APOLLO setting, read only with use_apollo: true"),
    ("badam_mode", "layer", "it is a BAdam setting, read only with use_badam: true"),
    ("oft_target", "all", "oft_target is LLaMA-Factory's; ignored because it is an OFT setting, read only with "
                          "finetuning_type: oft"),
    ("module_dropout", 0.1, "it is an OFT setting"),
    ("freeze_trainable_layers", 2, "it is a freeze (partial-parameter) fine-tuning setting, read only with "
                                   "finetuning_type: freeze"),
    ("freeze_vision_tower", True, "it is a multimodal setting: meshtune trains text models only"),
    ("pissa_iter", 16, "it is a PiSSA setting, read only with pissa_init: true"),
    ("loraplus_lr_embedding", 1e-6, "it is a LoRA+ setting, read only with loraplus_lr_ratio set"),
    ("ray_num_workers", 4, "ray_num_workers is LLaMA-Factory's; ignored because it is a Ray setting: meshtune starts "
                           "its processes with torchrun, not Ray: nproc_per_node processes on each of nnodes nodes"),
    ("resources_per_worker", {"GPU": 1}, "it is a Ray setting"),
    ("swanlab_project", "p", "it is a SwanLab setting"),
    ("ppo_epochs", 4, "it is a PPO or reward-model setting: read only by stage: ppo or rm"),
    ("reward_model", "a", "it is a PPO or reward-model setting"),
    ("use_mca", True, "meshtune trains through DDP or FSDP2, not Megatron Core"),
])
def test_settings_of_another_method_are_ignored_as_that_methods(key, value, message):
    loaded = load_job_config(None, ["model_name_or_path=m", "dataset=d.json"], {key: value})
    assert any(message in line for line in loaded.warnings), loaded.warnings
    assert loaded.config == load_job_config(None, ["model_name_or_path=m", "dataset=d.json"]).config


def test_axolotls_micro_batch_size_is_the_batch_per_process():
    cfg = load_job_config(None, ["model_name_or_path=m", "dataset=d.json", "micro_batch_size=4"]).config
    assert (cfg.per_device_train_batch_size, cfg.train_batch_size) == (4, None)


def test_no_key_of_meshtunes_is_read_as_another_tools():
    from meshtune.config import TrainConfig

    assert [key for key in TrainConfig.model_fields if foreign_handler(key)] == []


def test_deepspeed_train_batch_size_is_checked_against_the_job(tmp_path, tiny_model_dir):
    from meshtune.train.loop import run

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 0}}))
    overrides = [f"model_name_or_path={tiny_model_dir}", f"dataset={FIXTURES / 'qwen' / 'train.json'}",
                 f"output_dir={tmp_path / 'out'}", "gradient_accumulation_steps=2", f"deepspeed={ds}", "max_steps=1"]
    cfg = load_job_config(None, overrides).config
    assert (cfg.train_batch_size, cfg.per_device_train_batch_size, cfg.parallel) == (6, 1, "ddp")
    with pytest.raises(ConfigError, match=r"train_batch_size 6 is not the global batch this job makes: "
                                          r"per_device_train_batch_size 1 x gradient_accumulation_steps 2 x 1 "
                                          r"processes = 2"):
        run(cfg)


# ---- features of LLaMA-Factory and HF that meshtune does not have: each key said as what it is

@pytest.mark.parametrize("key, value, whose, what", [
    ("neftune_noise_alpha", 5.0, "HF TrainingArguments'", "NEFTune (uniform noise of that scale added to the input "
                                                          "embeddings while training)"),
    ("rope_scaling", "linear", "LLaMA-Factory's", "rescales the model's rotary position embeddings"),
    ("label_smoothing_factor", 0.1, "HF TrainingArguments'", "smooths the labels"),
    ("resize_vocab", True, "LLaMA-Factory's", "resizes the tokenizer's vocabulary and the model's embeddings"),
    ("new_special_tokens", "<tool>", "LLaMA-Factory's", "adds special tokens to the tokenizer"),
    ("shift_attn", True, "LLaMA-Factory's", "LongLoRA's shifted sparse attention"),
    ("upcast_layernorm", True, "LLaMA-Factory's", "keeps the norm layers' weights in fp32"),
    ("enable_thinking", False, "LLaMA-Factory's", "strips the thoughts from the records' answers"),
    ("moe_aux_loss_coef", 0.001, "LLaMA-Factory's", "a mixture-of-experts router's auxiliary loss"),
    ("full_determinism", True, "HF TrainingArguments'", "deterministic algorithms for every kernel"),
    ("use_reentrant_gc", True, "LLaMA-Factory's", "reentrant activation checkpointing"),
    ("buffer_size", 16384, "LLaMA-Factory's", "the shuffle buffer of streaming: true"),
    ("eval_on_each_dataset", True, "LLaMA-Factory's", "a loss for each eval_dataset apart"),
    ("average_tokens_across_devices", False, "HF TrainingArguments'",
     "averages each process's loss over its own tokens"),
    ("image_max_pixels", 589824, "LLaMA-Factory's", "caps the pixels of each image a multimodal model reads"),
])
def test_a_feature_meshtune_lacks_is_named_as_what_it_is(key, value, whose, what):
    """Not a bare unknown key: what the key is in its tool, that meshtune does not have it, and what meshtune does;
    refused where leaving it out would train something else, a warning otherwise."""
    try:
        loaded = load_job_config(None, ["model_name_or_path=m", "dataset=d.json"], {key: value})
        said = "\n".join(loaded.warnings)
    except ConfigError as error:
        said = str(error)
    line = next(line for line in said.splitlines() if key in line)
    assert f"{key}" in line and whose in line and what in line and "which meshtune does not have" in line, line
    assert "unknown key" not in said and "did you mean" not in said


@pytest.mark.parametrize("key, value", [("neftune_noise_alpha", None), ("neftune_noise_alpha", 0.0),
                                        ("label_smoothing_factor", 0), ("rope_scaling", None), ("resize_vocab", False),
                                        ("shift_attn", False), ("upcast_layernorm", False), ("enable_thinking", True),
                                        ("full_determinism", False), ("average_tokens_across_devices", True)])
def test_such_a_key_at_the_value_meshtune_runs_anyway_says_nothing(key, value):
    loaded = load_job_config(None, ["model_name_or_path=m", "dataset=d.json"], {key: value})
    assert loaded.warnings == [] and loaded.config == load_job_config(None, ["model_name_or_path=m",
                                                                             "dataset=d.json"]).config


def test_qwen_flags_train_every_sample_every_epoch_in_hf_trainers_step_count(tmp_path, tiny_model_dir, monkeypatch,
                                                                             capfd):
    """40 samples, 2 a GPU x 8 accumulation, 5 epochs on one process: HF Trainer (its own dataloader and step
    arithmetic, run here) trains 15 steps, the last of each epoch on the 8 samples left over; meshtune too."""
    from test_sampler import hf_trainer_steps

    import meshtune.train.objectives.token_loss as token_loss

    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"id": f"identity_{i}", "conversations": [
        {"from": "user", "value": f"what is {i} plus one"}, {"from": "assistant", "value": f"{i + 1}"}]}
        for i in range(40)]))
    trained: list[int] = []  # the samples of every micro-batch the loop collates

    def recording(rows, dataset, *args, **kwargs):
        trained.extend(i for row in rows for i in row)
        return collate(rows, dataset, *args, **kwargs)

    collate = token_loss.collate
    monkeypatch.setattr(token_loss, "collate", recording)
    out = tmp_path / "out"
    result = run_cli_here(
        ["train", "--model_name_or_path", str(tiny_model_dir), "--data_path", str(data), "--output_dir", str(out),
         "--num_train_epochs", "5", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8",
         "--learning_rate", "1e-5", "--model_max_length", "64", "--logging_steps", "1", "--report_to", "none",
         "--save_strategy", "no", "--save_final", "false"], capfd)
    assert result.returncode == 0, result.stdout
    hf_steps, hf_seen = hf_trainer_steps(40, 2, 8, 5.0, 1, tmp_path / "hf")
    assert hf_steps == 15 and sorted(hf_seen) == list(range(40))
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, hf_steps + 1))
    fillers = len(trained) - 5 * 40  # a filler is one sample, trained on nothing: one process needs none
    assert fillers == 0 and [sorted(trained[e * 40:(e + 1) * 40]) for e in range(5)] == [list(range(40))] * 5


@pytest.mark.parametrize("keys, differs", [
    ({"packing": True}, True),  # LLaMA-Factory would attend across the packed samples
    ({"packing": True, "neat_packing": False}, True),
    ({"neat_packing": True}, False),  # what meshtune's packing is
    ({"packing": True, "neat_packing": True}, False),
    ({"packing": False}, False),
])
def test_packing_says_at_launch_when_llamafactory_would_attend_across_samples(tmp_path, monkeypatch, keys, differs):
    """LLaMA-Factory's full_sft_ds3.yaml (a DeepSpeed job) with packing keys: one line names what differs."""
    from meshtune.compat.job_config import PACKING_DIFFERS

    tree = llamafactory_tree(FIXTURES, tmp_path / "lf")
    monkeypatch.chdir(tree)
    overrides = ["model_name_or_path=/m", *(f"{key}={str(value).lower()}" for key, value in keys.items())]
    loaded = load_job_config("examples/train/full_sft_ds3.yaml", overrides)
    assert loaded.config.parallel == "zero3" and loaded.config.packing == (differs or bool(keys.get("neat_packing")))
    assert (PACKING_DIFFERS in loaded.warnings) is differs
    assert sum("packing" in line for line in loaded.warnings) == differs
    assert "LLaMA-Factory's packing: true without neat_packing lets the samples of a row attend" in PACKING_DIFFERS


def test_a_qwen_job_says_at_launch_that_cutoff_len_cuts_as_llamafactory_not_as_finetune_py():
    from meshtune.compat.job_config import QWEN_CUTOFF_DIFFERS

    qwen = load_job_config(None, [], {"model_name_or_path": "/m", "data_path": "train.json", "model_max_length": 512})
    assert QWEN_CUTOFF_DIFFERS.format(cutoff_len=512) in qwen.warnings
    assert "finetune.py keeps a longer sample's first 512 tokens" in QWEN_CUTOFF_DIFFERS.format(cutoff_len=512)
    ours = load_job_config(None, ["model_name_or_path=/m", "dataset=train.json", "cutoff_len=512"])
    assert not any("finetune.py" in line for line in ours.warnings)
