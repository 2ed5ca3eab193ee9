"""meshtune's loss curve beside HF Trainer's on the same model, tokens, order and hyperparameters, with every
speed lever of meshtune on, and the difference between the two stacks beside each stack's own run-to-run noise.

What runs. A random-init model of a Qwen2.5 shape (--size; bench/workspace.py) is fully fine-tuned for --steps
steps on a task it learns from scratch: each sample is a walk of a fixed random chain over --symbols token ids
(every id has 4 successors, drawn uniformly), a separator, then the walk again. The walk's tokens can be learned
down to ln 4 each, its copy down to 0 by attending back: the loss falls from ln(vocabulary) through both.
Samples are --minlen..--maxlen tokens; every token is trained; each sample is seen once.
 - meshtune, `meshtune train` on --gpus processes (torchrun), with every speed lever on: padding_free (varlen
   attention), fused_loss, torch_compile, master_weights bf16 (bf16 weights and AdamW moments with stochastic
   rounding), gradient_checkpointing with ratio auto, parallel zero3. --memory-budget half (default): a first
   start of the run measures its step (the memory fit's log line) and is stopped there; the runs then get the
   memory_budget under which about half the blocks are recomputed, so the measured fit recomputes some blocks
   and keeps the others. The blocks it recomputed are in the report.
 - HF Trainer (bench/hf_replay.py) on one GPU: the same samples in the same order, step by step (meshtune's
   tokenized cache and global batch plan), the same micro-batch with accumulation times --gpus, so the same
   global batch; the same AdamW hyperparameters, clipping, seed and schedule (transformers' get_scheduler, which
   meshtune uses). It trains as HF users do on a GPU: fp32 weights and AdamW, bf16 autocast, padded batches.
Both stacks run with each of --seeds (data order and random streams); the two HF runs side by side, one GPU each.

What is measured. Each step's loss (the token mean of the step), learning rate, gradient norm and tokens, for all
four runs. Relative differences |a - b| / mean(a, b), per step and between means of 10 steps: meshtune against HF
on each seed (the stacks' difference: the same batches) and seed against seed within each stack (run-to-run
noise: other batches in another order). "Within noise" holds when the stacks' mean difference of the 10-step means
is at most the seeds' mean difference. Also the final loss (mean of the last 10 steps), whether the learning rates
and the tokens of every step are the same in both stacks, wall seconds and peak GPU memory. Written to --out:
parity.json (every curve), parity.md (the tables) and parity.png (the curves). Each run's figures go to
--out/runs/ under its identity: its config, processes, model weights, samples and code. A run with this
invocation's identity that finished there is kept, not run again: `--only meshtune` and `--only hf`, or
invocations cut short by a time window, make one report in the same --out, even on two machines (the model and
samples are rebuilt alike). Delete --out/runs to run everything afresh. A run that fails or is not started
within --time-limit is listed with why.

On a GPU machine with 2 GPUs (set-up as in bench/speed_table.py: pip install -e . from the repository root):
  python3 bench/parity_curves.py --out results/parity
  python3 bench/parity_curves.py --only meshtune --time-limit 540 --out results/parity   (a part per time window,
  python3 bench/parity_curves.py --only hf --time-limit 540 --out results/parity          then one report)
An ablation: --set KEY=VALUE for the meshtune runs, e.g. --set master_weights=fp32.
On a CPU (the script's smoke test: fp32, 2 gloo processes, no compile; the stacks then agree to float rounding):
  python3 bench/parity_curves.py --size tiny --steps 6 --minlen 16 --maxlen 64 --bs 2 --out /tmp/parity
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import transformers
import yaml

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))
from processes import alive, descendants, kill_tree  # noqa: E402
from speed_table import Deadline, fresh, last_line, run_captured  # noqa: E402
from workspace import SIZES, build_model_dir, write_cached_dataset  # noqa: E402

from meshtune.config import build_config  # noqa: E402
from meshtune.doctor.facts import code_hash  # noqa: E402
from meshtune.train.memory_fit import HEADROOM  # noqa: E402

SUCCESSORS = 4
WINDOW = 10  # steps a mean of the curves covers, and the final loss's steps
STACKS = ("meshtune", "hf")
NAMES = {"meshtune": "meshtune", "hf": "HF Trainer"}
FIT_LINE = re.compile(r"takes ([\d.]+) GiB with every block recomputed, and each block kept holds ([\d.]+) GiB")
RECOMPUTED = re.compile(r"-> (\d+) of (\d+) blocks recomputed")


def task_samples(n: int, minlen: int, maxlen: int, symbols: int, seed: int = 1) -> list[np.ndarray]:
    """n samples of the chain-and-copy task: a walk of m tokens over ids 0..symbols-1 (each id's next one drawn
    from its 4 fixed successors), the separator `symbols`, the walk again; 2m + 1 in minlen..maxlen tokens."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, symbols, (symbols, SUCCESSORS), generator=g).tolist()
    low, high = max(1, minlen // 2), (maxlen - 1) // 2
    walks = torch.randint(low, high + 1, (n,), generator=g).tolist()
    samples = []
    for m in walks:
        walk = [int(torch.randint(0, symbols, (1,), generator=g))]
        for choice in torch.randint(0, SUCCESSORS, (m - 1,), generator=g).tolist():
            walk.append(successors[walk[-1]][choice])
        samples.append(np.array(walk + [symbols] + walk, dtype=np.int32))
    return samples


def global_batch(args) -> int:
    return args.bs * args.accumulation * args.gpus


def prepare(args) -> tuple[Path, Path, Path, str]:
    """The model, the task's samples in meshtune's tokenized cache, the work folder of this size, and a digest of
    the model's weights and the samples."""
    work = Path(args.work) / args.size
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(args.size, work)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.symbols >= vocab:
        sys.exit(f"--symbols {args.symbols}: the task's ids and its separator must lie below the model's "
                 f"vocabulary of {vocab}")
    samples = task_samples(global_batch(args) * args.steps, args.minlen, args.maxlen, args.symbols)
    digest = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    for sample in samples:
        digest.update(sample.tobytes() + b"/")
    return model_dir, write_cached_dataset(model_dir, work, samples, args.maxlen), work, digest.hexdigest()[:16]


def meshtune_config(args, seed: int, model_dir: Path, data_file: Path, work: Path, cuda: bool) -> dict:
    """The meshtune run of one seed, every speed lever on (on a CPU: fp32, no compile)."""
    cfg = dict(model_name_or_path=str(model_dir), dataset=str(data_file), tokenized_path=str(work / "tokenized"),
               output_dir=str(work / f"meshtune-seed{seed}"), finetuning_type="full",
               per_device_train_batch_size=args.bs, gradient_accumulation_steps=args.accumulation,
               max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine",
               warmup_steps=math.ceil(0.1 * args.steps), weight_decay=0.1, max_grad_norm=1.0,
               cutoff_len=args.maxlen, seed=seed, logging_steps=1, nproc_per_node=args.gpus, parallel="zero3",
               padding_free=True, fused_loss=True, torch_compile=cuda, gradient_checkpointing=True,
               gradient_checkpointing_ratio="auto", master_weights="bf16" if cuda else "fp32",
               resume_from_checkpoint="none", save_final=False)
    if cuda:
        cfg["bf16"] = True
    cfg.update(args.set)
    return cfg


def identity(cfg: dict, processes: int, digest: str, work: Path) -> str:
    """What a run computes: the config's math (seed included), the processes (the global batch), the model's
    weights and the samples (`prepare`'s digest), and the code that computes it (meshtune's, this script's and
    the replay's, torch and transformers). A run from another invocation (another machine, or another --work,
    whose folder was built anew) counts in the report, and is not run again, only where it matches: the work
    folder's path is not part of it (the digest is what the folder holds)."""
    code = hashlib.sha256("\0".join([code_hash(), torch.__version__, transformers.__version__,
                                      Path(__file__).read_text(), (BENCH / "hf_replay.py").read_text()]).encode())
    placed = {key: value.replace(str(work), "WORK") if isinstance(value, str) else value for key, value in cfg.items()}
    return f"{build_config(placed).hash()}x{processes}-{digest}-{code.hexdigest()[:12]}"


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_until(cmd: list[str], pattern: re.Pattern, timeout: float, env: dict, log: Path) -> tuple[str | None, str]:
    """Run `cmd` until a line matches `pattern` (or it ends, or `timeout`), then stop its whole tree and wait for
    every process of it to be gone (their GPU memory with them): (the matching line or None, the output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def read() -> None:
        with log.open("w") as sink:
            for line in proc.stdout:
                lines.append(line)
                sink.write(line)
                if pattern.search(line):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    tree = [proc.pid, *descendants(proc.pid)]  # listed first: once the launcher is gone its workers cannot be found
    kill_tree(proc.pid)
    proc.wait()
    for _ in range(300):
        if not any(map(alive, tree)):  # a zombie holds no memory any more
            break
        time.sleep(0.1)
    found = [line for line in lines if pattern.search(line)]
    return (found[0] if found else None), "".join(lines)


def budget_for_half(line: str, blocks: int) -> float | None:
    """memory_budget (GiB) under which the memory fit keeps about half of `blocks` and recomputes the rest, from
    its log line (the step with every block recomputed, what each kept block adds); None where a kept block adds
    nothing measurable."""
    match = FIT_LINE.search(line)
    if not match:
        return None
    peak_all, per_block = float(match.group(1)), float(match.group(2))
    if per_block <= 0:
        return None
    return round((peak_all + (blocks // 2 + 0.5) * per_block) / (1 - HEADROOM), 2)


def probe_memory(args, cfg: dict, work: Path, deadline: Deadline) -> tuple[float | None, str]:
    """--memory-budget half: start the first meshtune run, read its memory fit, stop it; (budget, what happened)."""
    out = fresh(work / "memory-probe")
    out.mkdir(parents=True)
    path = write_config(dict(cfg, output_dir=str(out)), work / "memory-probe.yaml")
    timeout, _ = deadline.timeout(args.run_timeout)
    line, output = run_until([sys.executable, "-m", "meshtune", "train", str(path)], FIT_LINE, timeout,
                             {**os.environ, "NCCL_NVLS_ENABLE": "0"}, out / "train.log")
    if line is None:
        return None, f"the memory probe found no memory fit line ({last_line(output)}): meshtune's default budget"
    budget = budget_for_half(line, SIZES[args.size]["num_hidden_layers"])
    if budget is None:
        return None, f"a kept block adds no measurable memory ({line.strip()}): meshtune's default budget"
    return budget, f"memory_budget {budget} GiB, from: {line.strip()}"


def meshtune_run(args, cfg: dict, path: Path, deadline: Deadline) -> dict:
    """One meshtune run from a fresh output folder: its per-step figures from metrics.jsonl."""
    out = fresh(Path(cfg["output_dir"]))
    out.mkdir(parents=True)
    timeout, stopped = deadline.timeout(args.run_timeout)
    started = time.perf_counter()
    code, output = run_captured([sys.executable, "-m", "meshtune", "train", str(path)], timeout,
                                env={**os.environ, "NCCL_NVLS_ENABLE": "0"}, log=out / "train.log")
    if code is None:
        return dict(error=stopped)
    if code != 0:
        return dict(error=f"{last_line(output[-3000:])} (exit code {code})", log=output[-6000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    recomputed = RECOMPUTED.search(output)
    plan = json.loads((out / "run_plan.json").read_text())
    return dict(loss=[r["loss"] for r in records], lr=[r["lr"] for r in records],
                grad_norm=[r["grad_norm"] for r in records], tokens=[r["tokens"] for r in records],
                wall_s=round(time.perf_counter() - started, 1),
                peak_gib=max((r.get("peak_mem_gib") or 0 for r in records), default=None) or None,
                recomputed=(f"{recomputed.group(1)} of {recomputed.group(2)} blocks" if recomputed else
                            f"{plan['recompute']:g} of the blocks" if isinstance(plan["recompute"], (int, float))
                            else str(plan["recompute"])),
                plan={k: plan[k] for k in ("parallel", "bf16", "bf16_weights", "padding_free", "fused_loss",
                                           "compile", "gradient_accumulation_steps", "fused_adamw")})


def hf_run(args, path: Path, out: Path, deadline: Deadline, gpu: int | None) -> dict:
    """One HF Trainer replay of a meshtune config (on GPU `gpu` where given)."""
    env = dict(os.environ)
    if gpu is not None:  # the gpu-th of the GPUs this script sees
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if visible else str(gpu)
    else:  # a CPU run: one thread, as meshtune's workers under torchrun
        env["OMP_NUM_THREADS"] = "1"
    out.unlink(missing_ok=True)  # a result left by an earlier run must not pass for this one's
    timeout, stopped = deadline.timeout(args.run_timeout)
    started = time.perf_counter()
    code, output = run_captured([sys.executable, str(BENCH / "hf_replay.py"), str(path), "--processes",
                                 str(args.gpus), "--out", str(out)], timeout, env=env,
                                log=out.with_suffix(".log"))
    if code is None:
        return dict(error=stopped)
    if code != 0 or not out.is_file():
        return dict(error=f"{last_line(output[-3000:])} (exit code {code})", log=output[-6000:])
    return dict(json.loads(out.read_text()), wall_s=round(time.perf_counter() - started, 1))


def relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / ((abs(x) + abs(y)) / 2) if x != y else 0.0 for x, y in zip(a, b)]


def window_means(values: list[float]) -> list[float]:
    return [sum(values[i:i + WINDOW]) / len(values[i:i + WINDOW]) for i in range(0, len(values), WINDOW)]


def final_loss(run: dict) -> float:
    return sum(run["loss"][-WINDOW:]) / len(run["loss"][-WINDOW:])


def compare(label: str, a: dict, b: dict) -> dict:
    """Two runs' loss curves: relative differences per step and between 10-step means, and of the final loss."""
    steps = relative(a["loss"], b["loss"])
    windows = relative(window_means(a["loss"]), window_means(b["loss"]))
    worst = max(range(len(steps)), key=steps.__getitem__)
    return dict(compared=label, step_max=max(steps), step_max_at=worst + 1, step_mean=sum(steps) / len(steps),
                window_max=max(windows), window_mean=sum(windows) / len(windows),
                final=relative([final_loss(a)], [final_loss(b)])[0])


def report(runs: dict[str, dict], seeds: list[int]) -> dict:
    """The comparisons of the runs that finished: the stacks on each seed, the seeds within each stack; whether
    the stacks differ within the seeds' noise; the schedule's and the tokens' agreement."""
    done = {name: run for name, run in runs.items() if "loss" in run}
    stacks, noise, schedule = [], [], []
    for seed in seeds:
        ours, theirs = done.get(f"meshtune-seed{seed}"), done.get(f"hf-seed{seed}")
        if ours and theirs and len(ours["loss"]) == len(theirs["loss"]):
            stacks.append(compare(f"meshtune vs HF Trainer, seed {seed}", ours, theirs))
            schedule.append(dict(seed=seed, lr_max=max(relative(ours["lr"], theirs["lr"])),
                                 same_tokens=ours["tokens"] == theirs["tokens"]))
    first, second = seeds[0], seeds[-1]
    for stack in STACKS:
        a, b = done.get(f"{stack}-seed{first}"), done.get(f"{stack}-seed{second}")
        if first != second and a and b and len(a["loss"]) == len(b["loss"]):
            noise.append(compare(f"seed {first} vs seed {second}, {NAMES[stack]}", a, b))
    verdict = None
    if stacks and noise:
        difference = sum(c["window_mean"] for c in stacks) / len(stacks)
        spread = sum(c["window_mean"] for c in noise) / len(noise)
        verdict = dict(stacks=difference, noise=spread, within_noise=difference <= spread,
                       ratio=difference / spread if spread else None)
    return dict(stacks=stacks, noise=noise, schedule=schedule, verdict=verdict)


def render(summary: dict) -> str:
    args, runs, found = summary["args"], summary["runs"], summary["report"]
    device = f"{summary['device']} x {summary['gpus']}" if summary["gpus"] else summary["device"]
    lines = [f"{device}; Qwen2.5 {args['size']} shape, random init, full fine-tuning; "
             f"{args['steps']} steps of {summary['global_batch']} samples ({args['minlen']}..{args['maxlen']} tokens, "
             f"chain-and-copy over {args['symbols']} ids); lr {args['lr']:g}, cosine, warmup "
             f"{summary['meshtune_config']['warmup_steps']} steps, weight decay 0.1, clipping 1.0",
             f"meshtune: {args['gpus']} processes, {summary['meshtune_levers']}",
             f"HF Trainer: one device, {summary['hf_settings']}", ""]
    plan = next((run["plan"] for run in runs.values() if run.get("plan")), None)
    if plan:  # what the runs did, as their run_plan.json says
        lines += ["meshtune's run plan: " + ", ".join(f"{k} {v}" for k, v in plan.items()), ""]
    if summary.get("memory_note"):
        lines += [f"memory: {summary['memory_note']}", ""]
    lines += ["| run | first loss | final loss (last 10 steps) | steps | wall s | peak GiB | recomputed |",
              "|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        if "loss" not in run:
            lines.append(f"| {name} | not run: {run.get('error') or run.get('skipped')} | | | | | |")
            continue
        lines.append(f"| {name} | {run['loss'][0]:.4f} | {final_loss(run):.4f} | {len(run['loss'])} | "
                     f"{run.get('wall_s', '')} | {run.get('peak_gib') or ''} | {run.get('recomputed', '')} |")
    lines += ["", "Relative differences |a - b| / mean(a, b) of the loss:", "",
              "| compared | per step: max (step) | per step: mean | 10-step means: max | 10-step means: mean | "
              "final loss |", "|---|---|---|---|---|---|"]
    for c in found["stacks"] + found["noise"]:
        lines.append(f"| {c['compared']} | {c['step_max']:.2e} ({c['step_max_at']}) | {c['step_mean']:.2e} | "
                     f"{c['window_max']:.2e} | {c['window_mean']:.2e} | {c['final']:.2e} |")
    for s in found["schedule"]:
        lines.append(f"\nseed {s['seed']}: learning rates differ by at most {s['lr_max']:.1e} (relative); "
                     f"the steps' tokens are {'the same' if s['same_tokens'] else 'NOT the same'} in both stacks")
    verdict = found["verdict"]
    if verdict:
        lines.append(f"\nThe stacks differ by {verdict['stacks']:.2e} (mean over 10-step means), the seeds by "
                     f"{verdict['noise']:.2e}: {'within' if verdict['within_noise'] else 'beyond'} run-to-run noise.")
    complete = [name for name, run in runs.items() if "loss" in run]
    if complete:
        every = max(1, args["steps"] // 10)
        shown = sorted(set(range(0, args["steps"], every)) | {args["steps"] - 1})
        lines += ["", "| step | " + " | ".join(complete) + " |", "|---|" + "---|" * len(complete)]
        for i in shown:
            cells = [f"{runs[n]['loss'][i]:.4f}" if i < len(runs[n]["loss"]) else "" for n in complete]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        if "loss" in run:
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], label=name,
                    linestyle="-" if name.startswith("meshtune") else "--", linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b", choices=list(SIZES), help="the model shape (bench/workspace.py)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--seeds", default="1,2", help="two seeds, comma-separated: each stack runs once with each")
    p.add_argument("--gpus", type=int, default=2, help="meshtune's processes (zero3 over them); HF runs on one")
    p.add_argument("--bs", type=int, default=8, help="samples a micro-batch (per process)")
    p.add_argument("--accumulation", type=int, default=2,
                   help="meshtune's gradient_accumulation_steps (HF's: this x --gpus, for the same global batch)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (cosine, 10%% warmup)")
    p.add_argument("--minlen", type=int, default=64, help="shortest sample, tokens")
    p.add_argument("--maxlen", type=int, default=512, help="longest sample, tokens (the cutoff_len)")
    p.add_argument("--symbols", type=int, default=512, help="token ids the task's chain walks over")
    p.add_argument("--memory-budget", default="half",
                   help="meshtune's memory_budget: half (measured first: about half the blocks recomputed) | "
                        "default (meshtune's: 0.9 of the card) | GiB above 1, or a share of the card")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a meshtune config key for its runs (values as YAML), e.g. --set master_weights=fp32")
    p.add_argument("--only", choices=STACKS, help="run one stack; the report takes the other's runs from --out")
    p.add_argument("--run-timeout", type=int, default=1200, help="seconds one run may take")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds from this script's start: no run starts after it, a run still going is stopped "
                        "at it, and the report lists it as not run")
    p.add_argument("--work", default="/tmp/meshtune-parity", help="model, samples, configs and run outputs")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="parity.json, parity.md, parity.png, runs/")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds}: whole numbers, comma-separated")
    if len(args.seeds) != 2 or args.seeds[0] == args.seeds[1]:
        p.error(f"--seeds: two different seeds (run-to-run noise is seed against seed), not {args.seeds}")
    try:
        pairs = (item.split("=", 1) for item in args.set)
        args.set = {key.strip(): yaml.safe_load(value) for key, value in pairs}
    except ValueError:
        p.error(f"--set takes KEY=VALUE, not {args.set}")
    if args.memory_budget not in ("half", "default"):
        try:
            args.memory_budget = float(args.memory_budget)
        except ValueError:
            p.error(f"--memory-budget {args.memory_budget}: half, default or a number")
    if not 3 <= args.minlen <= args.maxlen or args.minlen // 2 > (args.maxlen - 1) // 2:
        p.error("--minlen and --maxlen: 3 <= minlen <= maxlen with an odd length between them (a sample is a walk, "
                "the separator and the walk again)")
    if args.steps < 1:
        p.error("--steps: at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = Deadline(args.time_limit)
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count()
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if cuda and gpus < args.gpus and args.only != "hf":
        sys.exit(f"--gpus {args.gpus}: this machine has {gpus} GPUs")
    model_dir, data_file, work, digest = prepare(args)
    configs = {seed: meshtune_config(args, seed, model_dir, data_file, work, cuda) for seed in args.seeds}
    paths = {seed: write_config(cfg, work / f"meshtune-seed{seed}.yaml") for seed, cfg in configs.items()}
    ids = {seed: identity(cfg, args.gpus, digest, work) for seed, cfg in configs.items()}
    memory_note = None

    def run_file(stack: str, seed: int) -> Path:
        return out / "runs" / f"{stack}-seed{seed}-{ids[seed]}.json"

    def finished(stack: str, seed: int) -> dict | None:
        """The run's figures from an earlier invocation with the same identity, if it finished."""
        file = run_file(stack, seed)
        run = json.loads(file.read_text()) if file.is_file() else {}
        return run if "loss" in run else None

    def record(stack: str, seed: int, result: dict) -> None:
        result = dict(result, stack=stack, seed=seed, identity=ids[seed])
        run_file(stack, seed).write_text(json.dumps(result))
        print(json.dumps({k: v for k, v in result.items() if k not in ("loss", "lr", "grad_norm", "tokens", "log")}),
              flush=True)

    kept = [f"{stack}-seed{seed}" for stack in STACKS for seed in args.seeds if finished(stack, seed)]
    if kept:
        print(f"kept from {out / 'runs'} (finished with these settings): {', '.join(kept)}", flush=True)
    if args.only != "hf":
        pending = [seed for seed in args.seeds if not finished("meshtune", seed)]
        budget = args.memory_budget
        if budget == "half" and pending and cuda and "memory_budget" not in args.set and not deadline.passed():
            budget, memory_note = probe_memory(args, configs[pending[0]], work, deadline)
            print(memory_note, flush=True)
        for seed in pending:
            if isinstance(budget, float):
                configs[seed]["memory_budget"] = budget
                write_config(configs[seed], paths[seed])
            if deadline.passed():
                record("meshtune", seed, dict(skipped="time limit"))
                continue
            record("meshtune", seed, dict(meshtune_run(args, configs[seed], paths[seed], deadline), memory=memory_note))
    if args.only != "meshtune":
        def replay(seed: int, gpu: int | None) -> None:
            if deadline.passed():
                return record("hf", seed, dict(skipped="time limit"))
            record("hf", seed, hf_run(args, paths[seed], work / f"hf-seed{seed}.json", deadline, gpu))

        pending = [seed for seed in args.seeds if not finished("hf", seed)]
        if gpus >= 2 or not cuda:  # side by side: one GPU each (on a CPU, one thread each)
            threads = [threading.Thread(target=replay, args=(seed, i if cuda else None))
                       for i, seed in enumerate(pending)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for seed in pending:
                replay(seed, 0)

    runs = {}
    for stack in STACKS:
        for seed in args.seeds:
            file = run_file(stack, seed)
            runs[f"{stack}-seed{seed}"] = (json.loads(file.read_text()) if file.is_file() else
                                           dict(skipped=f"no run with these settings in {out / 'runs'}"))
    memory_note = memory_note or next((r["memory"] for r in runs.values() if r.get("memory")), None)
    levers = ", ".join(f"{k} {v}" for k, v in configs[args.seeds[0]].items() if k in (
        "parallel", "padding_free", "fused_loss", "torch_compile", "master_weights", "gradient_checkpointing",
        "gradient_checkpointing_ratio", "memory_budget") or k in args.set)
    summary = dict(device=torch.cuda.get_device_name() if cuda else "cpu", gpus=gpus, args=vars(args),
                   global_batch=global_batch(args), meshtune_config={k: v for k, v in configs[args.seeds[0]].items()
                                                                     if k not in ("seed", "output_dir")},
                   meshtune_levers=levers, memory_note=memory_note,
                   hf_settings=("bf16 autocast, fp32 weights and AdamW (fused), sdpa attention, padded batches, "
                                if cuda else "fp32, padded batches, ") +
                   f"{args.bs} samples a micro-batch, accumulation {args.accumulation * args.gpus}",
                   report=report(runs, args.seeds), runs=runs)
    (out / "parity.json").write_text(json.dumps(summary, indent=1))
    table = render(summary)
    (out / "parity.md").write_text(table + "\n")
    plot(runs, out / "parity.png")
    print("\n" + table)


if __name__ == "__main__":
    main()
