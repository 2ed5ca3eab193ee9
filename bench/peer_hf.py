"""The peer meshtune's speed table compares against: Hugging Face Trainer + PEFT, the stack most fine-tuning
scripts are built on, on the same model shape and the same samples as meshtune's bench rows; for Q-LoRA, the same
on bitsandbytes' 4-bit NF4, the Q-LoRA stack of Qwen's, LLaMA-Factory's and Axolotl's recipes.

What it trains: a random-init Qwen2 of a Qwen2.5 shape (bench/workspace.py; weights do not change speed), bf16
on CUDA, on the bench's synthetic samples (lengths uniform in --minlen..--maxlen, seed 1), padded per batch to
its longest sample. LoRA r 64, alpha 16, dropout 0.05 on q, k, v, o, up, gate and down projections (or full
fine-tuning), AdamW at lr 3e-4 with a cosine schedule and weight decay 0.1, gradient checkpointing on by default.
--mode qlora loads the model from a saved folder (bitsandbytes quantizes while loading): --model-dir, by default
the folder bench/speed_table.py trains meshtune's rows on (bench/workspace.py's build_model_dir under
/tmp/meshtune-bench/SIZE, written there first if missing). Every linear layer of the blocks in NF4 with double
quantization and bf16 compute (BitsAndBytesConfig), then peft's prepare_model_for_kbit_training and the same LoRA.
With --liger 1, Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear + cross-entropy) are switched on the
way HF users do it: TrainingArguments(use_liger_kernel=True).

What it measures, after 5 warm-up steps: tokens/s of real (non-padding) tokens over the wall time between the
ends of optimizer steps (data loading included, as meshtune's own tokens/s), seconds per step, and the peak of
torch.cuda.max_memory_allocated (weights, optimizer state and activations; null on CPU). The last line printed
is one JSON object:
  {"peer": "hf_trainer+peft" | "hf_trainer+peft+liger" | "hf_trainer+peft+bnb", "size", "mode", "bs", "gc",
   "tokens_per_s", "step_s", "peak_gib", "gpu", ...}

  python3 bench/peer_hf.py --size 1.5b --mode lora --bs 8                 (one GPU)
  python3 bench/peer_hf.py --size 1.5b --mode lora --bs 8 --liger 1       (needs: pip install liger-kernel)
  python3 bench/peer_hf.py --size 7b --mode qlora --bs 4                  (needs: pip install bitsandbytes)
  python3 bench/peer_hf.py --size tiny --bs 2 --steps 7                   (CPU smoke test, seconds)

--mode qlora runs on a CUDA GPU only (bitsandbytes' 4-bit layers); on CPU it is refused by name, and so is a
missing bitsandbytes package, before any model is built.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import SIZES, WARMUP, model_config, peer_samples  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"]
WORK = Path("/tmp/meshtune-bench")  # bench/speed_table.py's default --work: its model folders are WORK/SIZE/model-SIZE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5b", choices=list(SIZES))
    p.add_argument("--mode", default="lora", choices=["lora", "full", "qlora"],
                   help="qlora: LoRA on bitsandbytes NF4 (double quant, bf16 compute); needs a CUDA GPU and "
                        "pip install bitsandbytes")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="--mode qlora: the saved model folder bitsandbytes quantizes while loading (default: the "
                        "speed table's, under /tmp/meshtune-bench/SIZE, written first if missing)")
    p.add_argument("--bs", type=int, default=8, help="batch size (one GPU)")
    p.add_argument("--steps", type=int, default=25, help=f"optimizer steps, the first {WARMUP} not timed")
    p.add_argument("--minlen", type=int, default=128)
    p.add_argument("--maxlen", type=int, default=1024)
    p.add_argument("--samples", type=int, default=None,
                   help="size of the sample pool batches are drawn from (default: bs x steps, each sample once); "
                        "the speed table passes the pool its meshtune rows train on")
    p.add_argument("--gc", type=int, default=1, choices=[0, 1], help="gradient checkpointing")
    p.add_argument("--liger", type=int, default=0, choices=[0, 1], help="Liger kernels (pip install liger-kernel)")
    p.add_argument("--attn", default="sdpa", help="transformers attention implementation (sdpa, eager, ...)")
    args = p.parse_args(argv)
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if not 1 <= args.minlen <= args.maxlen:
        p.error("--minlen and --maxlen: 1 <= minlen <= maxlen")
    if args.model_dir is not None and args.mode != "qlora":
        p.error(f"--model-dir: only --mode qlora loads a saved model (--mode {args.mode} builds its model in memory)")
    if args.model_dir is not None and (wrong := model_dir_problem(args.model_dir, args.size)):
        p.error(wrong)
    return args


def model_dir_problem(model_dir: Path, size: str) -> str | None:
    """Why --model-dir is not a saved model of --size's shape (the samples' ids are drawn from its vocabulary)."""
    config = model_dir / "config.json"
    if not config.is_file():
        return f"--model-dir {model_dir}: no config.json there (a saved model, as bench/workspace.py's writes)"
    saved, want = json.loads(config.read_text()), model_config(size).to_dict()
    keys = ["vocab_size", *SIZES[size]]
    if differ := [f"{k} {saved.get(k)} (not {want[k]})" for k in keys if saved.get(k) != want[k]]:
        return f"--model-dir {model_dir}: not the {size} shape: {', '.join(differ)}"
    return None


def check_liger() -> None:
    """Stop with one line, before any model is built, when --liger 1 cannot work here."""
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        sys.exit("peer_hf.py: --liger 1 needs the liger-kernel package (>= 0.3.0), which is not installed: "
                 "pip install liger-kernel")
    if not torch.cuda.is_available():
        sys.exit("peer_hf.py: --liger 1 needs a CUDA GPU (Liger's kernels are Triton kernels)")


def check_qlora() -> None:
    """Stop with one line, before any model is built, when --mode qlora cannot work here."""
    if not bitsandbytes_installed():
        sys.exit("peer_hf.py: --mode qlora needs the bitsandbytes package, which is not installed: "
                 "pip install bitsandbytes")
    if not torch.cuda.is_available():
        sys.exit("peer_hf.py: --mode qlora needs a CUDA GPU (bitsandbytes' 4-bit layers)")


def bitsandbytes_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def qlora_model_dir(size: str, model_dir: Path | None) -> Path:
    """The folder --mode qlora loads: --model-dir, or the speed table's for this size (written first if missing)."""
    if model_dir is not None:  # its shape checked with the arguments
        return model_dir
    from workspace import build_model_dir

    return build_model_dir(size, WORK / size)


def load_nf4(model_dir: Path, attn: str, gc: bool) -> torch.nn.Module:
    """The saved model with its block linear layers quantized to NF4 as it loads (double quant, bf16 compute), on
    GPU 0, made ready for k-bit training by peft (norms and head in fp32, input gradients for checkpointing)."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, Qwen2ForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation=attn,
                                             device_map={"": 0}, quantization_config=quant)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc)


def build_model(size: str, mode: str, gc: bool, attn: str, model_dir: Path | None = None) -> torch.nn.Module:
    """Random-init model of the bench shape, made on the device it trains on (bf16 on CUDA, fp32 on CPU); for
    qlora, the saved model folder loaded in NF4."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if mode == "qlora":
        model = load_nf4(qlora_model_dir(size, model_dir), attn, gc)
    else:
        with torch.device("cuda" if cuda else "cpu"):
            model = Qwen2ForCausalLM._from_config(model_config(size), dtype=torch.bfloat16 if cuda else torch.float32,
                                                  attn_implementation=attn)
    if mode in ("lora", "qlora"):
        model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                 target_modules=LORA_TARGETS))
        if gc:  # frozen embeddings: checkpointed blocks need an input that requires grad to backpropagate
            model.enable_input_require_grads()
    return model


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sample: padding is masked out of attention and labelled -100 (no loss)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class CountingCollator:
    """`collate`, recording each batch's real tokens in the order the Trainer draws batches (one batch a step:
    no gradient accumulation), counted on the host so counting never waits for the GPU."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = collate(samples)
        self.tokens.append(int(batch["attention_mask"].sum()))
        return batch


def step_clock():
    """A Trainer callback that records the wall time at the end of every optimizer step (after a CUDA sync)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    return StepClock()


def train(args: argparse.Namespace) -> dict:
    """Train for --steps and return the measured figures (the JSON line's fields)."""
    from transformers import Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    model = build_model(args.size, args.mode, bool(args.gc), args.attn, args.model_dir)
    pool = args.samples or args.bs * args.steps
    data = [{"input_ids": ids} for ids in peer_samples(model_config(args.size).vocab_size, pool, args.minlen,
                                                       args.maxlen)]
    collator, clock = CountingCollator(), step_clock()
    with tempfile.TemporaryDirectory(prefix="peer_hf-") as out:  # nothing is saved (save_strategy "no")
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.bs, max_steps=args.steps, bf16=cuda, use_cpu=not cuda,
            learning_rate=3e-4, lr_scheduler_type="cosine", weight_decay=0.1, seed=1, logging_steps=10**6,
            save_strategy="no", report_to="none", gradient_checkpointing=bool(args.gc), dataloader_num_workers=0,
            remove_unused_columns=False, use_liger_kernel=bool(args.liger), disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=data, data_collator=collator,
                          callbacks=[clock])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    return measured(args, collator.tokens, clock.ends)


def measured(args: argparse.Namespace, batch_tokens: list[int], step_ends: list[float]) -> dict:
    """tokens/s and seconds a step over the steps after the warm-up: from the end of step WARMUP to the last."""
    if len(step_ends) != args.steps:
        raise RuntimeError(f"the Trainer ran {len(step_ends)} optimizer steps, not {args.steps}")
    timed = len(step_ends) - WARMUP
    seconds = step_ends[-1] - step_ends[WARMUP - 1]
    tokens = sum(batch_tokens[WARMUP:WARMUP + timed])
    cuda = torch.cuda.is_available()
    return dict(peer=peer_name(args), size=args.size, mode=args.mode,
                bs=args.bs, gc=args.gc, attn=args.attn, tokens_per_s=round(tokens / seconds),
                step_s=round(seconds / timed, 4), timed_tokens=tokens,
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                gpu=torch.cuda.get_device_name() if cuda else "cpu")


def peer_name(args: argparse.Namespace) -> str:
    """The JSON line's "peer": the stack, with +bnb for bitsandbytes' 4-bit base and +liger for Liger's kernels."""
    return "hf_trainer+peft" + ("+bnb" if args.mode == "qlora" else "") + ("+liger" if args.liger else "")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "qlora":
        check_qlora()
    if args.liger:
        check_liger()
    print(json.dumps(train(args)), flush=True)


if __name__ == "__main__":
    main()
