"""Levers a pipeline across nodes does not have, priced by the projection's own simulation (scaling_model.py
--what-if), to say which is worth building:

- even-stages: every stage the mean stage's cost (the ranks' compute equal, as stage boundaries inside blocks would
  nearly make it);
- hop-bytes=SHARE: the activations and their gradients crossing at that share of their bf16 bytes (0.5: 8-bit);
- stagger: a node's data-parallel pipelines started one pipeline's hop apart, each hop one pipeline's activations
  over the node's link, which shares its rate among the transfers under way (`pipelines_step`);
- shared-link: the same simulation with the pipelines in step, to tell the stagger's effect from the link model's.
meshtune.crossing's simulation sends a node's pipelines' activations as one hop, each waiting for all of them, and
bounds the link's load only by the step's whole traffic. Nothing here is built: it says what would be worth building.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WhatIf:
    even_stages: bool = False
    hop_bytes: float = 1.0
    link: str = ""  # "": crossing.py's hops; "in-step" (shared-link) or "stagger": simulate_pipelines'

    @classmethod
    def parse(cls, text: str | None) -> WhatIf:
        """--what-if: a comma list of even-stages, hop-bytes=SHARE, shared-link and stagger; ValueError names the
        choices."""
        even, share, link = False, 1.0, ""
        for item in (i.strip() for i in (text or "").split(",") if i.strip()):
            key, _, value = item.partition("=")
            if key == "even-stages" and not value:
                even = True
            elif key in ("stagger", "shared-link") and not value and not link:
                link = "stagger" if key == "stagger" else "in-step"
            elif key == "hop-bytes" and value:
                share = float(value)
                if not 0 < share <= 1:
                    raise ValueError(f"--what-if hop-bytes={value}: a share of the bf16 bytes in (0, 1]")
            else:
                raise ValueError(f"--what-if {item}: choose from even-stages, hop-bytes=SHARE (e.g. 0.5), and one of "
                                 f"shared-link, stagger")
        return cls(even, share, link)

    def describe(self) -> str:
        links = {"in-step": "each node's link shared among its pipelines' transfers under way, the pipelines in step",
                 "stagger": "each node's link shared among its pipelines' transfers under way, the pipelines started "
                            "one pipeline's hop apart"}
        parts = (["every stage the mean stage's cost"] if self.even_stages else []) + (
            [f"the hops at {self.hop_bytes:g} of their bf16 bytes"] if self.hop_bytes != 1 else []) + (
            [links[self.link]] if self.link else [])
        return "; ".join(parts)

    def shape(self, shape):
        if not self.even_stages:
            return shape
        from meshtune.crossing import PipelineShape, StageCost

        n = len(shape.costs)
        mean = StageCost(*(sum(getattr(c, part) for c in shape.costs) / n
                           for part in ("forward", "input_grad", "weight_grad")))
        return PipelineShape(shape.schedule, shape.virtual, shape.micro, (mean,) * n)

    def crossing(self, crossing: list) -> list:
        return [replace(c, bytes=c.bytes * self.hop_bytes) if c.kind == "send" else c for c in crossing]

    def step(self, crossing: list, nodes: int, busbw: float, compute_s: float, shape, pipelines: int):
        """The pipeline's step (meshtune.crossing.StepTime) over `crossing` (already `self.crossing`'s) with these
        levers: crossing.pipeline_step, or `pipelines_step` over the node's `pipelines`."""
        from meshtune.crossing import pipeline_step

        shape = self.shape(shape)
        if not self.link:
            return pipeline_step(crossing, nodes, busbw, compute_s, shape)
        return pipelines_step(crossing, busbw, compute_s, shape, pipelines, self.link == "stagger")


def pipelines_step(crossing: list, busbw: float, compute_s: float, shape, pipelines: int, stagger: bool):
    """A step of `pipelines` identical pipelines a node (the stages' processes' data-parallel replicas), a hop one
    pipeline's micro-batch at the link's rate, each node's link shared among the transfers under way
    (`simulate_pipelines`); with `stagger` pipeline p starts p hops late."""
    from meshtune.crossing import StepTime, hop_seconds, scaled_costs, schedule_actions, stage_ranks

    hop_s = hop_seconds(crossing, busbw, shape) / pipelines
    pp = len(shape.costs) // shape.virtual
    finish, busiest = simulate_pipelines(schedule_actions(shape.schedule, pp, shape.micro, shape.virtual),
                                         scaled_costs(shape, compute_s),
                                         stage_ranks(shape.schedule, pp, shape.virtual), hop_s, pipelines,
                                         hop_s if stagger else 0.0)
    return StepTime(compute_s, finish - compute_s, reduce_s=hop_s * pipelines * shape.micro,
                    bubble_s=finish - busiest)


def simulate_pipelines(actions: list[list[tuple]], costs: list, rank_of: list[int], hop_s: float, pipelines: int,
                       offset_s: float) -> tuple[float, float]:
    """(the last action's end, the most compute one process has) for `pipelines` copies of one pipeline: each
    rank's actions in order (meshtune.crossing.input_of: what each waits on), copy p's first no earlier
    than p x `offset_s`; a value another rank needs crosses the sending rank's link, which carries one transfer in
    `hop_s` alone and shares its rate equally among those under way. Events are taken in time order: a transfer is
    asked for when its value is made, and what that lets run asks for its own no earlier."""
    from meshtune.crossing import input_of, output_of

    last = len(costs) - 1
    clock = {(p, r): p * offset_s for p in range(pipelines) for r in range(len(actions))}
    at = dict.fromkeys(clock, 0)
    usable: dict[tuple, float] = {}   # (copy, "F" | "G" | "W", stage, micro-batch, rank) -> when it can be read there
    asked: list[tuple] = []           # (time, order, the transfer)
    links: dict[int, SharedLink] = defaultdict(SharedLink)
    order = itertools.count()

    def readers(made: str, stage: int) -> list[int]:
        if made == "F":
            return [stage + 1] if stage < last else []
        return [stage - 1] if made == "G" and stage > 0 else []

    def run(p: int, r: int) -> None:
        mine = actions[r]
        while at[p, r] < len(mine):
            kind, stage, mb = mine[at[p, r]]
            need = input_of(kind, stage, mb, last)
            ready = 0.0 if need is None else usable.get((p, *need, r))
            if ready is None:
                return
            clock[p, r] = max(clock[p, r], ready) + costs[stage].of(kind)
            at[p, r] += 1
            made = output_of(kind)
            usable[p, made, stage, mb, r] = clock[p, r]
            for reader in readers(made, stage):
                if rank_of[reader] != r:
                    heapq.heappush(asked, (clock[p, r], next(order), (p, made, stage, mb, r, rank_of[reader])))

    for p, r in list(clock):
        run(p, r)
    while asked or any(link.flows for link in links.values()):
        done_at, source = min(((link.next_done(), rank) for rank, link in links.items() if link.flows),
                              default=(float("inf"), None))
        if asked and asked[0][0] <= done_at:
            when, _, transfer = heapq.heappop(asked)
            links[transfer[4]].add(when, hop_s, transfer)
            continue
        for p, made, stage, mb, _, target in links[source].finish(done_at):
            usable[p, made, stage, mb, target] = done_at
            run(p, target)
    if any(at[key] < len(actions[key[1]]) for key in at):
        raise RuntimeError("pipeline schedule: an action waits on one that never runs")
    busiest = max(sum(costs[stage].of(kind) for kind, stage, _ in mine) for mine in actions)
    return max(clock.values()), busiest


class SharedLink:
    """A node's link: the transfers under way share its rate equally (each `seconds` long alone)."""

    def __init__(self) -> None:
        self.flows: list[list] = []   # [seconds left alone, the transfer]
        self.at = 0.0

    def advance(self, when: float) -> None:
        if self.flows:
            share = (when - self.at) / len(self.flows)
            for flow in self.flows:
                flow[0] -= share
        self.at = when

    def add(self, when: float, seconds: float, transfer: tuple) -> None:
        self.advance(when)
        self.flows.append([seconds, transfer])

    def next_done(self) -> float:
        return self.at + min(flow[0] for flow in self.flows) * len(self.flows)

    def finish(self, when: float) -> list[tuple]:
        """The transfers that end at `when` (the link advanced to it), removed."""
        self.advance(when)
        ended = [flow[1] for flow in self.flows if flow[0] <= 1e-12]
        self.flows = [flow for flow in self.flows if flow[0] > 1e-12]
        return ended
