"""What rank 0 shows and keeps: one progress bar, metrics.jsonl, loss.png and a closing summary."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm


def peak_memory_gib(device: torch.device) -> float:
    """GPU: peak allocated by torch; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl; only rank 0 holds one."""

    def __init__(self, path: Path, total_steps: int, show_progress: bool, start_step: int = 0):
        """A resumed run keeps the records up to `start_step` and continues the file from there."""
        self.path = path
        self.records: list[dict] = []
        if start_step and path.is_file():
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.records = [r for r in kept if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stdout, disable=not show_progress, mininterval=1.0)
        self.started = time.perf_counter()

    def write(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        shown = {k: record[k] for k in ("loss", "eval_loss", "lr", "tokens_per_s") if k in record}
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()}, refresh=False)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def note(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def plot_losses(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(records: list[dict], seconds: float, total_tokens: int, final_dir: Path | None, world_size: int) -> str:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    lines = ["", "=" * 60, "meshtune: training finished"]
    if train:
        lines.append(f"  steps          {train[-1]['step']}  (epoch {train[-1]['epoch']:.2f})")
        lines.append(f"  train loss     {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}")
    if evals:
        lines.append(f"  eval loss      {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}")
    lines.append(f"  time           {seconds:.1f} s on {world_size} process(es)")
    lines.append(f"  tokens         {total_tokens:,} ({total_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    if train and "peak_mem_gib" in train[-1]:
        lines.append(f"  peak memory    {max(r['peak_mem_gib'] for r in train):.2f} GiB (rank 0)")
    lines.append(f"  saved          {final_dir or 'nothing (save_final: false)'}")
    lines.append("=" * 60)
    return "\n".join(lines)
