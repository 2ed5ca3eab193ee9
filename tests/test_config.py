"""Config errors are clear and raised before any process group or model exists."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from conftest import run_cli_here, write_config
from meshtune.compat.job_config import load_config
from meshtune.config import JOB, MATH, NODE, TrainConfig, build_config, describe_keys, parse_overrides
from meshtune.errors import ConfigError

BASE = {"model_name_or_path": "/models/x", "dataset": "train.jsonl"}


def test_unknown_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rat'; did you mean 'learning_rate'"):
        build_config({**BASE, "learning_rat": 1e-4})


def test_bad_value_names_key_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "parallel": "zero4"})
    assert "parallel='zero4'" in str(err.value) and "zero3" in str(err.value)
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size=0"):
        build_config({**BASE, "per_device_train_batch_size": 0})
    with pytest.raises(ConfigError, match=r"learning_rate='fast'"):
        build_config({**BASE, "learning_rate": "fast"})


def test_a_float_beyond_fp32_is_refused_by_the_config_naming_its_key(tmp_path):
    """The optimizer computes these in fp32: 1e39 failed only at the first step, after a restart of the workers."""
    config = write_config(tmp_path, **BASE)
    with pytest.raises(ConfigError, match=r"command line: learning_rate=.?1e\+?39.?: 1e\+39 is beyond the range of a "
                                          r"32-bit float \(at most 3.403e\+38\)"):
        load_config(config, ["learning_rate=1e39"])
    for key in ("weight_decay", "adam_epsilon", "max_grad_norm", "lora_alpha"):
        with pytest.raises(ConfigError, match=f"{key}=inf: inf is beyond the range of a 32-bit float"):
            build_config({**BASE, key: float("inf")})
    assert build_config({**BASE, "learning_rate": 3e38}).learning_rate == 3e38


def test_every_unknown_and_invalid_key_is_named_in_one_error(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text("model_name_or_path: /m\ndataset: d.jsonl\nlearning_rat: 1e-4\nwarmup_stepz: 3\n"
                      "parallel: zero4\n")
    with pytest.raises(ConfigError) as err:
        load_config(config, ["per_device_train_batch_size=0", "sead=3"])
    lines = str(err.value).splitlines()
    assert len(lines) == 5, lines
    assert f"{config}: unknown key 'learning_rat'; did you mean 'learning_rate'?" in lines
    assert any(line.startswith(f"{config}: unknown key 'warmup_stepz'") for line in lines)
    assert any(line.startswith(f"{config}: parallel='zero4'") for line in lines)
    assert any(line.startswith("command line: per_device_train_batch_size=0") for line in lines)
    assert any(line.startswith("command line: unknown key 'sead'") for line in lines)


def test_resume_from_checkpoint_null_means_not_given():
    assert build_config({**BASE, "resume_from_checkpoint": None}).resume_from_checkpoint == "auto"


def test_missing_required_key():
    with pytest.raises(ConfigError, match=r"required key 'dataset' is missing"):
        build_config({"model_name_or_path": "/m"})


def test_qlora_takes_every_parallel_mode_but_not_cpu_offload():
    assert build_config({**BASE, "finetuning_type": "qlora"}).is_lora
    for parallel in ("ddp", "zero2", "zero3", "hsdp"):
        assert build_config({**BASE, "finetuning_type": "qlora", "parallel": parallel}).parallel == parallel
    with pytest.raises(ConfigError, match=r"cpu_offload: true with finetuning_type: qlora is not supported.*zero3"):
        build_config({**BASE, "finetuning_type": "qlora", "parallel": "zero3", "cpu_offload": True})


def test_overrides_are_parsed_as_yaml_and_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: /m\ndataset: a.json,b.jsonl\nlearning_rate: 1.0e-3\n")
    cfg = load_config(path, ["learning_rate=2e-4", "max_steps=50", "bf16=true", "lora_target=q_proj,v_proj"])
    assert cfg.learning_rate == 2e-4 and cfg.max_steps == 50 and cfg.bf16 is True
    assert cfg.dataset == ["a.json", "b.jsonl"] and cfg.lora_target == ["q_proj", "v_proj"]
    assert parse_overrides(["x=[1, 2]"]) == {"x": [1, 2]}
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["learning_rate"])


def test_config_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_hash_ignores_where_outputs_go():
    a = build_config({**BASE, "output_dir": "a"})
    b = build_config({**BASE, "output_dir": "b", "nproc_per_node": 4})
    c = build_config({**BASE, "learning_rate": 3e-4})
    assert a.hash() == b.hash() != c.hash()


@pytest.mark.parametrize("key, value, changes_math", [
    ("learning_rate", 3e-4, True), ("grad_reduce_dtype", "bf16", True), ("seed", 1, True), ("cutoff_len", 99, True),
    ("save_steps", 5, False), ("parallel", "zero3", False), ("padding_free", True, False), ("gc_interval", 3, False),
    ("logging_steps", 1, False), ("master_port", 29500, False)])
def test_hash_covers_exactly_the_keys_that_change_the_math(key, value, changes_math):
    assert (build_config({**BASE, key: value}).hash() != build_config(BASE).hash()) == changes_math


def test_every_key_has_a_section_and_a_scope():
    fields = TrainConfig.model_fields
    assert set(TrainConfig.keys_of(MATH, JOB, NODE)) == set(fields)
    assert {"learning_rate", "dataset", "lora_rank", "bf16"} <= set(TrainConfig.keys_of(MATH))
    assert {"parallel", "save_steps", "eval_steps", "torch_compile"} <= set(TrainConfig.keys_of(JOB))
    assert {"node_rank", "output_dir", "tokenized_path"} <= set(TrainConfig.keys_of(NODE))


def test_the_config_is_never_changed_after_validation():
    cfg = build_config(BASE)
    with pytest.raises(ValidationError):
        cfg.gradient_accumulation_steps = 4


def test_help_lists_every_key_with_its_default_by_section():
    text = describe_keys()
    for key in TrainConfig.model_fields:
        assert f"  {key} " in text
    assert "0.0001" in text  # learning_rate's default
    sections = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert (sections[0] == "model and method:" and "parallelism:" in sections and "stragglers and hangs:" in sections
            and any(title.startswith("reduction across nodes") for title in sections) and len(sections) == 10)
    assert sections[2] == "preference training (stage: dpo and kto):"  # its own section, after the data
    assert all(f"  {key} " in text.split("preference training (stage: dpo and kto):")[1].split("optimisation:")[0]
               for key in ("pref_beta", "pref_loss", "pref_ftx", "dpo_label_smoothing", "simpo_gamma", "ref_model",
                           "ref_model_adapters", "kto_chosen_weight", "kto_rejected_weight"))


def test_cli_reports_config_errors_fast_without_traceback(tmp_path, capfd):
    path = write_config(tmp_path, model_name_or_path="/m", dataset="d.jsonl", learning_rat=1e-4, nproc_per_node=2)
    result = run_cli_here(["train", str(path)], capfd)
    assert result.returncode == 1
    assert "unknown key 'learning_rat'; did you mean 'learning_rate'" in result.stdout
    assert "Traceback" not in result.stdout
    assert "torch.distributed" not in result.stdout  # no worker was started


def test_cli_names_a_missing_model_directory(tmp_path, tiny_dataset, capfd):
    path = write_config(tmp_path, model_name_or_path=str(tmp_path / "absent"), dataset=str(tiny_dataset),
                        output_dir=str(tmp_path / "out"))
    result = run_cli_here(["train", str(path)], capfd)
    assert result.returncode == 1
    assert "is not a local directory" in result.stdout and "never downloads" in result.stdout


def test_train_help_lists_keys(capfd):
    result = run_cli_here(["train", "--help"], capfd)
    assert result.returncode == 0
    assert "gradient_accumulation_steps" in result.stdout and "key=value" in result.stdout


def test_cli_refuses_a_global_batch_larger_than_the_data_before_starting_workers(tmp_path, tiny_model_dir, tiny_dataset,
                                                                                capfd):
    """With dataloader_drop_last: true (without it, as HF Trainer, the data trains as one shorter step an epoch)."""
    path = write_config(tmp_path, model_name_or_path=str(tiny_model_dir), dataset=str(tiny_dataset),
                        output_dir=str(tmp_path / "out"), nproc_per_node=2, per_device_train_batch_size=64,
                        dataloader_drop_last=True)
    result = run_cli_here(["train", str(path)], capfd)
    assert result.returncode == 1
    assert "needs a global batch of 128" in result.stdout and "64 samples" in result.stdout
    assert "dataloader_drop_last: true" in result.stdout
    assert "Traceback" not in result.stdout and "ChildFailedError" not in result.stdout


def test_cli_names_the_malformed_record(tmp_path, tiny_model_dir, capfd):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"messages": [{"role": "user", "content": "no answer"}]}\n')
    path = write_config(tmp_path, model_name_or_path=str(tiny_model_dir), dataset=str(data),
                        output_dir=str(tmp_path / "out"), nproc_per_node=2)
    result = run_cli_here(["train", str(path)], capfd)
    assert result.returncode == 1
    assert f"{data}: record 2 (line 2):" in result.stdout and "skip_invalid" in result.stdout
    assert "Traceback" not in result.stdout


def test_a_key_given_twice_in_the_yaml_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: /m\ndataset: d.jsonl\nlearning_rate: 1e-4\nlearning_rate: 2e-4\n")
    with pytest.raises(ConfigError, match=r"key 'learning_rate' is given twice \(lines 3 and 4\)"):
        load_config(path)


def test_a_truncated_weights_file_is_named_by_the_model_directory_check(tmp_path, tiny_model_dir):
    import shutil

    from meshtune.errors import ModelError
    from meshtune.model.model_dir import check_model_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelError, match=r"model\.safetensors is truncated .*1,000 bytes.*download it again"):
        check_model_dir(model)


def test_yaml_reads_elastic_ranges_and_exponents_as_meant(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: /m\ndataset: d.jsonl\nnnodes: 1:4\nlearning_rate: 2e-5\n")
    cfg = load_config(path, ["master_port=29500"])
    assert cfg.nnodes == "1:4" and cfg.learning_rate == 2e-5 and cfg.master_port == 29500
    assert load_config(path, ["nnodes=2"]).nnodes == "2"
