"""Preference training's speed: meshtune's `stage: dpo` beside TRL's DPOTrainer (plain, and with Liger's fused DPO
loss), on the same card, model shape and pairs, the runs alternating.

What a run measures. Both sides train a random-init model of a Qwen2.5 shape (bench/workspace.py; weights do not
change speed) in bf16 on the same synthetic pairs: a prompt of U(--prompt-min, --prompt-max) tokens, a chosen and a
rejected response of U(--resp-min, --resp-max) tokens each (seed 1), text that both sides tokenize with the same
tokenizer (meshtune with `template: empty`, TRL's plain prompt + completion). LoRA is r 64, alpha 16, dropout 0.05
on every linear layer, its reference the base with the adapters off; full fine-tuning trains against a frozen
reference copy. Gradient checkpointing is on for both, batch --bs pairs a step, sigmoid DPO with beta 0.1. tokens/s
counts each pair's tokens, the prompt once for each response (as both forwards process it), after 5 warm-up steps:
meshtune's from its metrics, the peer's from the attention masks of the batches it timed. A meshtune side with
precompute_ref_log_probs (a --variant) also records the pass's seconds (precompute_s), which its steps do not
include. Peak memory:
torch's peak allocated on the GPU. After the peer, meshtune runs once more a round at the peer's memory
(`memory_budget`: the lowest peer peak measured; `--no-at-peer-memory` skips it). meshtune's first run on a
machine also fills the compiler's cache: alternate enough rounds (--repeats 3 or more) that the median is of
warm runs.

The peer runner is bench/peer_trl_dpo.py (needs trl and datasets; liger-kernel for the Liger side). Every run starts
from a fresh output folder; sides alternate within each repeat; the table gives each side's median and min-max, and
meshtune's median over each peer's. Results: --out/dpo_speed.json and dpo_speed.md.

  python3 bench/dpo_speed.py --size 7b --mode lora --bs 2 --steps 15 --repeats 3 --peers trl+liger,trl --out r
  python3 bench/dpo_speed.py --size 1.5b --mode full --bs 2 --steps 15 --repeats 3 --out r
  python3 bench/dpo_speed.py --size tiny --mode lora --steps 7 --repeats 1 --out /tmp/dpo   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workspace import WARMUP, build_model_dir, timed_records  # noqa: E402

LORA = dict(lora_rank=64, lora_alpha=16, lora_dropout=0.05, lora_target="all")


def pair_rows(tokenizer, n: int, a) -> list[dict]:
    """Pairs of text drawn from the tokenizer's own pieces: a prompt of U(--prompt-min, --prompt-max) random token
    ids, a chosen and a rejected response of U(--resp-min, --resp-max) each (seed 1), decoded to text. Both sides
    tokenize that text with the same tokenizer, so they train the same tokens."""
    g = torch.Generator().manual_seed(1)
    pieces = len(tokenizer) - len(tokenizer.all_special_ids)

    def text(k: int) -> str:
        return tokenizer.decode(torch.randint(0, pieces, (k,), generator=g).tolist())

    def u(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    return [{"prompt": text(u(a.prompt_min, a.prompt_max)), "chosen": text(u(a.resp_min, a.resp_max)),
             "rejected": text(u(a.resp_min, a.resp_max))} for _ in range(n)]


def build_workspace(a, work: Path) -> tuple[Path, Path]:
    """The model folder (random init, bf16 on a GPU; the bench tokenizer, bench/workspace.py) and the pairs file
    both sides read."""
    from meshtune.model.model_dir import load_tokenizer

    model_dir = build_model_dir(a.size, work)
    rows = pair_rows(load_tokenizer(model_dir), a.bs * (a.steps + 5), a)
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def meshtune_run(a, model_dir: Path, data: Path, out: Path, log: Path, side: str = "meshtune",
                 extra: dict | None = None) -> dict:
    config = dict(model_name_or_path=str(model_dir), dataset=str(data), output_dir=str(out), stage="dpo",
                  finetuning_type=a.mode, per_device_train_batch_size=a.bs, gradient_accumulation_steps=1,
                  max_steps=a.steps, logging_steps=1, save_steps=0, learning_rate=5e-6, lr_scheduler_type="cosine",
                  cutoff_len=4 * (a.prompt_max + a.resp_max), pref_beta=0.1, pref_loss="sigmoid", template="empty",
                  gradient_checkpointing=True, nproc_per_node=1, plot_loss=False, seed=0, **a.extra,
                  **(extra or {}))
    if a.mode == "lora":
        config.update(LORA)
    if torch.cuda.is_available():
        config["bf16"] = True
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out.parent / f"{out.name}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run([sys.executable, "-m", "meshtune", "train", str(cfg_file)], stdout=handle,
                              stderr=subprocess.STDOUT, timeout=a.run_timeout).returncode
    if code:
        return {"side": side, "error": f"exit {code}: see {log}"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed, seconds = timed_records([r for r in records if "tokens_per_s" in r], WARMUP)
    tokens = sum(r["tokens"] for r in timed)
    pass_s = re.search(r"precompute_ref_log_probs: the reference's log-probs of .* computed in ([0-9.]+) s",
                       log.read_text())
    return {"side": side, "tokens_per_s": round(tokens / seconds), "step_s": round(seconds / len(timed), 4),
            **({"precompute_s": float(pass_s.group(1))} if pass_s else {}),
            "tokens_per_step": round(tokens / len(timed)),  # logging_steps 1: a record a step
            "peak_gib": max(r.get("peak_mem_gib", 0) for r in records),
            "wall_s": round(time.perf_counter() - started, 1)}


def peer_run(a, peer: str, model_dir: Path, data: Path, log: Path) -> dict:
    cmd = [sys.executable, str(HERE / "peer_trl_dpo.py"), "--size", a.size, "--mode", a.mode, "--bs", str(a.bs),
           "--steps", str(a.steps), "--pairs", str(data), "--tokenizer", str(model_dir),
           "--liger", str(int(peer == "trl+liger"))]
    started = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=handle, text=True, timeout=a.run_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"side": peer, "error": f"exit {proc.returncode}: see {log}"}
    result = json.loads(lines[-1])
    return {"side": peer, "tokens_per_s": result["tokens_per_s"], "step_s": result["step_s"],
            "tokens_per_step": result["tokens_per_step"],
            "peak_gib": result["peak_gib"], "wall_s": round(time.perf_counter() - started, 1)}


def summarise(runs: list[dict], sides: list[str]) -> list[dict]:
    """Each side's median and spread; meshtune's rows also over the first peer's median and peak memory."""
    rows = []
    for side in sides:
        ok = [r for r in runs if r["side"] == side and "tokens_per_s" in r]
        if not ok:
            rows.append({"side": side, "runs": 0, "errors": [r["error"] for r in runs if r["side"] == side]})
            continue
        speeds = [r["tokens_per_s"] for r in ok]
        rows.append({"side": side, "runs": len(ok), "tokens_per_s": statistics.median(speeds),
                     "min": min(speeds), "max": max(speeds), "peak_gib": max(r["peak_gib"] or 0 for r in ok)})
        passes = [r["precompute_s"] for r in ok if "precompute_s" in r]
        if passes:
            rows[-1]["precompute_s"] = statistics.median(passes)
    peer = next((r for r in rows if not r["side"].startswith("meshtune") and r.get("runs")), None)
    for row in rows:
        if peer and row["side"].startswith("meshtune") and row.get("runs"):
            row["over_peer"] = round(row["tokens_per_s"] / peer["tokens_per_s"], 2)
            row["memory_share"] = round(row["peak_gib"] / peer["peak_gib"], 2) if peer["peak_gib"] else None
    return rows


def peer_peak(runs: list[dict]) -> float | None:
    """The lowest peak memory (GiB) a peer's run has measured so far."""
    peaks = [r["peak_gib"] for r in runs if not r["side"].startswith("meshtune") and r.get("peak_gib")]
    return min(peaks) if peaks else None


def render(a, rows: list[dict], card: str) -> str:
    peer = next((r["side"] for r in rows if not r["side"].startswith("meshtune")), "the peer")
    head = (f"DPO {a.mode} {a.size}, {a.bs} pairs a step, {a.steps} steps ({WARMUP} untimed), prompt "
            f"{a.prompt_min}-{a.prompt_max}, responses {a.resp_min}-{a.resp_max} tokens, {card}\n\n"
            f"| side | runs | tokens/s median (min-max) | peak GiB | over {peer} | memory share of {peer} | "
            "reference pass s |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if not r.get("runs"):
            lines.append(f"| {r['side']} | 0 | not run: {'; '.join(r['errors'])} | | | | |")
            continue
        lines.append(f"| {r['side']} | {r['runs']} | {r['tokens_per_s']:,.0f} ({r['min']:,}-{r['max']:,}) | "
                     f"{r['peak_gib']} | {r.get('over_peer', '')} | {r.get('memory_share', '')} | "
                     f"{r.get('precompute_s', '')} |")
    return head + "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5b", choices=["tiny", "0.5b", "1.5b", "7b"])
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--bs", type=int, default=2, help="pairs a step on the one GPU")
    p.add_argument("--steps", type=int, default=15, help=f"steps a run; the first {WARMUP} are not timed")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every side once, in turn")
    p.add_argument("--peers", default="trl+liger", help="comma-separated: trl+liger, trl; 'none' for meshtune only")
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--resp-min", type=int, default=64)
    p.add_argument("--resp-max", type=int, default=512)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a meshtune config key for meshtune's runs (YAML value), e.g. --set fused_loss=false")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="another meshtune side, run in every round with these keys on top of --set, e.g. "
                        "--variant precompute:precompute_ref_log_probs=true; its row is meshtune+NAME. The run at "
                        "the peer's memory takes the last variant's keys")
    p.add_argument("--only-at-peer-memory", action="store_true",
                   help="meshtune runs only at the peer's memory (and the --variant sides): no run with meshtune's "
                        "own memory budget")
    p.add_argument("--no-at-peer-memory", dest="at_peer_memory", action="store_false",
                   help="skip meshtune's run at the peer's memory (memory_budget: the lowest peer peak measured)")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path("dpo-speed"))
    a = p.parse_args(argv)
    if a.steps <= WARMUP:
        p.error(f"--steps {a.steps}: more than the {WARMUP} warm-up steps, or nothing is timed")
    a.extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in a.set)}
    a.variants = {}
    for item in a.variant:
        name, _, keys = item.partition(":")
        if not name or "=" not in keys:
            p.error(f"--variant {item}: NAME:KEY=VALUE[,KEY=VALUE]")
        a.variants[f"meshtune+{name}"] = {k: yaml.safe_load(v) for k, v in
                                         (pair.split("=", 1) for pair in keys.split(","))}
    a.peer_list = [] if a.peers == "none" else [s.strip() for s in a.peers.split(",") if s.strip()]
    unknown = set(a.peer_list) - {"trl", "trl+liger"}
    if unknown:
        p.error(f"--peers: {', '.join(sorted(unknown))} unknown; the peers are trl and trl+liger")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    model_dir, data = build_workspace(a, work)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    sides = [*([] if a.only_at_peer_memory else ["meshtune"]), *a.variants, *a.peer_list,
             *(["meshtune@peer-memory"] if a.peer_list and a.at_peer_memory else [])]
    last_variant = list(a.variants.values())[-1] if a.variants else {}
    runs: list[dict] = []
    for round_ in range(a.repeats):
        order = sides if round_ % 2 == 0 else sides[::-1]  # alternate who goes first
        for side in order:
            log = a.out / f"{side.replace('+', '-').replace('@', '-at-')}-{round_}.log"  # file names the device returns
            if side.startswith("meshtune"):
                at_peer = side == "meshtune@peer-memory"
                budget = peer_peak(runs) if at_peer else None
                if at_peer and budget is None:
                    result = {"side": side, "error": "no peer run measured a peak to hold to"}
                else:
                    run_dir = work / f"run-{round_}"
                    shutil.rmtree(run_dir, ignore_errors=True)
                    extra = a.variants.get(side, last_variant if at_peer else {})
                    result = meshtune_run(a, model_dir, data, run_dir, log, side,
                                          {**extra, **({"memory_budget": budget} if budget else {})})
                    shutil.rmtree(run_dir, ignore_errors=True)
            else:
                result = peer_run(a, side, model_dir, data, log)
            result["round"] = round_
            runs.append(result)
            print(json.dumps(result), flush=True)
            rows = summarise(runs, sides)
            (a.out / "dpo_speed.json").write_text(json.dumps(
                {"args": {k: str(v) for k, v in vars(a).items()}, "card": card, "runs": runs, "rows": rows},
                indent=1))
            (a.out / "dpo_speed.md").write_text(render(a, rows, card))
    print((a.out / "dpo_speed.md").read_text())
    if os.environ.get("DPO_SPEED_KEEP_WORK") != "1":
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
