"""Where a LoRA step's time goes: meshtune's step next to variants that differ in one thing each, then a
torch.profiler table of meshtune's step. A diagnosis tool for the device machine, not a benchmark of record.

  python bench/profile_lora_step.py --size 1.5b --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_compare import build_model_dir, peer_samples  # noqa: E402

from meshtune.config import build_config  # noqa: E402
from meshtune.data.collate import collate  # noqa: E402
from meshtune.distributed import init_distributed  # noqa: E402
from meshtune.model.loading import load_model  # noqa: E402
from meshtune.model.lora import add_lora  # noqa: E402
from meshtune.model.parallel import wrap_model  # noqa: E402
from meshtune.train.loop import build_optimizer, clip_gradients, forward_loss  # noqa: E402


class Samples:
    def __init__(self, arrays):
        self.arrays = arrays

    def __getitem__(self, i):
        return self.arrays[i], self.arrays[i]


def make_model(model_dir, cfg, env, ddp: bool, reentrant: bool):
    model = load_model(model_dir, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = add_lora(model, cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    model.to(env.device).train()  # from_pretrained returns eval mode, where checkpointing and dropout are off
    return wrap_model(model, "ddp", env, bf16=True) if ddp else model


def time_variant(name, model, cfg, env, data, batches, hf_loss=False, position_ids=True, steps=12, warm=4):
    optimizer, params = build_optimizer(model, cfg, env)
    times, tokens = [], 0
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = collate(batches[step], data, 0, packed=False).to(env.device)
        inputs = batch.model_inputs()
        if not position_ids:
            inputs.pop("position_ids")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if hf_loss:
                labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
                loss = model(**inputs, labels=labels, use_cache=False).loss
            else:
                loss = forward_loss(model, batch, env, autocast_bf16=False) / batch.num_targets
        loss.backward()
        clip_gradients(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warm:
            times.append(time.perf_counter() - t0)
            tokens += batch.num_tokens
    print(f"{name:<44} {tokens / sum(times):>9,.0f} tok/s  {sum(times) / len(times) * 1000:7.1f} ms/step  "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:5.1f} GiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="1.5b")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--work", default="/tmp/meshtune-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    env = init_distributed(600)
    model_dir = build_model_dir(args.size, Path(args.work))
    vocab = 151936 if args.size != "tiny" else 1000
    data = Samples(peer_samples(vocab, args.bs * 20, 128, 1024))
    batches = [[[i] for i in range(s * args.bs, (s + 1) * args.bs)] for s in range(16)]
    cfg = build_config(dict(model_name_or_path=str(model_dir), dataset="x", lora_rank=64, lora_alpha=16,
                            lora_dropout=0.05, learning_rate=3e-4, weight_decay=0.1))
    variants = [
        ("meshtune: DDP, non-reentrant ckpt, own CE", dict(ddp=True, reentrant=False), {}),
        ("no DDP wrapper", dict(ddp=False, reentrant=False), {}),
        ("reentrant ckpt + input grads", dict(ddp=False, reentrant=True), {}),
        ("HF loss (labels=)", dict(ddp=False, reentrant=False), dict(hf_loss=True)),
    ]
    for name, build, run in variants:
        torch.cuda.reset_peak_memory_stats()
        model = make_model(model_dir, cfg, env, **build)
        time_variant(name, model, cfg, env, data, batches, **run)
        del model
        torch.cuda.empty_cache()

    from torch.profiler import ProfilerActivity, profile

    tables = []
    for name, hf_loss in (("own CE", False), ("HF loss", True)):
        model = make_model(model_dir, cfg, env, ddp=False, reentrant=False)
        optimizer, params = build_optimizer(model, cfg, env)
        for step in range(6):
            batch = collate(batches[step], data, 0, packed=False).to(env.device)
            if step == 3:
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if hf_loss:
                    loss = model(**batch.model_inputs(), labels=batch.input_ids, use_cache=False).loss
                else:
                    loss = forward_loss(model, batch, env, False) / batch.num_targets
            loss.backward()
            clip_gradients(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        tables.append(f"== {name}\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
        del model, optimizer, params
        torch.cuda.empty_cache()
    Path(args.out, "profile.txt").write_text("\n".join(tables))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
