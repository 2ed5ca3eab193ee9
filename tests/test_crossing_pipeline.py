"""A pipeline's step from torch's own schedule (meshtune.crossing): each rank's actions as torch.distributed.pipelining
orders them, simulated with each stage's cost; the bubbles the closed forms give where they exist."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshtune.crossing import (Collective, ModelFacts, PipelineShape, StageCost, full_model_facts, pipeline_step,
                               schedule_actions, simulate, stage_costs, stage_ranks)
from plans import QWEN_7B

SHAPES = [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16), (8, 32)]  # (pp, micro-batches)


def timeline(schedule: str, pp: int, micro: int, virtual: int = 1, cost: StageCost = StageCost(1, 1, 1),
             hop_s: float = 0.0):
    actions = schedule_actions(schedule, pp, micro, virtual)
    return simulate(actions, [cost] * (pp * virtual), stage_ranks(schedule, pp, virtual), hop_s)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,micro", SHAPES)
def test_gpipe_and_1f1b_with_equal_stages_lose_the_closed_form_bubble(schedule, pp, micro):
    """(pp - 1) / (m + pp - 1) of the step: the last rank starts pp - 1 forwards late, the first ends pp - 1
    backwards late."""
    run = timeline(schedule, pp, micro)
    assert run.busiest_s == 3 * micro
    assert (run.finish_s - run.busiest_s) / run.finish_s == pytest.approx((pp - 1) / (micro + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,micro", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_1f1b_with_equal_stages_loses_the_closed_form_bubble(pp, micro):
    """v stages a process over whole rounds of pp micro-batches: (pp - 1) / (v m + pp - 1)."""
    for virtual in (2, 4):
        run = timeline("interleaved_1f1b", pp, micro, virtual)
        bubble = (run.finish_s - run.busiest_s) / run.finish_s
        assert bubble == pytest.approx((pp - 1) / (virtual * micro + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,micro", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_with_equal_passes_loses_only_the_first_forwards(pp, micro):
    """ZB-V with F = I = W and at least 2 pp micro-batches: the weight gradients fill the bubble, all but the pp - 1
    forwards the last rank waits for before its first (the V's first chunk through ranks 0 .. pp - 2): a bubble of
    (pp - 1) F, (pp - 1) / (6 m + pp - 1) of the step, against 1f1b's (pp - 1) / (m + pp - 1)."""
    run = timeline("zbv", pp, micro, 2)
    assert run.busiest_s == 2 * 3 * micro
    assert run.finish_s - run.busiest_s == pytest.approx(pp - 1)
    assert (run.finish_s - run.busiest_s) / run.finish_s == pytest.approx((pp - 1) / (6 * micro + pp - 1))
    # without weight gradients to fill it (LoRA: W = 0) the V loses more
    lora = timeline("zbv", pp, micro, 2, StageCost(1, 1, 0))
    assert (lora.finish_s - lora.busiest_s) / lora.finish_s > (pp - 1) / (6 * micro + pp - 1)


def test_a_hop_between_processes_delays_what_waits_on_it():
    """2 equal stages over 4 micro-batches, a hop half a pass: gpipe crosses it twice on its critical path (the
    first forward, the last backward); 1f1b, which lets rank 0 run ahead by one micro-batch only, waits for each of
    the last micro-batches' gradients too."""
    assert timeline("gpipe", 2, 4, hop_s=0.5).finish_s == pytest.approx(timeline("gpipe", 2, 4).finish_s + 2 * 0.5)
    assert timeline("1f1b", 2, 4, hop_s=0.5).finish_s == pytest.approx(timeline("1f1b", 2, 4).finish_s + 4 * 0.5)


@pytest.fixture
def fake_group():
    """torch's fake process group: the schedule classes built in this process, no peers."""
    def start(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_order(kind, pp: int, micro: int, held: list[int]) -> list[list[tuple[str, int, int]]]:
    """The `pipeline_order` torch's schedule class builds for rank 0's stages `held` of pp x len(held)."""
    stages = [PipelineStage(torch.nn.Linear(2, 2), s, pp * len(held), torch.device("cpu")) for s in held]
    made = kind(stages if len(held) > 1 else stages[0], n_microbatches=micro, loss_fn=lambda out, target: out.sum())
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index) for a in made.pipeline_order[rank]
             if a is not None and a.computation_type.value in "FBIW"] for rank in range(pp)]


@pytest.mark.parametrize("pp,micro", [(2, 4), (4, 8), (4, 6)])
def test_the_actions_simulated_are_those_of_torchs_schedule_classes(fake_group, pp, micro):
    """The multi-stage schedules' orders read from the function their classes build pipeline_order with; gpipe's
    the class's own; 1f1b's as its `_step_microbatches` runs (its printed pipeline_order numbers the last rank's
    forwards from 1, one past what the run computes)."""
    fake_group(pp)
    assert schedule_actions("interleaved_1f1b", pp, micro, 2) == torch_order(ScheduleInterleaved1F1B, pp, micro,
                                                                             [0, pp])
    assert schedule_actions("zbv", pp, micro, 2) == torch_order(ScheduleZBVZeroBubble, pp, micro, [0, 2 * pp - 1])
    assert schedule_actions("gpipe", pp, micro) == torch_order(ScheduleGPipe, pp, micro, [0])
    ours, theirs = schedule_actions("1f1b", pp, micro), torch_order(Schedule1F1B, pp, micro, [0])
    assert ours[:-1] == theirs[:-1]
    assert ours[-1] == [(k, s, i - 1 if k == "F" else i) for k, s, i in theirs[-1]]


def test_the_stages_cost_their_blocks_and_the_last_its_head():
    """Full 7B in 4 stages of 7 blocks: each F = I = W but attention's share (none in W, twice F's in I); the head
    on the last; LoRA's W none; recomputation one more forward in I."""
    facts = full_model_facts(QWEN_7B)
    stages = [(0, 7), (7, 14), (14, 21), (21, 28)]
    full = stage_costs(facts, stages, lora=False, recompute=0.0, length=576)
    assert full[0] == full[1] == full[2] and full[3].forward > full[0].forward
    block, attention = 2 * QWEN_7B.block_parameters * 576, 4 * facts.attention_width * 576 * 576
    assert full[0] == StageCost(7 * (block + attention), 7 * (block + 2 * attention), 7 * block)
    lora = stage_costs(facts, stages, lora=True, recompute=1.0, length=576)
    assert all(c.weight_grad == 0 for c in lora)
    assert lora[0].input_grad == pytest.approx(full[0].input_grad + full[0].forward)


def test_the_step_is_the_simulated_finish_and_the_link_its_floor():
    """Equal stages: the mean compute and the busiest's agree, so the exposed time is the bubble, and with sends
    the hops on the critical path (at least the fill's and the drain's, at most two a micro-batch); a link slower
    than the compute sets the step."""
    facts = ModelFacts(QWEN_7B, QWEN_7B.parameters, QWEN_7B.block_parameters * 28, 28, 3584, 3584)
    shape = PipelineShape("1f1b", 1, 8, stage_costs(facts, [(0, 14), (14, 28)], False, 0.0, 576))
    alone = pipeline_step([], 2, 1e12, 1.0, shape)
    assert alone.bubble_s == pytest.approx(1 / 8, rel=1e-9) and alone.exposed_s == pytest.approx(1 / 8, rel=1e-9)
    hop = 1e6 / 8 / 1e12  # one micro-batch's share of the sends
    quick = pipeline_step([Collective("send", "activations", 1e6, 1)], 2, 1e12, 1.0, shape)
    assert 1 / 8 + 2 * hop <= quick.exposed_s <= 1 / 8 + 2 * 8 * hop
    slow = pipeline_step([Collective("send", "activations", 1e9, 20)], 2, 1e9, 1.0, shape)  # 20 s on the link
    assert slow.step_s == pytest.approx(20.0) and slow.reduce_s == pytest.approx(20.0)


def test_staggered_pipelines_share_their_nodes_link_one_hop_at_a_time():
    """meshtune.shared_link's simulation of a node's pipelines: with one pipeline and free hops it is
    meshtune.crossing's; two pipelines in step (gpipe, 2 stages, 1 micro-batch; F 1, B 2, a hop 0.5 alone) share
    each link, so each transfer takes two hops: 2 F + 2 x 2 hops + 2 B = 8; started a hop apart they do not meet on
    a link: 0.5 + 2 F + 2 hops + 2 B = 7.5."""
    from meshtune.crossing import schedule_actions, simulate, stage_ranks
    from meshtune.shared_link import simulate_pipelines

    actions = schedule_actions("1f1b", 4, 8)
    costs = [StageCost(1.0, 1.0, 1.0)] * 3 + [StageCost(1.5, 1.5, 1.5)]
    alone = simulate(actions, costs, stage_ranks("1f1b", 4, 1), 0.0)
    assert simulate_pipelines(actions, costs, stage_ranks("1f1b", 4, 1), 0.0, 1, 0.0) == (alone.finish_s,
                                                                                         alone.busiest_s)
    gpipe = (schedule_actions("gpipe", 2, 1), [StageCost(1.0, 2.0, 0.0)] * 2, [0, 1], 0.5, 2)
    assert simulate_pipelines(*gpipe, 0.0) == pytest.approx((8.0, 3.0))
    assert simulate_pipelines(*gpipe, 0.5) == pytest.approx((7.5, 3.0))
    # zbv's V, 4 ranks, 8 pipelines of 16 micro-batches, a hop a quarter of a stage's forward: in step they wait for
    # each other on the links, started a hop apart less; every action runs either way
    v = schedule_actions("zbv", 4, 16, 2)
    v_costs, v_ranks = [StageCost(1.0, 1.0, 1.0)] * 8, stage_ranks("zbv", 4, 2)
    in_step = simulate_pipelines(v, v_costs, v_ranks, 0.25, 8, 0.0)[0]
    assert simulate_pipelines(v, v_costs, v_ranks, 0.25, 8, 0.25)[0] < in_step


def test_the_plan_staggers_a_node_s_pipelines_only_where_that_is_shorter_or_asked():
    """shared_link.priced_pipeline: a link far faster than the compute gains nothing from the stagger (in step); one
    whose hop is a fair share of a stage's compute gains; one pipeline a node, or stagger False, stays in step;
    stagger True is priced staggered even where that gains nothing."""
    from meshtune.shared_link import priced_pipeline

    shape = PipelineShape("1f1b", 1, 8, (StageCost(1.0, 2.0, 0.0),) * 2)
    sends = [Collective("send", "activations", 8 * 8 * 0.25e9, 1)]  # 8 pipelines' 8 micro-batches, 0.25 s each alone
    fast, staggered = priced_pipeline(sends, 2, 1e15, 1.0, shape, 8)
    assert not staggered
    slow_in_step, _ = priced_pipeline(sends, 2, 1e9, 24.0, shape, 8, stagger=False)
    slow, staggered = priced_pipeline(sends, 2, 1e9, 24.0, shape, 8)
    assert staggered and slow.step_s < slow_in_step.step_s
    assert priced_pipeline(sends, 2, 1e9, 24.0, shape, 1) == (slow_in_step, False)
    forced, staggered = priced_pipeline(sends, 2, 1e15, 1.0, shape, 8, stagger=True)
    assert staggered and forced.step_s == pytest.approx(fast.step_s, rel=1e-3)
