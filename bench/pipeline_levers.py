"""Levers a pipeline across nodes does not have, priced by the projection's own simulation (scaling_model.py
--what-if), to say which is worth building, and the plan's own pricing taken apart:

- even-stages: every stage the mean stage's cost (the ranks' compute equal, as stage boundaries inside blocks would
  nearly make it);
- hop-bytes=SHARE: the activations and their gradients crossing at that share of their bf16 bytes (0.5: 8-bit);
- in-step: a node's pipelines kept in step, as meshtune.crossing.pipeline_step prices them (a hop every pipeline's
  sends at once), where the plan would stagger them (meshtune.shared_link.priced_pipeline);
- shared-link: a node's pipelines simulated one by one on the node's link, which shares its rate among the
  transfers under way, kept in step: the same model as the staggered pricing, to tell the stagger's effect from the
  link model's.
The first two are not built: they say what would be worth building.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WhatIf:
    even_stages: bool = False
    hop_bytes: float = 1.0
    link: str = ""  # "": the plan's pricing; "in-step": crossing.pipeline_step; "shared-link": simulated in step

    @classmethod
    def parse(cls, text: str | None) -> WhatIf:
        """--what-if: a comma list of even-stages, hop-bytes=SHARE, and one of in-step and shared-link; ValueError
        names the choices."""
        even, share, link = False, 1.0, ""
        for item in (i.strip() for i in (text or "").split(",") if i.strip()):
            key, _, value = item.partition("=")
            if key == "even-stages" and not value:
                even = True
            elif key in ("in-step", "shared-link") and not value and not link:
                link = key
            elif key == "hop-bytes" and value:
                share = float(value)
                if not 0 < share <= 1:
                    raise ValueError(f"--what-if hop-bytes={value}: a share of the bf16 bytes in (0, 1]")
            else:
                raise ValueError(f"--what-if {item}: choose from even-stages, hop-bytes=SHARE (e.g. 0.5), and one of "
                                 f"in-step, shared-link")
        return cls(even, share, link)

    def describe(self) -> str:
        links = {"in-step": "a node's pipelines kept in step, a hop all of their sends",
                 "shared-link": "each node's link shared among its pipelines' transfers under way, the pipelines in "
                                "step"}
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

    def step(self, crossing: list, nodes: int, busbw: float, compute_s: float, shape, pipelines: int,
             stagger: bool | None):
        """The pipeline's step (meshtune.crossing.StepTime) over `crossing` (already `self.crossing`'s) with these
        levers, and whether a node's `pipelines` are staggered: the plan's pricing (shared_link.priced_pipeline, the
        stagger as the plan asks it: meshtune.plan.link.stagger_asked), crossing.pipeline_step, or
        shared_link.pipelines_step in step."""
        from meshtune.crossing import pipeline_step
        from meshtune.shared_link import pipelines_step, priced_pipeline

        shape = self.shape(shape)
        if self.link == "in-step":
            return pipeline_step(crossing, nodes, busbw, compute_s, shape), False
        if self.link == "shared-link":
            return pipelines_step(crossing, busbw, compute_s, shape, pipelines, stagger=False), False
        return priced_pipeline(crossing, nodes, busbw, compute_s, shape, pipelines, stagger)
