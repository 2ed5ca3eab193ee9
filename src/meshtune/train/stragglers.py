"""Which rank holds the others back: every rank times its own steps and its waits at the step's collectives, and
every logging interval the ranks compare them in one small all-gather.

All ranks leave a collective together, so a slow rank shows not in its own step time (everyone's is the same) but
in the others' waiting for it: its own work, step time minus time spent waiting, is the largest. The waits are
timed where the loop's own collectives line the ranks up (the step's counts and its loss): on the host under gloo,
where a collective blocks; on CUDA by events around the collective on the compute stream, read when the interval
ends (the record already waits for the GPU then), so no step gains a sync point. A rank slow in its forward or
backward is waited for inside the gradient reduction instead, which overlaps backward and is not timed: it shows as
the others' shorter wait at the next line-up only when its delay outlasts the reduction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from meshtune.distributed import DistEnv

T = TypeVar("T")


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its node rank and host name (from the agreement check's gather at start)."""

    node: int
    host: str


class StepTimes:
    """This rank's step times and collective waits over the logging interval; `interval` compares all ranks'."""

    def __init__(self, env: DistEnv, places: list[Place], threshold: float, intervals: int):
        self.env, self.places = env, places
        self.threshold, self.intervals = threshold, intervals
        self.cuda = env.device.type == "cuda"
        self.streak: tuple[int, int] = (-1, 0)  # (rank, consecutive intervals over the threshold)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # reused: creating them costs more
        self._reset()

    def _reset(self) -> None:
        self.steps, self.step_s, self.wait_s = 0, 0.0, 0.0
        self._pending = 0  # events of this interval recorded so far
        self._started: float | None = None

    def begin(self) -> None:
        self._started = time.perf_counter()

    def end(self) -> None:
        if self._started is not None:
            self.step_s += time.perf_counter() - self._started
            self.steps += 1
            self._started = None

    def line_up(self, collective: Callable[[], T]) -> T:
        """Run one of the step's collectives, adding the time this rank waited in it."""
        if self.env.world_size == 1:
            return collective()
        if self.cuda:
            if self._pending == len(self._events):
                self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            start, end = self._events[self._pending]
            start.record()
            result = collective()
            end.record()
            self._pending += 1
            return result
        started = time.perf_counter()
        result = collective()
        self.wait_s += time.perf_counter() - started
        return result

    def interval(self) -> tuple[dict, str | None]:
        """All ranks together, at the end of a logging interval: the record's fields (slowest rank, its node and
        host, how much longer its own work took than the median rank's) and a warning once a rank has stayed over
        the threshold for `intervals` intervals in a row (repeated every 10 x `intervals` while it stays)."""
        if self.env.world_size == 1 or not self.steps:
            self._reset()
            return {}, None
        if self._pending:  # the events are on one stream: its last one done, all are
            self._events[self._pending - 1][1].synchronize()
        for start, end in self._events[:self._pending]:
            self.wait_s += start.elapsed_time(end) / 1000
        mine = torch.tensor([self.step_s / self.steps, self.wait_s / self.steps], dtype=torch.float64,
                            device=self.env.device)
        gathered = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        self._reset()
        step_s, wait_s = (list(column) for column in zip(*torch.stack(gathered).tolist()))
        own = [max(s - w, 1e-9) for s, w in zip(step_s, wait_s)]
        slowest = max(range(len(own)), key=own.__getitem__)
        median = statistics.median_low(own)
        slower = own[slowest] / median - 1
        place = self.places[slowest]
        fields = {"step_s": round(statistics.median(step_s), 4), "slowest_rank": slowest,
                  "slowest_node": place.node, "slowest_host": place.host, "slowest_over_median": round(slower, 4),
                  "max_wait_s": round(max(wait_s), 4)}
        return fields, self._warning(slowest, slower, own, median, wait_s)

    def _warning(self, slowest: int, slower: float, own: list[float], median: float,
                 wait_s: list[float]) -> str | None:
        if not self.threshold or slower <= self.threshold:
            self.streak = (-1, 0)
            return None
        count = self.streak[1] + 1 if self.streak[0] == slowest else 1
        self.streak = (slowest, count)
        if count != self.intervals and count % (10 * self.intervals):  # when it begins, then now and then
            return None
        place = self.places[slowest]
        others = [w for r, w in enumerate(wait_s) if r != slowest]
        return (f"warning: rank {slowest} (node {place.node}, host {place.host}) is a straggler: its own work took "
                f"{slower:.0%} longer than the median rank's for {count} logging intervals in a row "
                f"({own[slowest]:.3f} s vs {median:.3f} s a step; the other ranks waited for it "
                f"{statistics.median(others):.3f} s a step). Look for a slow GPU (clocks, temperature: nvidia-smi -q "
                f"-d PERFORMANCE), other jobs on that host, or its data loading")
