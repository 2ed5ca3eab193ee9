"""What the bench scripts share: a random-init model of a Qwen2.5 shape and synthetic samples, written where
`meshtune train` reads them.

meshtune and the peer (`bench/peer_hf.py`, HF Trainer + PEFT) train the same model shape (`model_config`; random
init: weights do not change speed) on the same samples (`peer_samples`: lengths uniform in minlen..maxlen, token
ids from torch.Generator seed 1, every token trained). meshtune reads them through its real tokenized-cache path:
the arrays are written where `meshtune train` looks for them, so only text tokenization is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml

SIZES = {  # Qwen2.5 shapes; tiny: CPU smoke tests (tiny-nf4: block weights in whole NF4 scale groups, for Q-LoRA)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "tiny-nf4": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4),
    "512x8": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),  # CPU: full 7B's tokens a step over 12 x layers x hidden at ~2k tokens
    "512x8-7b": dict(hidden_size=512, intermediate_size=2688, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=1),  # CPU: 7B's shape at hidden 512 (its MLP 5.25 x the width, heads 128
    # wide, 4 query heads to a key-value one, its embeddings 14% of the parameters), so that a step's activations
    # over its gradients are 7B's at the same tokens / (12 x layers x hidden)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
SIZES["1.5b-tied"] = SIZES["1.5b"]  # Qwen2.5-1.5B as published: its head is its embedding (1.54 B)
VOCAB = {"tiny": 1000, "tiny-nf4": 1000, "512x8": 1000, "512x8-7b": 6272,  # the others: 151936
         "32b": 152064, "72b": 152064}
WARMUP = 5  # steps not timed: first-step allocations, compilation and cache warm-up


ENV = "env."  # a variant's key that names an environment variable of the run rather than a config key


def parse_variant(text: str) -> dict:
    """'default' or 'key=value,key=value' (values as YAML) -> config overrides; an `env.NAME=VALUE` item sets the
    run's environment variable NAME instead (`run_environment`)."""
    if text.strip() in ("", "default"):
        return {}
    pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
    return {key.strip(): yaml.safe_load(value) for key, value in pairs}


def run_environment(overrides: dict) -> tuple[dict, dict[str, str]]:
    """A variant's overrides split into config keys and the environment variables its run gets (`env.NAME`: a
    setting of torch or a library that meshtune has no key for, e.g. env.TORCHINDUCTOR_CPP_WRAPPER=1)."""
    config = {k: v for k, v in overrides.items() if not k.startswith(ENV)}
    env = {k[len(ENV):]: str(int(v) if isinstance(v, bool) else v) for k, v in overrides.items() if k.startswith(ENV)}
    return config, env


def model_config(size: str):
    """The Qwen2 config of a bench size: Qwen2.5's vocabulary (1000 ids for tiny), an untied head (a tied one for the
    sizes named -tied)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB.get(size, 151936), max_position_embeddings=4096,
                       tie_word_embeddings=size.endswith("-tied"), **SIZES[size])


def build_model_dir(size: str, root: Path) -> Path:
    """Random-init Qwen2 of the given shape, saved in bf16 with a small local tokenizer (ids < vocab)."""
    from transformers import Qwen2ForCausalLM

    from meshtune.demo.tokenizer import write_tokenizer

    out = root / f"model-{size}"
    if (out / "config.json").is_file():
        return out
    write_tokenizer(["a small corpus for a benchmark tokenizer"] * 4, out, vocab_size=300)
    cfg = model_config(size)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def peer_samples(vocab: int, n: int, minlen: int, maxlen: int) -> list[np.ndarray]:
    """The bench's samples: n lengths uniform in minlen..maxlen, then each sample's token ids, from one generator
    (seed 1), so meshtune and the peer draw the same arrays."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(minlen, maxlen + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).numpy().astype(np.int32) for length in lens]


def write_cached_dataset(model_dir: Path, work: Path, samples: list[np.ndarray], cutoff_len: int) -> Path:
    from meshtune.data.formats import file_spec
    from meshtune.data.tokenized import TokenizedDataset, cache_key
    from meshtune.model.model_dir import load_tokenizer

    data_file = work / "synthetic.jsonl"
    data_file.write_text(json.dumps({"synthetic": len(samples), "lengths": [len(s) for s in samples]}) + "\n")
    tokenizer = load_tokenizer(model_dir)
    key = cache_key([file_spec(data_file)], tokenizer, None, cutoff_len, skip_invalid=False)  # template: auto
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
    return model_dir, write_cached_dataset(
        model_dir, work, workspace_samples(model_dir, n_samples, minlen, maxlen), maxlen)


def workspace_samples(model_dir: Path, n_samples: int, minlen: int, maxlen: int) -> list[np.ndarray]:
    """The samples of a built model directory (its vocabulary from config.json)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return peer_samples(vocab, n_samples, minlen, maxlen)


def timing_problem(steps: int, warmup: int, logging_steps: int) -> str | None:
    """Why a run of `steps` would time nothing, or time a warm-up step (the bench scripts' --steps, --warmup and
    --logging-steps); None when they fit."""
    if steps <= warmup:
        return f"--steps {steps}: more than the {warmup} warm-up steps, or nothing is timed"
    if warmup % logging_steps:
        return (f"--warmup {warmup} is not a multiple of --logging-steps {logging_steps}: a timed interval would "
                "hold a warm-up step")
    return None


def timed_records(records: list[dict], warmup: int = WARMUP) -> tuple[list[dict], float]:
    """metrics.jsonl records after the warm-up steps (logging_steps dividing `warmup`), and the seconds they took."""
    timed = [r for r in records if r["step"] > warmup and "tokens" in r]
    return timed, sum(r["tokens"] / r["tokens_per_s"] for r in timed)
