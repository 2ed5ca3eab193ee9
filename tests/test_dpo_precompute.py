"""precompute_ref_log_probs (stage: dpo) in one process: the values kept beside the tokenized cache are the per-step
reference's log-probs, a run that reads them trains the losses of a run that computes the reference each step
(LoRA: the model with its adapters off; full: a frozen copy, never placed while training), a damaged file is
computed again, and another reference is keyed apart. (Two nodes killed and resumed:
tests/test_dpo_precompute_nodes.py.)"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LLAMAFACTORY_DATA, base_config, read_metrics, write_config
from meshtune.compat.job_config import load_job_config
from meshtune.config import build_config
from meshtune.data.pipeline import prepare_datasets
from meshtune.data.reference_logps import VALUES, read, values_folder
from meshtune.model.loading import load_model
from meshtune.model.model_dir import load_tokenizer
from meshtune.model.loss_head import install_loss_head
from meshtune.model.reference import FrozenCopy
from meshtune.plan import RunPlan
from meshtune.train.objectives.pair_loss import collate_pairs, reference_logps
from meshtune.distributed import DistEnv
from meshtune.train.reference_pass import precompute_reference, reference_identity
from ranks import run_workers

NAMES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def values(model_dir: Path, out: Path, tokenized: Path, **extra) -> dict:
    return base_config(model_dir, "dpo_en_demo", out, **{
        "stage": "dpo", "dataset_dir": str(LLAMAFACTORY_DATA), "cutoff_len": 256, "val_size": 3,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "per_device_eval_batch_size": 2,
        "max_steps": 3, "eval_strategy": "steps", "eval_steps": 3, "learning_rate": 5e-2,
        "tokenized_path": str(tokenized), "save_final": False, **extra})


def folders(tokenized: Path) -> list[Path]:
    return sorted(p for p in tokenized.glob("*.reference-*") if p.is_dir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """LoRA and full fine-tuning, each without and with precomputed values; full fine-tuning's values then read by a
    second run, which must build no frozen copy (each call of model/reference.py's frozen_copy counted)."""
    work = tmp_path_factory.mktemp("dpo_precompute")
    found: dict = {"work": work}

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def train(name: str, **extra) -> None:
        from meshtune.train.loop import run

        capture = Capture()
        logger = logging.getLogger("meshtune")
        logger.addHandler(capture)
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            run(build_config(values(tiny_model_dir, work / name, work / "tokenized", **extra)))
        finally:
            logger.removeHandler(capture)
            logger.setLevel(level)
        out = work / name
        found[name] = {"records": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                       "log": "\n".join(capture.lines), "plan": json.loads((out / "run_plan.json").read_text()),
                       "folders": folders(work / "tokenized")}

    for kind in ("lora", "full"):
        train(f"{kind}-plain", finetuning_type=kind, precompute_ref_log_probs=False)
        train(f"{kind}-computed", finetuning_type=kind, precompute_ref_log_probs=True)
    import meshtune.model.reference as reference

    original, built = reference.frozen_copy, []

    def counted(*args):
        built.append(args)
        return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "frozen_copy", counted)
        train("full-read", finetuning_type="full", precompute_ref_log_probs=True)
    found["copies_built_by_the_read_run"] = len(built)
    return found


def math_of(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops_per_gpu", "peak_mem_gib")}
            for r in records]


@pytest.mark.slow
def test_precomputed_runs_train_the_losses_of_runs_with_the_reference_in_each_step(runs):
    for kind, variant in (("lora", "computed"), ("full", "computed"), ("full", "read")):
        plain = runs[f"{kind}-plain"]["records"]
        records = runs[f"{kind}-{variant}"]["records"]
        assert [r["step"] for r in records] == [r["step"] for r in plain] == [1, 2, 3]
        for mine, other in zip(records, plain):
            for name in NAMES:
                assert mine[name] == pytest.approx(other[name], abs=1e-6), (kind, variant, mine["step"], name)
        assert records[-1]["eval_loss"] == pytest.approx(plain[-1]["eval_loss"], abs=1e-6)
        assert plain[-1]["rewards/margins"] != 0  # the policy has moved from its reference
    # the values read are those computed: the two runs are one run, bit for bit
    assert math_of(runs["full-read"]["records"]) == math_of(runs["full-computed"]["records"])


@pytest.mark.slow
def test_lora_under_zero3_trains_its_adapters_after_the_pass_on_two_processes(runs, tiny_model_dir):
    """The pass runs the policy with its adapters off through FSDP2; the adapters still train afterwards (peft turns
    their requires_grad off and on again on whatever FSDP2 holds at the moment), with LoRA's one-process losses."""
    work = runs["work"] / "zero3"
    config = write_config(work, **values(tiny_model_dir, work / "out", work / "tokenized",  # its own pass
                                         precompute_ref_log_probs=True, parallel="zero3", nproc_per_node=2,
                                         per_device_train_batch_size=1))  # the global batch of the 1-process runs
    codes, output = run_workers(["train", str(config)], 2, work / "ranks")
    assert codes == [0, 0], output[-6000:]
    assert "log-probs of 12 pairs computed in" in output and "on 2 process(es)" in output
    records = read_metrics(work / "out")
    plain = runs["lora-plain"]["records"]
    for mine, other in zip(records, plain):
        for name in NAMES:
            assert mine[name] == pytest.approx(other[name], rel=1e-4, abs=1e-6), (mine["step"], name)
    assert records[-1]["rewards/margins"] != 0


@pytest.mark.slow
def test_the_run_says_where_the_values_are_and_full_fine_tuning_holds_no_frozen_copy(runs):
    computed, read_ = runs["full-computed"], runs["full-read"]
    assert "the reference's log-probs of 12 pairs computed in" in computed["log"]
    assert "log-probs of 12 pairs computed" not in read_["log"]
    assert runs["copies_built_by_the_read_run"] == 0
    assert "read from" in read_["plan"]["why"]["reference"]
    assert "no frozen copy is ever placed" in read_["plan"]["why"]["reference"]
    assert "freed before the policy" in computed["plan"]["why"]["reference"]
    assert "adapters off" in runs["lora-computed"]["plan"]["why"]["reference"]
    assert runs["lora-plain"]["plan"]["why"]["reference"].startswith("the model itself")
    assert len(runs["full-read"]["folders"]) == 2  # one per reference: LoRA's base with adapters off, full's copy


def tiny_reference(tiny_model_dir, fused: bool) -> FrozenCopy:
    """The tiny model as the run's frozen reference: with the fused head where the run's plan has fused_loss."""
    model = load_model(Path(tiny_model_dir), torch.float32).eval()
    if fused:
        install_loss_head(model)
    return FrozenCopy(model, "the tiny model")


@pytest.mark.slow
def test_the_kept_values_are_the_per_step_references_log_probs(runs, tiny_model_dir):
    """Each pair's values, as the step's arithmetic computes them one pair a batch, against the file (both runs'
    references are the tiny model's weights in fp32 on CPU)."""
    cfg = build_config(values(tiny_model_dir, runs["work"] / "check", runs["work"] / "tokenized"))
    tokenizer = load_tokenizer(tiny_model_dir)
    train, _ = prepare_datasets(cfg, tokenizer, show_progress=False, report=False)
    pairs = train.dataset
    fused = json.loads((runs["work"] / "full-read" / "run_plan.json").read_text())["fused_loss"]
    reference = tiny_reference(tiny_model_dir, fused)
    step = np.stack([reference_logps(reference, collate_pairs([[i]], pairs, tokenizer.pad_token_id),
                                     torch.device("cpu"), False, False, fused).numpy() for i in range(len(pairs))])
    for folder in runs["full-read"]["folders"]:
        kept, problem = read(folder, len(pairs))
        assert problem is None
        np.testing.assert_allclose(kept, step, rtol=0, atol=1e-6)  # on CPU in fp32 they are equal bit for bit
        assert (kept < 0).all()


@pytest.mark.slow
def test_a_damaged_values_file_is_computed_again_with_a_line_saying_so(runs, tiny_model_dir, caplog):
    """A flipped byte in the full run's values: the next start names the damage in one line and computes them again,
    the same values; a sound file is read without building the reference."""
    cfg = build_config(values(tiny_model_dir, runs["work"] / "again", runs["work"] / "tokenized",
                              finetuning_type="full", precompute_ref_log_probs=True))
    plan = json.loads((runs["work"] / "full-read" / "run_plan.json").read_text())
    plan = RunPlan(**{k: v for k, v in plan.items() if k in RunPlan.__dataclass_fields__})
    tokenizer = load_tokenizer(tiny_model_dir)
    train, evaluation = prepare_datasets(cfg, tokenizer, show_progress=False, report=False)
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    made = []

    def make_reference():
        made.append(1)
        return tiny_reference(tiny_model_dir, plan.fused_loss)

    folder = next(f for f in runs["full-read"]["folders"] if f not in runs["lora-computed"]["folders"])
    sound = (folder / VALUES).read_bytes()
    kept = precompute_reference(cfg, plan, env, tokenizer.pad_token_id, [train, evaluation], make_reference, False)
    assert made == [] and "read from" in kept.reason
    for damage in ("flip", "cut"):
        data = bytearray(sound)
        if damage == "flip":
            data[-3] ^= 0xFF  # in the last value
        (folder / VALUES).write_bytes(bytes(data) if damage == "flip" else bytes(data[:-8]))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="meshtune"):
            again = precompute_reference(cfg, plan, env, tokenizer.pad_token_id, [train, evaluation],
                                         make_reference, False)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"{folder} is damaged" in warnings[0], warnings
        assert ("sha256 differs" if damage == "flip" else "(partial)") in warnings[0]
        assert "computing the reference's log-probs again" in warnings[0]
        assert (folder / VALUES).read_bytes() == sound  # written again, as computed before
        assert all((again.values[key] == kept.values[key]).all() for key in kept.values)
    assert len(made) == 2


@pytest.mark.slow
def test_another_reference_is_keyed_apart(runs, tiny_model_dir, tmp_path):
    plan = RunPlan(parallel="ddp", bf16=False, frozen_bf16=False, bf16_weights=False, padding_free=False,
                   fused_loss=False, compile=False, recompute=0, blocks_per_unit=None, hsdp_shard_size=None,
                   reshard_after_forward=None, gradient_reduction="once_per_step", cpu_offload=False,
                   gradient_accumulation_steps=1, fused_adamw=False, gc_interval=0, weights_from_rank0=False,
                   grad_sync=None, grad_reduce_dtype=None, fsdp_prefetch=None, resumed_from=None)
    other_model = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other_model)

    def folder(plan_=plan, **extra):
        cfg = build_config(values(tiny_model_dir, tmp_path / "o", tmp_path / "t", finetuning_type="full",
                                  precompute_ref_log_probs=True, **extra))
        return values_folder(tmp_path, "pairs-key", json.dumps(reference_identity(cfg, plan_), sort_keys=True))

    same = folder()
    assert folder() == same
    assert folder(ref_model=str(other_model)) != same  # another folder, even of the same files
    copied = folder(ref_model=str(other_model))
    weights = next(other_model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert folder(ref_model=str(other_model)) != copied  # the same folder with other weights
    assert folder(plan_=RunPlan(**{**plan.__dict__, "bf16": True})) != same
    assert values_folder(tmp_path, "other-pairs", "x") != values_folder(tmp_path, "pairs-key", "x")


def test_the_key_is_refused_where_no_reference_or_another_stage_computes_it(tiny_model_dir):
    base = base_config(tiny_model_dir, "d.jsonl", Path("out"), stage="dpo", precompute_ref_log_probs=True)
    for loss in ("orpo", "simpo"):
        with pytest.raises(Exception, match=f"precompute_ref_log_probs: true .* pref_loss: {loss} compares no "
                                            f"reference"):
            build_config({**base, "pref_loss": loss})
    with pytest.raises(Exception, match="precompute_ref_log_probs: true is for stage: dpo; stage: kto"):
        build_config({**base, "stage": "kto"})
    with pytest.raises(Exception, match="precompute_ref_log_probs: preference-training keys"):
        build_config({**base, "stage": "sft"})
    # a lever, not the math: a run may resume with it turned on or off
    assert build_config(base).hash() == build_config({**base, "precompute_ref_log_probs": False}).hash()
    # TRL's name in a TRL-style file, as beta and loss_type are read
    cfg = load_job_config(None, [f"model_name_or_path={tiny_model_dir}", "dataset=d.jsonl", "stage=dpo"],
                          {"precompute_ref_log_probs": True, "beta": 0.2, "loss_type": "ipo"}).config
    assert cfg.precompute_ref_log_probs and cfg.pref_beta == 0.2 and cfg.pref_loss == "ipo"


@pytest.mark.parametrize("values, on, why", [
    ({"finetuning_type": "full"}, True, "auto: on: the reference is a frozen copy"),
    ({"finetuning_type": "lora", "ref_model": "/r"}, True, "auto: on: the reference is a frozen copy"),
    ({"finetuning_type": "lora", "num_train_epochs": 3}, True, "auto: on: num_train_epochs 3 read each pair"),
    ({"finetuning_type": "lora", "num_train_epochs": 1}, False, "auto: off: .* each pair is read once"),
    ({"finetuning_type": "qlora", "max_steps": 500}, False, "auto: off: .* max_steps decides"),
    ({"finetuning_type": "full", "precompute_ref_log_probs": False}, False, None),
    ({"finetuning_type": "lora", "precompute_ref_log_probs": True}, True, None),
    ({"finetuning_type": "full", "pref_loss": "simpo"}, False, None),
])
def test_auto_precomputes_where_it_saves_a_frozen_copy_or_forwards_and_says_why(values, on, why):
    from plans import plan_for

    plan = plan_for({"stage": "dpo", "parallel": "ddp", **values}, world_size=1)
    assert plan.precompute_ref_log_probs is on
    if why is None:  # set by the config (or no reference): no reason of auto's
        assert "precompute_ref_log_probs" not in plan.why
    else:
        assert re.match(why, plan.why["precompute_ref_log_probs"]), plan.why["precompute_ref_log_probs"]
    assert plan.why["reference"].startswith("precomputed") is on or values.get("pref_loss") == "simpo"
