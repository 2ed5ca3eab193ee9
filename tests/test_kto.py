"""stage: kto against TRL's KTOTrainer, on CPU in fp32: the loss, the metrics it logs and the gradients of a LoRA
model's adapters for the same batch, TRL's own `_compute_loss` driven on TRL's own collated tensors (its KL
completions rotated by one within the batch, as its dataset preparation makes them); and the pure loss function
against TRL's for chosen / rejected weights. trl is a test-only dependency."""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import LLAMAFACTORY_DATA, base_config, read_metrics, run_cli_here, sentence
from meshtune.config import build_config
from meshtune.data.chat_template import ChatTemplate
from meshtune.data.collate import IGNORE
from meshtune.data.pipeline import prepare_datasets
from meshtune.errors import ConfigError, DataError
from meshtune.model.model_dir import load_tokenizer
from meshtune.model.reference import AdaptersOff
from meshtune.distributed import DistEnv
from meshtune.train.objectives import normalised
from meshtune.train.objectives.kto import KTOLoss
from meshtune.train.objectives.kto_loss import METRICS, KTOSettings

trl = pytest.importorskip("trl")

CPU = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                      unwrap_model=lambda m: m)
CPU_ENV = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


class Samples:
    """Unpaired samples as the tokenized dataset holds them: prompt then response ids, labels on the response."""

    def __init__(self, prompts: list[list[int]], responses: list[list[int]], desirable: list[bool]):
        self.items = [(np.asarray(p + r), np.asarray([IGNORE] * len(p) + r)) for p, r in zip(prompts, responses)]
        self.prompts, self.responses = prompts, responses
        self.desirable = np.asarray(desirable)
        self.lengths = np.asarray([len(ids) for ids, _ in self.items])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def samples(vocab: int, desirable=(True, False, True, True, False)) -> Samples:
    generator = torch.Generator().manual_seed(3)
    lengths = [(4, 6), (7, 3), (5, 8), (3, 4), (6, 5)]
    draw = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    return Samples([draw(p) for p, _ in lengths], [draw(r) for _, r in lengths], list(desirable))


def lora_model(tiny_model_dir, seed: int = 3):
    """The tiny Qwen2 with LoRA on every linear layer, its B matrices non-zero so that policy and reference differ."""
    from peft import LoraConfig, get_peft_model

    from meshtune.model.loading import load_model

    torch.manual_seed(0)  # LoRA's A matrices
    model = get_peft_model(load_model(tiny_model_dir, torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def trl_kto(model, data: Samples, settings: KTOSettings):
    """TRL KTOTrainer's loss and logged metrics for the batch of every sample, its reference the adapters off."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "mean_logits"))
    completions = data.responses
    examples = [{"prompt_ids": p, "completion_ids": c, "KL_completion_ids": kl, "label": bool(tag)}
                for p, c, kl, tag in zip(data.prompts, completions, completions[-1:] + completions[:-1],
                                         data.desirable)]
    inputs = DataCollatorForUnpairedPreference(pad_token_id=0)(examples)
    trainer = SimpleNamespace(model=model, ref_model=None, accelerator=CPU, aux_loss_enabled=False,
                              precompute_ref_logps=False, calculate_KL=True, loss_type="kto", beta=settings.beta,
                              desirable_weight=settings.desirable_weight,
                              undesirable_weight=settings.undesirable_weight,
                              args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(trainer, m, b)
    loss = KTOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, {name: values[-1] for name, values in trainer._metrics["eval"].items()}


def meshtune_kto(model, data: Samples, settings: KTOSettings, micro: list[list[int]]):
    """meshtune's objective over one step of `data` in its order, cut into the micro-batches `micro` (indices):
    the step's loss and reported metrics, each micro-batch's backward as the loop runs it."""
    objective = KTOLoss(model, CPU_ENV, pad_id=0, autocast_bf16=False, settings=settings, cutoff_len=64,
                        reference=AdaptersOff(model))
    micro_rows = [[[i] for i in batch] for batch in micro]
    objective.prepare_step([[i] for i in range(len(data))], micro_rows, data)
    batches = [objective.collate(rows, data, packed=False) for rows in micro_rows]
    count = sum(objective.count(b) for b in batches)
    total, sums = torch.zeros((), dtype=torch.float64), 0
    for batch in batches:
        loss = objective.loss_sum(batch)
        normalised(loss, count).backward()
        total, sums = total + loss.detach().double(), sums + objective.metric_sums(batch)
    return normalised(total, count), {name: float(v) for name, v in objective.metrics(sums, count).items()}


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
def test_kto_loss_metrics_and_lora_gradients_are_trls(tiny_model_dir, weights):
    model = lora_model(tiny_model_dir)
    theirs = copy.deepcopy(model)
    data = samples(model.config.vocab_size)
    settings = KTOSettings(beta=0.5, desirable_weight=weights[0], undesirable_weight=weights[1])
    want, logged = trl_kto(theirs, data, settings)
    got, reported = meshtune_kto(model, data, settings, [list(range(len(data)))])
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=1e-6)
    assert logged["kl"] > 0  # the KL term is in play, not clamped away
    for name in METRICS:
        assert reported[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-6), name
    want.backward()
    grads = 0
    for (name, mine), other in zip(model.named_parameters(), theirs.parameters()):
        if mine.requires_grad:
            torch.testing.assert_close(mine.grad, other.grad, rtol=1e-5, atol=1e-6, msg=name)
            grads += int(mine.grad.abs().sum() > 0)
    assert grads > 0


def test_the_step_is_the_same_split_into_micro_batches(tiny_model_dir):
    """Accumulation (or processes) see one KL over the step's pairs: the loss, metrics and gradients of one
    micro-batch of five equal those of three micro-batches of it."""
    whole, split = lora_model(tiny_model_dir), lora_model(tiny_model_dir)
    data = samples(whole.config.vocab_size)
    settings = KTOSettings(beta=0.5)
    one, one_reported = meshtune_kto(whole, data, settings, [[0, 1, 2, 3, 4]])
    three, three_reported = meshtune_kto(split, data, settings, [[0, 1], [2, 3], [4]])
    torch.testing.assert_close(three, one, rtol=1e-6, atol=1e-7)
    assert three_reported == pytest.approx(one_reported, rel=1e-5)  # padding differs: fp32 rounding
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_step_without_undesirable_samples_reports_no_rejected_metrics(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    data = samples(model.config.vocab_size, desirable=(True,) * 5)
    _, reported = meshtune_kto(model, data, KTOSettings(), [[0, 1, 2, 3, 4]])
    assert np.isnan(reported["rewards/rejected"]) and np.isnan(reported["rewards/margins"])
    assert not np.isnan(reported["rewards/chosen"])
    from meshtune.train.metrics import reported_means

    means = reported_means({name: [torch.tensor(value)] for name, value in reported.items()})
    assert "rewards/rejected" not in means and means["kl"] == reported["kl"]


# ---- data, config and the run


def kto_data(path: Path, records: int = 24) -> Path:
    """Unpaired records in the messages format with a `label` tag, of varied lengths, some multi-turn."""
    rng = random.Random(2)
    with path.open("w") as f:
        for i in range(records):
            messages = []
            for _ in range(1 + (i % 4 == 0)):
                messages += [{"role": "user", "content": sentence(rng, 2, 12)},
                             {"role": "assistant", "content": sentence(rng, 1, 10)}]
            f.write(json.dumps({"messages": messages, "label": i % 3 != 1}) + "\n")
    return path


def kto_config(tmp_path: Path, model_dir: Path, dataset, **extra):
    return build_config(base_config(model_dir, dataset, tmp_path / "out", stage="kto", **extra))


def test_kto_samples_render_as_sft_renders_them_with_the_last_answer_trained(tmp_path, tiny_model_dir):
    """The LLaMA-Factory entry (sharegpt, kto_tag) and the same conversations as a messages file agree token for
    token with SFT's rendering; only the last assistant turn is labelled; each tag is the record's."""
    tokenizer = load_tokenizer(tiny_model_dir)
    records = json.loads((LLAMAFACTORY_DATA / "kto_en_demo.json").read_text())
    named = prepare_datasets(kto_config(tmp_path, tiny_model_dir, "kto_en_demo", dataset_dir=str(LLAMAFACTORY_DATA),
                                        cutoff_len=512), tokenizer, False)[0]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))
    sft = prepare_datasets(build_config(base_config(tiny_model_dir, plain, tmp_path / "sft", cutoff_len=512)),
                           tokenizer, False)[0]
    assert len(named) == len(sft) == len(records)
    assert named.desirable.tolist() == [r["label"] for r in records]
    template = ChatTemplate(tokenizer, None)
    for i, record in enumerate(records):
        (ids, labels), (sft_ids, sft_labels) = named[i], sft[i]
        assert ids.tolist() == sft_ids.tolist()
        last = template.encode(record["messages"][:-1])[0]  # the prompt: everything before the last answer
        assert (labels[:len(last)] == IGNORE).all() and (labels[len(last):] == sft_labels[len(last):]).all()
    assert (sft[2][1][:len(template.encode(records[2]["messages"][:2])[0])] != IGNORE).any()  # sft trains turn 1


@pytest.mark.parametrize("record, problem", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "no 'kto_tag' or 'label': each record says whether its response is desirable"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "label": 1},
     "'label' is 1, not a boolean: write true"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}, {"role": "assistant", "content": " "}], "label": True},
     r"the response \(the last assistant turn\) is empty"),
    ({"prompt": "a", "completion": "", "label": False}, r"the response \(the last assistant turn\) is empty"),
    ({"prompt": "a", "completion": "b", "label": "yes"}, "'label' is 'yes', not a boolean"),
])
def test_each_bad_record_is_named_or_skipped(tmp_path, tiny_model_dir, record, problem):
    good = {"prompt": "a b", "completion": "c", "label": True} if "prompt" in record else {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "label": True}
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"kto\.jsonl: record 2 \(line 2\): {problem}.*\(stage: kto"):
        prepare_datasets(kto_config(tmp_path, tiny_model_dir, path), load_tokenizer(tiny_model_dir), False)
    data = prepare_datasets(kto_config(tmp_path, tiny_model_dir, path, skip_invalid=True),
                            load_tokenizer(tiny_model_dir), False)[0]
    assert len(data) == 1 and data.stats["n_skipped_invalid"] == 1


def test_trl_prompt_completion_records_and_a_long_prompt_cut_from_its_start(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    long_prompt = " ".join(["the quick brown fox"] * 30)
    path = tmp_path / "trl.jsonl"
    rows = [{"prompt": long_prompt, "completion": "a lazy dog", "label": True},
            {"prompt": [{"role": "user", "content": "seven birds"}],
             "completion": [{"role": "assistant", "content": "sing"}], "label": False},
            {"prompt": "rain", "completion": " ".join(["sun and wind"] * 40), "label": True}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_datasets(kto_config(tmp_path, tiny_model_dir, path, cutoff_len=40), tokenizer, False)[0]
    assert data.stats["n_truncated"] == 1 and data.stats["n_dropped_long_response"] == 1 and len(data) == 2
    ids, labels = data[0]
    whole = ChatTemplate(tokenizer, None).encode([{"role": "user", "content": long_prompt},
                                                  {"role": "assistant", "content": "a lazy dog"}])[0]
    assert len(ids) == 40 and ids.tolist() == whole[-40:]  # the response whole, the prompt's start cut
    assert (labels != IGNORE).sum() == len(tokenizer.encode("a lazy dog", add_special_tokens=False)) + 2
    assert data.desirable.tolist() == [True, False]


def test_kto_keys_trl_names_and_refusals(tmp_path, tiny_model_dir, tiny_dataset, capfd):
    from meshtune.compat.job_config import load_job_config

    loaded = load_job_config(None, [f"model_name_or_path={tiny_model_dir}", "stage=kto", f"dataset={tiny_dataset}",
                                    "beta=0.3", "desirable_weight=1.4", "undesirable_weight=0.6"]).config
    assert (loaded.pref_beta, loaded.kto_chosen_weight, loaded.kto_rejected_weight) == (0.3, 1.4, 0.6)
    assert kto_config(tmp_path, tiny_model_dir, tiny_dataset, finetuning_type="full", pref_beta=0.2).pref_beta == 0.2
    for extra, message in [({"pref_loss": "ipo", "simpo_gamma": 1.0},
                            "pref_loss, simpo_gamma: read only by stage: dpo; this run is stage: kto: drop them"),
                           ({"ref_model_adapters": "/a"}, "ref_model_adapters is an adapter merged into ref_model")]:
        with pytest.raises(ConfigError, match=message):
            kto_config(tmp_path, tiny_model_dir, tiny_dataset, **extra)
    for extra, refusal in [({"packing": True}, "packing: true"),
                           ({"context_parallel": 2}, "context_parallel above 1"),
                           ({"mask_history": True}, "train_on_prompt or mask_history")]:
        with pytest.raises(ConfigError, match=f"stage: kto cannot be combined with {refusal}"):
            kto_config(tmp_path, tiny_model_dir, tiny_dataset, **extra)
    assert kto_config(tmp_path, tiny_model_dir, tiny_dataset, tensor_parallel=2).tensor_parallel == 2
    result = run_cli_here(["train", "--help"], capfd)
    section = result.stdout.split("preference training (stage: dpo and kto)", 1)[1]
    assert all(key in section.split("\n\n", 1)[0] for key in ("pref_beta", "kto_chosen_weight",
                                                               "kto_rejected_weight"))


@pytest.mark.slow
def test_kto_losses_are_the_same_on_one_process_two_and_with_accumulation(tmp_path, tiny_model_dir):
    """One global batch of 4 a step as 1 process x 1 micro-batch of 4, 1 x 2 micro-steps of 2, and 2 processes x 1
    (zero3: FSDP2 runs the reference with the adapters off; padding-free rows, each sample's log-prob a segment's),
    and 2 processes of one tensor-parallel group x 2 micro-steps of 2 (each log-prob across the vocabulary's shares,
    the group's KL sums counted once): one KL a step over the same mismatched pairs, so every step's loss and the
    final eval loss agree (the eval on 2 processes too)."""
    from test_topology import assert_close, train_all, train_losses

    data = kto_data(tmp_path / "kto.jsonl")
    layouts = [("lora", "ddp", 1, 1, {"per_device_train_batch_size": 4}), ("lora", "ddp", 1, 2, {}),
               ("lora", "zero3", 2, 1, {"padding_free": True}), ("lora", "ddp", 2, 2, {"tensor_parallel": 2})]
    kto = {"stage": "kto", "max_steps": 3}
    train_all(tmp_path, tiny_model_dir, data, [(m, p, n, a, {**kto, **e}) for m, p, n, a, e in layouts])
    one = train_losses(tmp_path, tiny_model_dir, data, "lora", "ddp", 1, 1, **kto, per_device_train_batch_size=4)
    assert one[0] == 0.5 and len(set(one)) == len(one)  # the policy starts as its reference, then moves
    for method, parallel, nproc, accumulation, extra in layouts[1:]:
        losses = train_losses(tmp_path, tiny_model_dir, data, method, parallel, nproc, accumulation, **kto, **extra)
        assert_close(losses, one, f"kto on {nproc} process(es) x {accumulation} micro-step(s)")


def test_a_full_kto_run_trains_against_a_frozen_copy_of_the_initial_model(tmp_path, tiny_model_dir):
    """finetuning_type: full: the reference is a frozen copy of model_name_or_path (model/reference.py, as dpo's). At
    step 1 the policy is that model, so each log-ratio, the KL and the rewards are 0 and every sample's loss is
    1 - sigmoid(0) = 0.5; then the policy moves and the copy does not. The same run with ref_model set to that
    folder trains the same, bit for bit. The held-out set reports KTO's metrics."""
    from meshtune.train.loop import run

    data = kto_data(tmp_path / "kto.jsonl", 12)
    steps = lambda name, **extra: [r for r in run(kto_config(  # noqa: E731
        tmp_path / name, tiny_model_dir, data, finetuning_type="full", max_steps=2, logging_steps=1,
        per_device_train_batch_size=8, learning_rate=1e-3, save_final=False, val_size=4, **extra)).records
        if "loss" in r]
    default = steps("copy")
    first, second = default
    evaluated = {key for key in second if key.startswith("eval_")}  # KTO's metrics of the held-out set, by name
    assert {"eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/chosen"} <= evaluated
    assert evaluated <= {"eval_loss", *(f"eval_{name}" for name in METRICS)}
    assert first["loss"] == 0.5 and first["kl"] == 0.0
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert second["loss"] != 0.5 and second["rewards/margins"] != 0.0  # the policy moved away from its reference
    pick = lambda records: [{k: v for k, v in r.items() if "/" in k or k in ("loss", "kl", "grad_norm")}  # noqa: E731
                            for r in records]
    assert pick(steps("ref_model", ref_model=str(tiny_model_dir))) == pick(default)


def test_preview_shows_each_samples_tag_and_its_trained_response(tmp_path, tiny_model_dir):
    from meshtune.data.preview import preview, render_text

    cfg = kto_config(tmp_path, tiny_model_dir, "kto_en_demo", dataset_dir=str(LLAMAFACTORY_DATA), cutoff_len=60)
    report = preview(cfg, load_tokenizer(tiny_model_dir), samples=3)
    assert report["datasets"]["train"]["tags"] == {"desirable": 4, "undesirable": 4}
    assert [s["desirable"] for s in report["samples"]] == [True, False, True]
    assert report["datasets"]["train"]["truncated"]["count"] > 0
    text = render_text(report, color=False)
    assert "responses: 4 desirable, 4 undesirable" in text and "trains each sample's response" in text
    assert "record 2): undesirable; " in text and "⟦Ooh ah! Bananas! The capital is a banana." in text
    whole = preview(cfg.model_copy(update={"cutoff_len": 512}), load_tokenizer(tiny_model_dir), indices=[2])
    kinds = {segment["text"].strip(): segment["kind"] for segment in whole["samples"][0]["segments"]}
    assert kinds["Blue is another primary colour.<|im_end|>"] == "trained"
    assert "Red.<|im_end|>" in next(text for text, kind in kinds.items() if kind == "context")  # prompt here


def test_a_kto_run_resumed_from_its_checkpoint_goes_on_bit_for_bit(tmp_path, tiny_model_dir):
    """3 steps, then the same run again from checkpoint-1: the KL of each step is formed anew from the step's rows,
    so the losses and metrics of steps 2 and 3 and the final adapter are the run's own."""
    from meshtune.train.loop import run

    cfg = kto_config(tmp_path, tiny_model_dir, kto_data(tmp_path / "kto.jsonl", 12), max_steps=3, save_steps=1,
                     per_device_train_batch_size=2, gradient_accumulation_steps=2)
    through = [{k: v for k, v in r.items() if "/" in k or k in ("loss", "kl")} for r in run(cfg).records]
    out = Path(cfg.output_dir)
    adapter = (out / "final" / "adapter_model.safetensors").read_bytes()
    for later in ("checkpoint-2", "checkpoint-3", "final"):
        shutil.rmtree(out / later)
    run(cfg)
    resumed = [{k: v for k, v in r.items() if "/" in k or k in ("loss", "kl")} for r in read_metrics(out)]
    assert resumed == through and through[2]["kl"] > 0
    assert (out / "final" / "adapter_model.safetensors").read_bytes() == adapter


def test_a_kto_cache_never_serves_sft_of_the_same_file(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    data = kto_data(tmp_path / "kto.jsonl", 6)
    cache = {"tokenized_path": str(tmp_path / "cache")}
    kto = prepare_datasets(kto_config(tmp_path, tiny_model_dir, data, **cache), tokenizer, False)[0]
    sft = prepare_datasets(build_config(base_config(tiny_model_dir, data, tmp_path / "sft", **cache)), tokenizer,
                           False)[0]
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 2
    assert kto.desirable is not None and sft.desirable is None
    assert int((np.asarray(sft.labels) != IGNORE).sum()) > int((np.asarray(kto.labels) != IGNORE).sum())
