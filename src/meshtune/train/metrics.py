"""What a run measures and rank 0 shows: each logging interval's record (loss, tokens/s, TFLOP/s, MFU, memory), one
progress bar, metrics.jsonl (and the trackers of report_to), loss.png and a closing summary."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from meshtune.distributed import DistEnv
from meshtune.train.trackers import Trackers

logger = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """GPU: peak allocated by torch; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile (dynamo frames, with their inductor compiles)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


class StepMeter:
    """Adds up each optimizer step's loss, tokens and FLOPs (all ranks' totals) and, every `logging_steps` steps and at
    the last, turns the interval into one metrics record. Tokens and FLOPs stay on the device until a record is
    made, so counting never waits for the GPU."""

    def __init__(self, logging_steps: int, total_steps: int, env: DistEnv, peak_flops: float | None, compiled: bool):
        self.logging_steps, self.total_steps = logging_steps, total_steps
        self.env, self.peak_flops, self.compiled = env, peak_flops, compiled
        self.total_tokens = 0
        self._reset()

    def _reset(self) -> None:
        self.started, self.tokens, self.flops, self.losses = time.perf_counter(), 0, 0.0, []
        self.reported: dict[str, list[torch.Tensor]] = {}  # the objective's own metrics, step by step

    def add(self, loss: torch.Tensor, tokens: torch.Tensor, flops: torch.Tensor, counted: bool = True,
            reported: dict[str, torch.Tensor] | None = None) -> None:
        """One step: its loss per target token (the objective's normaliser), the objective's `reported` metrics, and
        its token and FLOP counts summed over all ranks. The loss and metrics of a step not `counted` (skipped for a
        non-finite loss) stay out of the interval's mean."""
        if counted:
            self.losses.append(loss)
            for name, value in (reported or {}).items():
                self.reported.setdefault(name, []).append(value)
        self.tokens += tokens
        self.flops += flops

    def record(self, step: int, epoch: float, grad_norm: torch.Tensor, lr: float) -> dict:
        """The interval's record when `step` ends one, else {} (and the interval goes on)."""
        if step % self.logging_steps and step != self.total_steps:
            return {}
        tokens = int(self.tokens)
        seconds = max(time.perf_counter() - self.started, 1e-9)
        flops_per_gpu = float(self.flops) / seconds / self.env.world_size  # FLOP/s
        norm = float(grad_norm)
        record = {"step": step, "epoch": round(epoch, 4),
                  **({"loss": torch.stack(self.losses).mean().item()} if self.losses else {}),
                  **reported_means(self.reported),
                  "grad_norm": norm if math.isfinite(norm) else None, "lr": lr, "tokens": tokens,
                  "tokens_per_s": round(tokens / seconds, 1), "tflops_per_gpu": float(f"{flops_per_gpu / 1e12:.4g}"),
                  "peak_mem_gib": round(peak_memory_gib(self.env.device), 3)}
        if self.env.device.type == "cuda":  # the caching allocator freed everything and retried: fragmentation
            record["alloc_retries"] = torch.cuda.memory_stats(self.env.device).get("num_alloc_retries", 0)
            # what the allocator holds from the card, its cached blocks included: peak_mem_gib counts only what it
            # has handed out, and the difference is what fragmentation costs
            record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(self.env.device) / 2**30, 3)
        if self.compiled:  # seconds spent compiling so far: a step that compiled shows up as a jump
            record["compile_s"] = round(compile_seconds(), 2)
        if self.peak_flops:
            record["mfu"] = round(flops_per_gpu / self.peak_flops, 4)
        self.total_tokens += tokens
        self._reset()
        return record


class CompileWatch:
    """Says when a step after the first spent real time in torch.compile (a sample length or code path the
    compiled graphs had not met): such a step is slow once, and tokens/s over it is not the steady speed."""

    def __init__(self, seconds=compile_seconds, threshold: float = 0.5, limit: int = 5):
        self.seconds, self.threshold, self.left = seconds, threshold, limit
        self.seen = seconds()

    def after_step(self, step: int) -> str | None:
        now = self.seconds()
        spent, self.seen = now - self.seen, now
        if step <= 1 or spent < self.threshold or not self.left:
            return None
        self.left -= 1
        more = "" if self.left else " (no further notes of this kind)"
        return (f"note: step {step} spent {spent:.1f} s compiling (a new sample length or code path for the compiled "
                f"blocks); its tokens/s is not the steady speed{more}")


class MetricsLog:
    """Rank 0's side of the metrics: appends each record to metrics.jsonl, hands it to the `trackers`, and drives
    the progress bar. On the other ranks (`enabled` False) every method does nothing."""

    def __init__(self, path: Path, total_steps: int, enabled: bool, start_step: int = 0, compiled: bool = False,
                 trackers: Trackers | None = None):
        """A resumed run keeps the records up to `start_step` and continues the file from there."""
        self.path, self.enabled = path, enabled
        self.trackers = trackers or Trackers([])
        self.step, self.total_steps = start_step, total_steps
        self.records: list[dict] = []
        self.compile_watch = CompileWatch() if compiled and enabled else None
        if not enabled:
            return
        if start_step and path.is_file():
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.records = [r for r in kept if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stdout, mininterval=1.0)

    def after_step(self, step: int, record: dict) -> None:
        """The step's record (if it made one), a note if it spent time compiling, and one more step on the bar."""
        if not self.enabled:
            return
        self.step = step
        if record:
            self.write(record)
        note = self.compile_watch.after_step(step) if self.compile_watch else None
        if note:
            logger.info(note)
        self.bar.update(1)

    def note(self, text: str | None) -> None:
        """A warning, shown above the progress bar (rank 0)."""
        if self.enabled and text:
            logger.warning(text)

    def write(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record)
        shown = {k: record[k] for k in ("loss", "eval_loss", "rewards/accuracies", "rewards/margins", "lr",
                                        "tokens_per_s") if k in record}
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()}, refresh=False)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
        self.trackers.close(finished=self.step == self.total_steps)


def plot_losses(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:  # one logged step is a point, which a line alone would not show
        ax.plot(*zip(*train), "o-" if len(train) == 1 else "-", label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    if len(train) == 1:
        ax.set_title("one logged step: lower logging_steps for a curve", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trend(records: list[dict], key: str) -> str:
    if len(records) == 1:
        return f"{records[0][key]:.4f} (one logged step)"
    return f"{records[0][key]:.4f} -> {records[-1][key]:.4f}"


def summary(records: list[dict], seconds: float, total_tokens: int, final_dir: Path | None, world_size: int) -> str:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    lines = ["", "=" * 60, "meshtune: training finished"]
    if train:
        lines.append(f"  steps          {train[-1]['step']}  (epoch {train[-1]['epoch']:.2f})")
        lines.append(f"  train loss     {trend(train, 'loss')}")
    if evals:
        lines.append(f"  eval loss      {trend(evals, 'eval_loss')}")
    lines.append(f"  time           {seconds:.1f} s on {world_size} process(es)")
    lines.append(f"  tokens         {total_tokens:,} ({total_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    if train and "peak_mem_gib" in train[-1]:
        lines.append(f"  peak memory    {max(r['peak_mem_gib'] for r in train):.2f} GiB (rank 0)")
    lines.append(f"  saved          {final_dir or 'nothing (save_final: false)'}")
    lines.append("=" * 60)
    return "\n".join(lines)


def reported_means(reported: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Each of the objective's metrics averaged over the interval's steps that define it (NaN: a step that does not,
    such as one with no desirable sample for a desirable response's reward); left out where none does."""
    means = {name: torch.stack(values).double().nanmean().item() for name, values in reported.items()}
    return {name: value for name, value in means.items() if not math.isnan(value)}
