"""A node's pipelines on the node's one link: what staggering them buys.

Under pipeline_parallel with data parallelism inside each stage, a node holds several pipelines (its processes,
each a replica of the node's stage with micro-batches of its own), and every one of them sends its activations
(and their gradients) over the node's link. Started together they reach each stage boundary together, so each hop
waits for all of them: the link carries the node's pipelines' hops at once and the stage downstream idles for all
of it (meshtune.crossing's `pipeline_step` prices exactly that: a hop is every pipeline's sends). Started one
pipeline's hop apart, the pipelines reach the link in turn: each hop is one pipeline's bytes at the link's whole
rate, and the link carries the next pipeline's while this one computes. The cost is the last pipeline's late start
(the node's pipelines less one, times a hop) and nothing a step trains on changes.

`simulate_pipelines` replays torch's schedule (crossing.schedule_actions) for each of a node's pipelines, each
node's link sharing its rate among the transfers under way; `priced_pipeline` is the step the plan and the
projection price a pipeline by: in step (crossing.pipeline_step) or staggered, whichever is shorter, and staggered
only where the pipelines may drift apart (not under zero3 inside a stage, whose weight gathers at every
micro-batch's forward are collectives among them that put them back in step).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

from meshtune.crossing import (Collective, PipelineShape, StageCost, StepTime, hop_seconds, input_of, output_of,
                               pipeline_step, scaled_costs, schedule_actions, stage_ranks)

STAGGER_MARGIN = 0.01  # staggering is chosen only where its predicted step is this much shorter than in step


def priced_pipeline(crossing: list[Collective], nodes: int, busbw: float, compute_s: float, shape: PipelineShape,
                    pipelines: int, stagger: bool | None = None) -> tuple[StepTime, bool]:
    """A pipeline's optimizer step with `pipelines` of them a node (a stage's data-parallel replicas on one node),
    and whether they are staggered: in step as crossing.pipeline_step prices it, or, where a node holds more than
    one, started a hop apart (`pipelines_step`): with `stagger` None where that is STAGGER_MARGIN shorter, else as
    `stagger` says."""
    in_step = pipeline_step(crossing, nodes, busbw, compute_s, shape)
    if pipelines < 2 or stagger is False or not hop_seconds(crossing, busbw, shape):
        return in_step, False
    staggered = pipelines_step(crossing, busbw, compute_s, shape, pipelines, stagger=True)
    if stagger or staggered.step_s < (1 - STAGGER_MARGIN) * in_step.step_s:
        return staggered, True
    return in_step, False


def pipelines_step(crossing: list[Collective], busbw: float, compute_s: float, shape: PipelineShape,
                   pipelines: int, stagger: bool) -> StepTime:
    """A step of `pipelines` identical pipelines a node, a hop one pipeline's micro-batch at the link's rate, each
    node's link shared among the transfers under way (`simulate_pipelines`); with `stagger` pipeline p starts p
    hops late."""
    hop_s = hop_seconds(crossing, busbw, shape) / pipelines
    pp = len(shape.costs) // shape.virtual
    finish, busiest = simulate_pipelines(schedule_actions(shape.schedule, pp, shape.micro, shape.virtual),
                                         scaled_costs(shape, compute_s),
                                         stage_ranks(shape.schedule, pp, shape.virtual), hop_s, pipelines,
                                         hop_s if stagger else 0.0)
    return StepTime(compute_s, finish - compute_s, reduce_s=hop_s * pipelines * shape.micro,
                    bubble_s=finish - busiest)


def simulate_pipelines(actions: list[list[tuple]], costs: list[StageCost], rank_of: list[int], hop_s: float,
                       pipelines: int, offset_s: float) -> tuple[float, float]:
    """(the last action's end, the most compute one process has) for `pipelines` copies of one pipeline: each
    rank's actions in order (crossing.input_of: what each waits on), copy p's first no earlier than p x
    `offset_s`; a value another rank needs crosses the sending rank's link, which carries one transfer in `hop_s`
    alone and shares its rate equally among those under way. Events are taken in time order: a transfer is asked
    for when its value is made, and what that lets run asks for its own no earlier."""
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
