"""HF Trainer replaying a meshtune run: full fine-tuning of the same model on the same samples, step by step in
meshtune's order (read from meshtune's tokenized cache and its global batch plan), with the same hyperparameters,
so the two stacks' loss curves can be laid side by side.

Each optimizer step trains exactly the samples meshtune's step trains (its global batch: per_device_train_batch_size
x gradient_accumulation_steps x the run's processes), here on one device: the same micro-batch size, and the
accumulation times the processes. HF gets what an HF user would give it otherwise: its own collator (padding to
the longest sample of a micro-batch), AdamW, `get_scheduler`, clipping and loss over accumulated micro-batches
(the token mean of the whole step); only the sampler is replaced, to replay meshtune's order. On a GPU it trains
as HF users do: fp32 weights and AdamW state, bf16 autocast (bf16=True), fused AdamW.

The last line printed is one JSON object: each step's loss, learning rate, gradient norm and trained tokens, the
seconds, the device and the peak GPU memory. Written to --out as well.

    python bench/hf_replay.py out/meshtune.yaml --processes 2 --out hf.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainerCallback

from meshtune.config import TrainConfig, build_config, load_yaml
from meshtune.data.pipeline import plan_steps, prepare_datasets
from meshtune.model.model_dir import load_tokenizer


class InMeshtuneOrder(Trainer):
    """HF Trainer reading its dataset front to back: the samples are already in meshtune's order."""

    def _get_train_sampler(self, *args, **kwargs) -> SequentialSampler:
        return SequentialSampler(self.train_dataset)


class StepLogs(TrainerCallback):
    """Every optimizer step's log (logging_steps 1) as HF Trainer reports it."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.records.append(dict(logs, step=state.global_step))


def read_config(path: str | Path) -> TrainConfig:
    return build_config(load_yaml(path), source=str(path))


def samples_in_meshtune_order(cfg: TrainConfig, processes: int) -> tuple[list[dict], list[int]]:
    """The samples of every optimizer step, in meshtune's order, and each step's token count. A step's samples
    are the same set whatever the processes, accumulation or padding-free balancing (the plan cuts one global
    batch), so the plan is read as one process with all the accumulation."""
    if cfg.packing:
        raise ValueError("packing: true: HF Trainer would train packed rows with attention across samples; "
                         "replay a run without packing")
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    train_data, _ = prepare_datasets(cfg, tokenizer, show_progress=False)
    batches, total_steps = plan_steps(cfg, train_data, 1, cfg.gradient_accumulation_steps * processes)
    samples, tokens = [], []
    for step in range(total_steps):
        if batches.rows_in_step(*batches.position(step)) < batches.global_batch:
            raise ValueError(f"step {step + 1} is an epoch's last, of fewer samples than the global batch: the replay "
                             f"hands HF Trainer one stream of samples, which it cuts into whole global batches; "
                             f"replay with dataloader_drop_last: true or max_steps inside the first epoch")
        count = 0
        for micro_batch in batches.micro_batches(*batches.position(step), 0):
            for (index,) in micro_batch:  # one sample a row: no packing
                ids, labels = train_data[index]
                samples.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids),
                                "labels": labels.tolist()})
                count += len(ids)
        tokens.append(count)
    return samples, tokens


def replay(cfg: TrainConfig, processes: int, output_dir: Path) -> dict:
    """Train as HF Trainer on one device (CUDA where there is one) and return the figures."""
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainingArguments

    if cfg.finetuning_type != "full":
        raise ValueError(f"finetuning_type: {cfg.finetuning_type}: this replay trains full fine-tuning")

    cuda = torch.cuda.is_available()
    samples, tokens = samples_in_meshtune_order(cfg, processes)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa")
    optim = cfg.optim if cfg.optim != "auto" else "adamw_torch_fused" if cuda else "adamw_torch"
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps * processes, max_steps=len(tokens),
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps or cfg.warmup_ratio,  # transformers 5: a fraction below 1 is a share of all steps
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm, optim=optim, seed=cfg.seed,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=not cuda, dataloader_num_workers=0,
        bf16=cuda, disable_tqdm=True)
    logs = StepLogs()
    trainer = InMeshtuneOrder(model=model, args=args, train_dataset=samples, callbacks=[logs],
                              data_collator=DataCollatorForSeq2Seq(load_tokenizer(cfg.model_name_or_path),
                                                                   padding=True))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    records = logs.records
    if [r["step"] for r in records] != list(range(1, len(tokens) + 1)):
        raise RuntimeError(f"HF Trainer logged steps {[r['step'] for r in records][:10]}..., not 1..{len(tokens)}")
    return dict(loss=[r["loss"] for r in records], lr=[r["learning_rate"] for r in records],
                grad_norm=[r.get("grad_norm") for r in records], tokens=tokens, wall_s=round(seconds, 1),
                device=torch.cuda.get_device_name() if cuda else "cpu",
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the meshtune run's config YAML (its model, data, tokenized_path and keys)")
    p.add_argument("--processes", type=int, default=1,
                   help="the processes the meshtune run trained on: its global batch is this many times a process's")
    p.add_argument("--out", required=True, help="where the JSON result is written")
    args = p.parse_args(argv)
    cfg = read_config(args.config)
    result = replay(cfg, args.processes, Path(args.out).parent / (Path(args.out).stem + "-trainer"))
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
