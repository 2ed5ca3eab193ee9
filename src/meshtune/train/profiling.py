"""`profile_steps: FIRST-LAST`: torch.profiler over those optimizer steps, to see where a step's time goes.

Writes output_dir/profile/rank{R}.json (a Chrome / Perfetto trace per rank: compare ranks to find a straggler or
a collective that waits) and, on rank 0, summary.txt: the operators with the most device time, then (on CUDA)
those with the most host time, which is where a step that leaves the GPU idle spends it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def parse_steps(spec: str) -> tuple[int, int]:
    """'10-12' -> (10, 12); '7' -> (7, 7). Steps count from 1, as in metrics.jsonl."""
    first, _, last = spec.partition("-")
    return int(first), int(last or first)


def device_time_line(averages, wall: float) -> str:
    """Where the window's wall time went on the GPU: kernel time outside and inside NCCL (the two overlap on
    separate streams; compute well under the wall time means the GPU waited, on the host or on another rank)."""
    # device events only: not the CPU ops that launched them, and not the GPU-side copies of annotated ranges
    # (nccl:all_reduce, DistributedDataParallel.forward, Optimizer.step), which span kernels counted already
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    nccl = sum(e.device_time_total for e in kernels if "nccl" in e.key.lower()) / 1e6
    compute = sum(e.device_time_total for e in kernels if "nccl" not in e.key.lower()) / 1e6
    return (f"device: kernels and copies {compute:.3f} s ({compute / wall:.0%} of wall), NCCL kernels {nccl:.3f} s "
            f"({nccl / wall:.0%})")


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
            self.started = time.perf_counter()

    def end(self, step: int, last: bool) -> None:
        """Called after optimizer step `step` finished (and was logged); `last`: the run's final step, which ends
        a window that reaches past it."""
        if self.profiler is None or (step != self.steps[1] and not last):
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.directory / f"rank{self.rank}.json"))
        if self.rank == 0:
            averages = self.profiler.key_averages()
            head = f"optimizer steps {self.steps[0]}-{step}: {wall:.3f} s wall"
            tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
            if self.cuda:
                head += "\n" + device_time_line(averages, wall)
                tables.insert(0, averages.table(sort_by="self_cuda_time_total", row_limit=40))
            (self.directory / "summary.txt").write_text("\n".join([head, *tables]) + "\n")
        self.profiler = None

    def close(self) -> None:
        """A run that ends inside the window still stops the profiler."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
