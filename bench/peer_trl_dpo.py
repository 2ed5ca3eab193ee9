"""Peer baseline for preference training: TRL's DPOTrainer (HF Trainer + PEFT underneath), plain or with Liger's fused
DPO loss (`--liger 1`, DPOConfig.use_liger_kernel). bench/dpo_speed.py runs it beside meshtune's stage: dpo.

Usage (on a GPU machine; needs trl and datasets, and liger-kernel for --liger 1). Checked on CPU in a fresh venv
(torch 2.13, trl 1.16.0, datasets 5.2.0, 2026-12-01). Under Python 3.12 datasets' fingerprints fail to pickle
pyarrow's MonthDayNano; the script then fingerprints with random names (fingerprints_that_never_fail).
  python3 bench/peer_trl_dpo.py --size 7b --mode lora --bs 2 --steps 25
  python3 bench/peer_trl_dpo.py --size tiny --mode lora --bs 2 --steps 6     # CPU smoke test
  python3 bench/peer_trl_dpo.py --size 7b --pairs pairs.jsonl --tokenizer MODEL_DIR   # the pairs meshtune reads
Modes: lora (r 64, alpha 16, dropout 0.05, every linear layer; the reference is the base with adapters off) | full
(a frozen reference copy). Sizes: bench/workspace.py's (Qwen2.5 shapes, random init: weights don't change speed).

Pairs are synthetic unless --pairs names a file: a prompt of U(--prompt-min, --prompt-max) tokens, a chosen and a
rejected response of U(--resp-min, --resp-max) tokens each (seed 1), written as text over a word-level tokenizer
whose every word is one token, so TRL's own tokenization gives exactly these lengths (+ EOS). tokens/s counts
prompt + chosen + rejected tokens (the prompt once for each response, as both forwards process it), without padding,
of the batches the timed steps trained (their attention masks).
Prints one JSON line: tokens/s, seconds a step and peak GiB after 5 untimed steps.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import SIZES, WARMUP, model_config  # noqa: E402

CUDA = torch.cuda.is_available()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5b", choices=sorted(SIZES))
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--resp-min", type=int, default=64)
    p.add_argument("--resp-max", type=int, default=512)
    p.add_argument("--gc", type=int, default=1)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--liger", type=int, default=0)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss", default="sigmoid")
    p.add_argument("--precompute-ref", type=int, default=0)
    p.add_argument("--pairs", help="a JSONL of prompt / chosen / rejected text to train on instead of synthetic pairs")
    p.add_argument("--tokenizer", help="the folder whose tokenizer reads --pairs (AutoTokenizer, as meshtune loads it)")
    return p.parse_args()


def word_pairs(a, vocab: int):
    """The synthetic pairs over a word-level tokenizer: every word one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 2)}
    words["<pad>"], words["<eos>"] = vocab - 2, vocab - 1
    tk = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    g = torch.Generator().manual_seed(1)

    def text(k):
        return " ".join(f"w{i}" for i in torch.randint(0, vocab - 2, (k,), generator=g).tolist())

    def u(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = [{"prompt": text(u(a.prompt_min, a.prompt_max)), "chosen": " " + text(u(a.resp_min, a.resp_max)),
             "rejected": " " + text(u(a.resp_min, a.resp_max))} for _ in range(a.bs * (a.steps + 5))]
    return tok, rows


def file_pairs(a):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    with open(a.pairs) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return tok, rows


def sync():
    if CUDA:
        torch.cuda.synchronize()


class Timer(TrainerCallback):
    def __init__(self):
        self.t = []

    def on_step_begin(self, *_, **__):
        sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, *_, **__):
        sync()
        self.t.append(time.perf_counter() - self.t0)


def fingerprints_that_never_fail() -> None:
    """datasets fingerprints every dataset and transform by pickling it with dill; under Python 3.12 dill cannot
    pickle pyarrow's MonthDayNano type (PicklingError: "not found as builtins.MonthDayNano"), and the first Dataset
    fails. A fingerprint only names cache files, which this run never reuses: where hashing fails, a random one."""
    from datasets.fingerprint import Hasher, generate_random_fingerprint

    hash_ = Hasher.hash.__func__

    def hash_or_random(cls, value):
        try:
            return hash_(cls, value)
        except Exception:  # noqa: BLE001 - any value dill cannot pickle
            return generate_random_fingerprint()

    Hasher.hash = classmethod(hash_or_random)


def main():
    a = parse_args()
    fingerprints_that_never_fail()
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    cfg = model_config(a.size)  # the shapes meshtune's bench runs (bench/workspace.py)
    tok, rows = file_pairs(a) if a.pairs else word_pairs(a, cfg.vocab_size)
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA else "cpu"):  # random init on the card: minutes less on the CPU at 7B
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if CUDA else torch.float32)
    model.config._attn_implementation = a.attn
    peft_config = None
    if a.mode == "lora":
        peft_config = LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                                                 "down_proj"])
    # full fine-tuning's reference: a frozen copy made here (TRL would load one from the model's name, and a
    # random-init model has none)
    ref_model = copy.deepcopy(model).requires_grad_(False).eval() if a.mode == "full" else None
    timer = Timer()
    args = DPOConfig(output_dir="/tmp/peer-dpo", per_device_train_batch_size=a.bs, max_steps=a.steps, bf16=CUDA,
                     use_cpu=not CUDA, learning_rate=5e-6, lr_scheduler_type="cosine", logging_steps=1000,
                     save_strategy="no", report_to="none", gradient_checkpointing=bool(a.gc),
                     dataloader_num_workers=0, beta=a.beta, loss_type=[a.loss], max_length=None,
                     use_liger_kernel=bool(a.liger), precompute_ref_log_probs=bool(a.precompute_ref),
                     dataset_num_proc=None)
    batch_tokens = []

    class CountingDPOTrainer(DPOTrainer):
        """Records each step's tokens as the batch holds them (its attention mask: a row for each response of
        every pair, the prompt in both), so tokens/s counts exactly the pairs the timed steps trained."""

        def training_step(self, model, inputs, *rest, **kwargs):
            batch_tokens.append(int(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, *rest, **kwargs)

    trainer = CountingDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=tok, peft_config=peft_config, callbacks=[timer])
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps = timer.t[WARMUP:]
    if len(batch_tokens) != len(timer.t):
        raise SystemExit(f"{len(batch_tokens)} batches for {len(timer.t)} steps: the count needs one batch a step")
    toks = sum(batch_tokens[WARMUP:])
    print(json.dumps(dict(
        peer="trl_dpo" + ("+liger" if a.liger else ""), size=a.size, mode=a.mode, bs=a.bs, gc=a.gc, attn=a.attn,
        loss=a.loss, precompute_ref=a.precompute_ref, tokens_per_s=round(toks / sum(steps)),
        step_s=round(sum(steps) / len(steps), 4), tokens_per_step=round(toks / len(steps)),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None,
        gpu=torch.cuda.get_device_name() if CUDA else "cpu")))


if __name__ == "__main__":
    main()
