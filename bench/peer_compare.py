"""meshtune beside the peer (HF Trainer + PEFT, `../shared/bench/peer_hf.py`) on the same card, same job.

Same model shape (random init: weights do not change speed), the peer's own synthetic samples (lengths uniform in
minlen..maxlen, token ids from torch.Generator seed 1, every token trained), same batch, steps and warm-up.
meshtune reads them through its real tokenized-cache path: the script writes the arrays where `meshtune train`
looks for them, so only text tokenization is skipped. Prints one JSON line per run and a table at the end.

On the device machine (peer copied to .peer/ and carried):
  python bench/peer_compare.py --size 1.5b --runs lora,full --peer .peer/peer_hf.py --out $OUT
On a CPU (smoke test of the script itself):
  python bench/peer_compare.py --size tiny --steps 8 --runs lora --peer ../shared/bench/peer_hf.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

SIZES = {  # Qwen2.5 shapes, as in peer_hf.py
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
}
WARMUP = 5


def build_model_dir(size: str, root: Path) -> Path:
    """Random-init Qwen2 of the given shape, saved in bf16 with a small local tokenizer (ids < vocab)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtune.demo.tokenizer import write_tokenizer

    out = root / f"model-{size}"
    if (out / "config.json").is_file():
        return out
    write_tokenizer(["a small corpus for a benchmark tokenizer"] * 4, out, vocab_size=300)
    vocab = 151936 if size != "tiny" else 1000
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, **SIZES[size])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def peer_samples(vocab: int, n: int, minlen: int, maxlen: int) -> list[np.ndarray]:
    """Exactly the peer's data: the same generator calls in the same order."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(minlen, maxlen + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).numpy().astype(np.int32) for length in lens]


def write_cached_dataset(model_dir: Path, work: Path, samples: list[np.ndarray], cutoff_len: int) -> Path:
    from meshtune.data.tokenized import TokenizedDataset, cache_key
    from meshtune.model.loading import load_tokenizer

    data_file = work / "synthetic.jsonl"
    data_file.write_text(json.dumps({"synthetic": len(samples), "lengths": [len(s) for s in samples]}) + "\n")
    tokenizer = load_tokenizer(model_dir)
    key = cache_key([data_file], tokenizer, "auto", cutoff_len, "auto", False)
    ids = np.concatenate(samples)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in samples], out=offsets[1:])
    stats = {"n_records": len(samples), "n_samples": len(samples), "n_tokens": int(offsets[-1]),
             "n_target_tokens": int(offsets[-1]) - len(samples)}
    TokenizedDataset(ids, ids.copy(), offsets, stats).save(work / "tokenized" / key)
    return data_file


def prepare_workspace(size: str, work: Path, n_samples: int, minlen: int, maxlen: int) -> tuple[Path, Path]:
    """The model directory and the cached synthetic dataset a benchmark run trains on."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(size, work)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return model_dir, write_cached_dataset(model_dir, work, peer_samples(vocab, n_samples, minlen, maxlen), maxlen)


def run_meshtune(args, mode: str, model_dir: Path, data_file: Path, work: Path, extra: dict) -> dict:
    out = work / f"out-{mode}-{'-'.join(f'{k}{v}' for k, v in extra.items()) or 'default'}"
    cfg = dict(model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
               output_dir=str(out), finetuning_type=mode, lora_rank=64, lora_alpha=16, lora_dropout=0.05,
               lora_target="all", per_device_train_batch_size=args.bs, max_steps=args.steps, logging_steps=1,
               learning_rate=3e-4, lr_scheduler_type="cosine", weight_decay=0.1, cutoff_len=args.maxlen,
               gradient_checkpointing=bool(args.gc), nproc_per_node=1, seed=1)
    cfg.update(extra)
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "meshtune", "train", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"meshtune {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > WARMUP]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return dict(system="meshtune", mode=mode, **extra, tokens_per_s=round(sum(r["tokens"] for r in timed) / seconds),
                step_s=round(seconds / len(timed), 4), peak_gib=max(r["peak_mem_gib"] for r in records),
                final_loss=round(records[-1]["loss"], 4), wall_s=round(time.perf_counter() - started, 1))


def run_peer(args, mode: str) -> dict:
    cmd = [sys.executable, args.peer, "--size", args.size, "--mode", mode, "--bs", str(args.bs),
           "--steps", str(args.steps), "--minlen", str(args.minlen), "--maxlen", str(args.maxlen), "--gc", str(args.gc)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"peer {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return dict(system="hf_trainer+peft", mode=mode, tokens_per_s=result["tokens_per_s"], step_s=result["step_s"],
                peak_gib=result["peak_gib"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5b", choices=SIZES)
    p.add_argument("--runs", default="lora,full", help="comma list of lora | full | full-zero2")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--minlen", type=int, default=128)
    p.add_argument("--maxlen", type=int, default=1024)
    p.add_argument("--gc", type=int, default=1)
    p.add_argument("--peer", default=str(Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer_hf.py"))
    p.add_argument("--work", default="/tmp/meshtune-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()

    work = Path(args.work)
    model_dir, data_file = prepare_workspace(args.size, work, args.bs * (args.steps + 5), args.minlen, args.maxlen)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = []
    for run in args.runs.split(","):
        mode, _, parallel = run.partition("-")
        extra = {"parallel": parallel} if parallel else {}
        rows.append(run_meshtune(args, mode, model_dir, data_file, work, extra))
        print(json.dumps(rows[-1]), flush=True)
        if not parallel:
            rows.append(run_peer(args, mode))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "bench.json").write_text(json.dumps(dict(device=device, size=args.size, args=vars(args), rows=rows), indent=1))
    peers = {r["mode"]: r for r in rows if r["system"] != "meshtune"}
    print(f"\n{device}, size {args.size}, bs {args.bs}, lengths {args.minlen}..{args.maxlen}, gc {args.gc}, {args.steps} steps "
          f"({WARMUP} warm-up)")
    print(f"{'system':<18}{'mode':<12}{'tokens/s':>10}{'vs peer':>9}{'peak GiB':>10}")
    for r in rows:
        peer = peers.get(r["mode"])
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer and r is not peer else ""
        name = r["mode"] + (f"/{r['parallel']}" if r.get("parallel") else "")
        print(f"{r['system']:<18}{name:<12}{r['tokens_per_s']:>10,}{ratio:>9}{str(r['peak_gib']):>10}")


if __name__ == "__main__":
    main()
