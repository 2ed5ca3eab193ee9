"""`profile_steps: FIRST-LAST`: torch.profiler over those optimizer steps, to see where a step's time goes.

Writes output_dir/profile/rank{R}.json (a Chrome / Perfetto trace per rank: compare ranks to find a straggler or
a collective that waits) and, on rank 0, summary.txt: the operators with the most device time (CPU time on a
CPU run).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def parse_steps(spec: str) -> tuple[int, int]:
    """'10-12' -> (10, 12); '7' -> (7, 7). Steps count from 1, as in metrics.jsonl."""
    first, _, last = spec.partition("-")
    return int(first), int(last or first)


class StepProfiler:
    def __init__(self, spec: str | None, output_dir: Path, rank: int, device: torch.device):
        self.steps = parse_steps(spec) if spec else None
        self.directory = output_dir / "profile"
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.profiler = None

    def begin(self, step: int) -> None:
        """Called before optimizer step `step` (1-based) runs."""
        if self.steps and step == self.steps[0]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()

    def end(self, step: int, last: bool) -> None:
        """Called after optimizer step `step` finished (and was logged); `last`: the run's final step, which ends
        a window that reaches past it."""
        if self.profiler is None or (step != self.steps[1] and not last):
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.directory / f"rank{self.rank}.json"))
        if self.rank == 0:
            sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            table = self.profiler.key_averages().table(sort_by=sort, row_limit=40)
            (self.directory / "summary.txt").write_text(f"optimizer steps {self.steps[0]}-{step}\n{table}\n")
        self.profiler = None

    def close(self) -> None:
        """A run that ends inside the window still stops the profiler."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
