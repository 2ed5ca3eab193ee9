"""meshtune against the reference stack, HF Trainer + PEFT: the same tiny model, the same tokens in the same order
(read from meshtune's tokenized cache and its global batch plan), the same hyperparameters, one CPU process, fp32.

Each step's loss, learning rate and gradient norm agree within 1e-5 and so do the trained weights: any drift from
HF's math (the schedule and its warmup, the loss over accumulated micro-batches, clipping, AdamW and the parameters
it does not decay, LoRA's initialisation) fails here. HF gets what an HF user would give it: its own collator,
optimizer and `get_scheduler`; only the sampler is replaced, to replay meshtune's order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from conftest import base_config
from meshtune.config import TrainConfig, build_config
from meshtune.model.model_dir import load_tokenizer
from meshtune.model.parallel import unwrap
from meshtune.train.loop import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from hf_replay import InMeshtuneOrder, StepLogs, samples_in_meshtune_order  # noqa: E402  (the bench's replay)

STEPS = 30


@pytest.fixture
def one_thread():
    """The model's matrices are a few dozen wide: a second thread only adds synchronisation, and beside other
    processes on two cores it makes each step several times slower. Both stacks run under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_trainer(cfg: TrainConfig, samples: list[dict], output_dir: Path) -> tuple[Trainer, StepLogs]:
    """HF Trainer + PEFT set up as the config says, in HF's own terms."""
    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=torch.float32)
    if cfg.is_lora:
        torch.manual_seed(cfg.seed)  # as meshtune seeds right before adding the adapters
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.resolved_lora_alpha,
                                                 lora_dropout=cfg.lora_dropout, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a fraction below 1 is a share of all steps
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm, optim=cfg.optim, seed=cfg.seed,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        bf16=False, fp16=False, disable_tqdm=True)
    logs = StepLogs()
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    trainer = InMeshtuneOrder(model=model, args=args, train_dataset=samples, callbacks=[logs],
                              data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))
    return trainer, logs


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method, accumulation, schedule", [("lora", 1, "cosine"), ("lora", 2, "linear"),
                                                            ("full", 1, "constant_with_warmup"), ("full", 2, "cosine")])
def test_meshtune_trains_as_hf_trainer_and_peft(tmp_path, tiny_model_dir, tiny_dataset, one_thread, method,
                                                 accumulation, schedule):
    cfg = build_config(base_config(
        tiny_model_dir, tiny_dataset, tmp_path / "meshtune", finetuning_type=method, lora_rank=4,
        per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, max_steps=STEPS,
        learning_rate=5e-3 if method == "lora" else 1e-3, lr_scheduler_type=schedule, warmup_ratio=0.1,
        weight_decay=0.1, adam_beta2=0.98, adam_epsilon=1e-7, max_grad_norm=1.0, optim="adamw_torch",
        save_final=False))
    result = run(cfg, keep_model=True)
    ours = result.records
    trainer, logs = hf_trainer(cfg, samples_in_meshtune_order(cfg, 1)[0], tmp_path / "hf")
    trainer.train()
    theirs = logs.records

    assert len(ours) == len(theirs) == STEPS
    assert [r["lr"] for r in ours] == pytest.approx([r["learning_rate"] for r in theirs], rel=1e-12, abs=0)
    assert ours[0]["lr"] == 0.0 < ours[1]["lr"]  # warmup starts from 0, as HF's
    assert any(r["grad_norm"] > cfg.max_grad_norm for r in ours)  # clipping is part of what is compared
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-5)
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], rel=1e-5)
    mine, hf = trainable(unwrap(result.model)), trainable(trainer.model)
    assert mine.keys() == hf.keys()
    for name, weight in mine.items():
        torch.testing.assert_close(weight, hf[name], rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")
