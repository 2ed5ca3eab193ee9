"""`parallel: auto` across nodes chosen by the link (`link_gbps`): full 7B on nodes of 8 GPUs, its plan resolved in
this process with CUDA as the plan sees it (80 GiB cards, a measured bf16 matmul rate) and no GPU."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from unittest import mock

import pytest
import torch

from meshtune.config import TrainConfig, build_config
from meshtune.crossing import Collective, ModelSize, compute_seconds, data_parallel_step, full_model_facts
from meshtune.errors import ConfigError
from meshtune.hardware import slowest_peak_flops
from meshtune.plan import LinkChoice, link_candidates, resolve
from plans import QWEN_7B, env, plan_for

PEAK = 8e14  # FLOP/s: about what an H100's bf16 matmul measures
BATCH = {"finetuning_type": "full", "per_device_train_batch_size": 4, "cutoff_len": 576}  # 64 sequences on 2 x 8


def config(**values) -> TrainConfig:
    return build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **BATCH, **values})


def gpu_plan(values: dict, nodes: int = 2, per_node: int = 8, size: ModelSize = QWEN_7B, rank: int = 0):
    with mock.patch("meshtune.plan.smallest_gpu_memory", return_value=80 * 2**30), \
         mock.patch("meshtune.plan.slowest_peak_flops", return_value=PEAK), \
         mock.patch("meshtune.plan.bf16_supported", return_value=True):
        return resolve(config(**values), env(nodes * per_node, per_node, rank, "cuda"), None, lambda: size)


def predicted(values: dict, nodes: int = 2, per_node: int = 8) -> dict[LinkChoice, float]:
    """Each mode's predicted per-GPU efficiency, as the plan computes it."""
    cfg = config(**values)
    compute = compute_seconds(cfg, full_model_facts(QWEN_7B), PEAK)
    steps = link_candidates(cfg, nodes * per_node, per_node, QWEN_7B, 80 * 2**30, compute)
    return {choice: step.efficiency for choice, step in steps.items()}


def test_a_fast_link_keeps_the_choice_auto_makes_without_it():
    """8 x 400 Gb/s a node, a micro-step's rows one micro-batch: the gradients' all-reduce hides behind backward, so
    hsdp stays (zero2's share of the bytes is about the same; it replaces the rule only where it is 2% faster). With
    the rows one by one, zbv's V over 16 one-row micro-batches, each process's stages balanced to within 1.1% of the
    mean, leaves a bubble under 1% of the step: predicted more than 2% faster than hsdp, it is chosen there too."""
    without = gpu_plan({"pipeline_row_micro_batches": False})
    fast = gpu_plan({"link_gbps": 3200, "pipeline_row_micro_batches": False})
    assert (fast.parallel, fast.mesh, fast.gradient_accumulation_steps) == (without.parallel, without.mesh, 1)
    assert fast.parallel == "hsdp" and fast.pipeline_parallel == 1
    rows = predicted({"link_gbps": 3200})
    assert rows[LinkChoice("zero2", 2, "zbv", True)] > 1.02 * rows[LinkChoice("hsdp", 1)]
    by_rows = gpu_plan({"link_gbps": 3200})
    assert (by_rows.pipeline_parallel, by_rows.pipeline_schedule, by_rows.pipeline_one_row) == (2, "zbv", True)
    assert re.search(r"auto by the link \(3200 Gb/s\): hsdp, predicted at 9\d\.\d% per GPU", fast.why["parallel"])
    assert "without the link: full fine-tuning on 2 nodes x 8 GPUs: hsdp shards" in fast.why["parallel"]


def test_a_slow_link_puts_a_pipeline_stage_on_each_node_and_keeps_the_global_batch():
    """100 Gb/s: hsdp's 30 GB of fp32 gradients a node take about 3 s against a 0.3 s step; the pipeline sends 0.26 GB
    of activations and loses its bubble. Of the pipelines weighed, zbv over the step's 8 rows one by one loses the
    least (its weight gradients fill the bubble); 1f1b over 2 micro-batches of 4 rows (2 - 1) / (2 + 2 - 1)."""
    efficiency = predicted({"link_gbps": 100})
    pipeline = LinkChoice("zero2", 2, "zbv", True)
    assert max(efficiency, key=efficiency.get) == pipeline
    assert efficiency[LinkChoice("zero2", 2, "1f1b", False)] < 2 / 3 < efficiency[pipeline]
    assert efficiency[LinkChoice("hsdp", 1)] < 0.2
    assert {(c.schedule, c.one_row) for c in efficiency if c.pipeline > 1} == {
        (schedule, one_row) for schedule in ("1f1b", "interleaved_1f1b", "zbv") for one_row in (False, True)}
    plan = gpu_plan({"link_gbps": 100})
    assert f"predicted at {efficiency[pipeline]:.1%} per GPU" in plan.why["parallel"]
    assert ("pipeline_parallel 2 (zero2 inside each stage, zbv, micro-batches of one row, a node's pipelines started "
            "a hop apart)") in plan.why["parallel"]
    assert re.search(r"pipeline_parallel 2 \(zero2 inside each stage, 1f1b(, a node's pipelines started a hop "
                     r"apart)?\) \d+\.\d% \(0\.\d+ s\)", plan.why["parallel"])
    assert "hsdp 1" in plan.why["link_gbps"] and "zero3" in plan.why["link_gbps"]
    assert plan.pipeline_one_row and plan.pipeline_schedule == "zbv" and plan.pipeline_virtual_stages == 2
    assert plan.why["pipeline_schedule"].startswith("auto by the link: zbv over 8 micro-batches of one row")
    # the plan of the same job written with pipeline_parallel: 2, zbv, its rows one by one and the accumulation that
    # keeps 64 sequences a step
    # (tests/test_pipeline_parallel.py trains such a plan on CPU: the losses of one process)
    written = gpu_plan({"pipeline_parallel": 2, "gradient_accumulation_steps": 2, "parallel": "zero2",
                        "pipeline_schedule": "zbv", "pipeline_row_micro_batches": True})
    for key in ("parallel", "mesh", "pipeline_stages", "pipeline_schedule", "pipeline_virtual_stages",
                "pipeline_one_row", "gradient_accumulation_steps", "reshard_after_forward", "padding_free",
                "fused_loss", "compile", "weights_from_rank0"):
        assert getattr(plan, key) == getattr(written, key), key
    assert plan.mesh == {"pp": 2, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}
    data = plan.data_env(env(16, 8, 13, "cuda"))  # rank 13: stage 1, the 6th of its node: data rank 5 of 8
    assert (data.rank, data.world_size) == (5, 8)
    assert 4 * plan.gradient_accumulation_steps * data.world_size == 64
    assert "global batch stays 64" in plan.why["gradient_accumulation_steps"]
    assert json.loads(json.dumps(plan.why))["parallel"] == plan.why["parallel"]  # run_plan.json keeps it
    assert re.search(r"link_gbps +chose  \(predicted per GPU: hsdp 1\d\.\d%", plan.describe())


def test_the_pipeline_is_judged_with_the_schedule_the_config_names():
    """A schedule the config names stands: only it is weighed (with the step's rows one by one as well, unless
    pipeline_row_micro_batches names the split).
    interleaved_1f1b holds two stages a process: a bubble half as long, one more crossing of the activations a
    micro-batch; the slow link's pipeline is then predicted faster than under 1f1b."""
    named = predicted({"link_gbps": 100, "pipeline_schedule": "interleaved_1f1b"})
    assert {c for c in named if c.pipeline > 1} == {LinkChoice("zero2", 2, "interleaved_1f1b", False),
                                                    LinkChoice("zero2", 2, "interleaved_1f1b", True)}
    one = predicted({"link_gbps": 100})[LinkChoice("zero2", 2, "1f1b", False)]
    assert named[LinkChoice("zero2", 2, "interleaved_1f1b", False)] > one
    plan = gpu_plan({"link_gbps": 100, "pipeline_schedule": "interleaved_1f1b"})
    assert plan.pipeline_schedule == "interleaved_1f1b" and plan.pipeline_one_row
    assert plan.why["pipeline_schedule"].startswith("auto by the link: interleaved_1f1b over 8 micro-batches of one")
    # and so does a split the config names
    whole = predicted({"link_gbps": 100, "pipeline_row_micro_batches": False})
    assert {(c.schedule, c.one_row) for c in whole if c.pipeline > 1} == {
        ("1f1b", False), ("interleaved_1f1b", False), ("zbv", False)}
    named = gpu_plan({"link_gbps": 100, "pipeline_row_micro_batches": False, "pipeline_schedule": "zbv"})
    assert not named.pipeline_one_row and "pipeline_schedule" not in named.why


def test_where_the_pipeline_cannot_run_the_slow_link_picks_the_data_parallel_mode_the_arithmetic_says():
    """packing cannot cross stages, and a model of 27 blocks does not split into 2: of hsdp, zero2 and zero3, hsdp
    sends the fewest bytes (one all-reduce between the 2 replicas) and is picked, with why not the pipeline."""
    efficiency = predicted({"link_gbps": 100, "packing": True})
    assert set(efficiency) == {LinkChoice("hsdp", 1), LinkChoice("zero2", 1), LinkChoice("zero3", 1)}
    assert max(efficiency, key=efficiency.get) == LinkChoice("hsdp", 1)
    plan = gpu_plan({"link_gbps": 100, "packing": True})
    assert plan.parallel == "hsdp" and plan.pipeline_parallel == 1
    assert plan.why["link_gbps"].endswith("; no pipeline across the nodes: pipeline_parallel: 2 cannot be combined "
                                          "with packing: true (packed rows' block-diagonal attention is not carried "
                                          "between the stages): drop packing")
    tied = gpu_plan({"link_gbps": 100}, size=replace(QWEN_7B, tied_embeddings=True))
    assert tied.pipeline_parallel == 1 and "a tied head) does not split into 2 stages" in tied.why["link_gbps"]


def test_blocks_the_stages_do_not_divide_are_priced_as_the_run_splits_them():
    """27 blocks over 2 nodes: the stages the run builds (balanced with the head on the last) are unequal, and the
    simulation prices them; the pipeline is chosen and planned with those stages."""
    odd = replace(QWEN_7B, blocks=27)
    plan = gpu_plan({"link_gbps": 100}, size=odd)
    assert plan.pipeline_parallel == 2 and plan.pipeline_schedule == "zbv"
    held = [end - first for first, end in plan.pipeline_stages]
    assert sum(held) == 27 and len(set(held)) > 1


def test_one_node_cpu_lora_and_an_unset_link_keep_the_rules():
    assert gpu_plan({"link_gbps": 10}, nodes=1).parallel == gpu_plan({}, nodes=1).parallel == "zero2"
    assert "link_gbps" not in gpu_plan({"link_gbps": 10}, nodes=1).why
    lora = gpu_plan({"link_gbps": 10, "finetuning_type": "lora"})
    assert lora.parallel == "ddp" and "not used" in lora.why["link_gbps"]
    cpu = resolve(config(link_gbps=10), env(4, 2), None, lambda: QWEN_7B)
    assert cpu.parallel == "ddp" and "not used: no mode holds the model's state" in cpu.why["link_gbps"]
    named = gpu_plan({"link_gbps": 10, "parallel": "hsdp"})
    assert named.parallel == "hsdp" and "link_gbps" not in named.why


def test_link_gbps_is_checked_and_changes_no_math():
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"link_gbps=.*greater than 0"):
            config(link_gbps=bad)
    assert config(link_gbps=100).hash() == config().hash()
    assert "link_gbps" in TrainConfig.keys_of("job")


def test_a_data_parallel_step_hides_its_gradients_behind_backward():
    """The gradients cross behind backward but the last unit's share (a pipeline's step: test_crossing_pipeline.py)."""
    # a data-parallel step: the gradients' all-reduce (2 replicas: S a node) behind backward but the last unit's share
    grads = [Collective("all-reduce", "gradients", 2e9, 1, 2)]
    hidden = data_parallel_step(grads, 2, 10e9, 1.0, 1, 4)  # 0.2 s, inside the 2/3 s backward
    assert hidden.reduce_s == pytest.approx(0.2) and hidden.exposed_s == pytest.approx(0.05)
    assert data_parallel_step(grads, 2, 1e9, 1.0, 1, 4).exposed_s == pytest.approx(2 - 2 / 3)


def test_the_doctor_judges_the_mode_the_plan_picks_by_the_link():
    """`meshtune doctor --bandwidth` with link_gbps: the plan's choice from the nodes' facts, the pipeline's
    activations as what crosses (8 pipelines a node, 2 micro-batches of 4 x 576 tokens, hidden 3,584, bf16)."""
    from meshtune.crossing import ModelFacts
    from meshtune.doctor.traffic import verdict

    model = ModelFacts(QWEN_7B, QWEN_7B.parameters, 6_500_000_000, 28, 3584, 3584)
    judged = verdict(config(link_gbps=100), 2, 8, True, 80 * 2**30, 11.25e9, PEAK, model)
    assert judged["parallel"] == gpu_plan({"link_gbps": 100}).parallel == "zero2"
    assert "under zero2 inside pipeline_parallel 2 (auto by link_gbps 100)" in judged["text"]
    assert [c["kind"] for c in judged["collectives"]] == ["send"]
    assert judged["collectives"][0]["bytes"] == pytest.approx(8 * 4 * 2 * 576 * 3584 * 2)
    fast = verdict(config(link_gbps=3200, pipeline_row_micro_batches=False), 2, 8, True, 80 * 2**30, 11.25e9, PEAK,
                   model)
    assert fast["parallel"] == "hsdp" and [c["kind"] for c in fast["collectives"]] == ["all-reduce"]


# the shaped link's model (bench/workspace.py 512x8): hidden 512, 8 blocks, intermediate 1,536, vocabulary 1,000
SMALL = ModelSize(25_156_096, 3_016_448, 8, attention_heads=8, kv_heads=2, model_type="qwen2", hidden=512,
                  head_parameters=1_000 * 512)
CPU_RATE = 2e10  # FLOP/s: an fp32 process on a shared core
CPU_BATCH = {"finetuning_type": "full", "per_device_train_batch_size": 2, "cutoff_len": 192}


def cpu_plan(values: dict, nodes: int = 2, per_node: int = 2):
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **CPU_BATCH, **values})
    with mock.patch("meshtune.plan.slowest_peak_flops", return_value=CPU_RATE) as rate:
        plan = resolve(cfg, env(nodes * per_node, per_node), None, lambda: SMALL)
    return plan, rate.call_count


def test_on_cpu_a_slow_link_puts_a_stage_on_each_node_and_a_fast_one_keeps_ddp():
    """CPU nodes (gloo): auto's CPU mode, ddp, against a pipeline stage a node with ddp inside; nothing hidden
    behind the compute (gloo computes its collectives on the cores that train), the activations in fp32. At 0.1 Gb/s
    ddp's 151 MB of gradients a node take 13 s against a step of 7.6 s: a stage a node. At 100 Gb/s they
    take 0.013 s and a pipeline's bubble costs more: ddp stays, as without the link."""
    slow, measured = cpu_plan({"link_gbps": 0.1})
    assert measured == 1  # the processes' fp32 matmul rate, measured once
    assert slow.pipeline_parallel == 2 and slow.parallel == "ddp" and slow.mesh["pp"] == 2
    assert re.search(r"auto by the link \(0\.1 Gb/s\): pipeline_parallel 2 \(ddp inside each stage, \w+", slow.why[
        "parallel"])
    assert "hsdp" not in slow.why["link_gbps"] and "zero" not in slow.why["link_gbps"]  # gloo shards no faster
    fast, _ = cpu_plan({"link_gbps": 100})
    assert (fast.parallel, fast.pipeline_parallel) == ("ddp", 1)
    assert "auto by the link (100 Gb/s): ddp, predicted at" in fast.why["parallel"]
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **CPU_BATCH, "link_gbps": 0.1})
    compute = compute_seconds(cfg, full_model_facts(SMALL), CPU_RATE, gpus=False)
    steps = link_candidates(cfg, 4, 2, SMALL, 8 * 2**30, compute, gpus=False)
    ddp = steps[LinkChoice("ddp", 1)]
    assert ddp.exposed_s == pytest.approx(ddp.reduce_s) and ddp.reduce_s == pytest.approx(
        1.5 * SMALL.parameters * 4 / (0.1e9 / 8 * 0.9), rel=0.01)  # a ring of 4 over 2 nodes, fp32, none hidden
    assert {c.mode for c in steps} == {"ddp"}


def test_on_cpu_the_doctor_judges_the_mode_the_plan_picks_by_the_link():
    """`meshtune doctor --bandwidth` on CPU nodes with link_gbps: the mode and stages the plan picks from a process's
    fp32 rate, the pipeline's activations as what crosses; no step time is judged on CPU."""
    from meshtune.crossing import ModelFacts
    from meshtune.doctor.traffic import verdict

    model = ModelFacts(SMALL, SMALL.parameters, SMALL.parameters, 8, 512, 512)
    for gbps in (0.1, 100):
        cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", **CPU_BATCH, "link_gbps": gbps})
        plan, _ = cpu_plan({"link_gbps": gbps})
        judged = verdict(cfg, 2, 2, False, None, gbps / 8 * 1e9 * 0.9, CPU_RATE, model)
        assert judged["parallel"] == plan.parallel == "ddp" and judged["ratio"] is None
        stages = f"inside pipeline_parallel {plan.pipeline_parallel} " if plan.pipeline_parallel > 1 else ""
        assert f"under ddp {stages}(auto by link_gbps {gbps:g})" in judged["text"], judged["text"]
        assert [c["kind"] for c in judged["collectives"]] == (["send"] if stages else ["all-reduce"])
    assert cpu_plan({"link_gbps": 0.1})[0].pipeline_parallel == 2  # the slow link's choice is the pipeline
    unmeasured = verdict(cfg, 2, 2, False, None, 1e8, None, model)  # no rate: the rules' mode, as before
    assert "auto by link_gbps" not in unmeasured["text"]


def test_the_doctor_measures_a_cpu_process_rate_on_its_share_of_the_cores():
    from meshtune.hardware import cpu_flops_a_process

    threads = torch.get_num_threads()
    assert 1e8 < cpu_flops_a_process(2) < 1e13 and torch.get_num_threads() == threads


def test_on_cpu_a_model_no_process_can_hold_keeps_the_rule():
    cpu = resolve(config(link_gbps=0.1), env(4, 2), None, lambda: QWEN_7B)  # 7B's state: over half of this host
    assert (cpu.parallel, cpu.pipeline_parallel) == ("ddp", 1)
    assert "not used: no mode holds the model's state in half of a process's" in cpu.why["link_gbps"]


def test_the_cpu_matmul_rate_the_plan_reads_is_measured():
    rate = slowest_peak_flops(torch.device("cpu"))
    assert 1e8 < rate < 1e13


def test_a_node_s_pipelines_start_a_hop_apart_where_the_plan_predicts_that_shorter():
    """Full 7B, a stage a node, 8 pipelines a node (zero2 inside each stage) on 100 Gb/s: in step each hop carries
    the node's 8 pipelines' activations at once and the next stage waits for all of them; started a hop apart each
    crosses alone while the others compute. At 4 nodes that lifts zbv over one-row micro-batches from below 85% to
    near 90% per GPU (docs/benchmarks/projection.md gives the projection at the measured one-GPU rate)."""
    for nodes, least in ((2, 0.95), (4, 0.89)):
        efficiency = predicted({"link_gbps": 100}, nodes=nodes)
        best = max(efficiency, key=efficiency.get)
        assert (best.schedule, best.one_row, best.stagger) == ("zbv", True, True) and efficiency[best] > least
        in_step = predicted({"link_gbps": 100, "pipeline_stagger": False}, nodes=nodes)
        assert not any(choice.stagger for choice in in_step) and in_step[best] < efficiency[best]
    plan = gpu_plan({"link_gbps": 100}, nodes=4)
    assert plan.pipeline_stagger_rate == pytest.approx(100 / 8 * 1e9 * 0.9)
    assert re.match(r"on: the node's 8 pipelines start a hop apart \(a hop 0\.367 ms: one pipeline's micro-batch "
                    r"alone on the 100 Gb/s link at 576 tokens a row; the run times it by each step's own rows\), "
                    r"predicted step 0\.3\d+ s against 0\.3\d+ s in step", plan.why["pipeline_stagger"])
    assert re.search(r"pipeline_stagger +on", plan.describe())
    # each process waits its pipeline's place among the node's: rank 13 is data rank 5 of stage 1's 8
    from meshtune.train.pipeline_step import Stagger

    stagger = Stagger.of(plan, plan.data_env(env(32, 8, 13, "cuda")), 3584)
    assert (stagger.turn, stagger.pipelines, stagger.token_bytes) == (5, 8, 3584 * 2)
    assert stagger.seconds(1, 576) == pytest.approx(5 * 576 * 3584 * 2 / plan.pipeline_stagger_rate)
    assert Stagger.of(gpu_plan({"link_gbps": 100, "pipeline_stagger": False}, nodes=4), None, 3584) is None


def test_where_the_pipelines_cannot_be_staggered_the_plan_says_why_and_a_key_that_asks_is_refused():
    """zero3 inside the stages gathers weights at every micro-batch's forward (collectives that keep the pipelines
    in step), and without link_gbps a hop cannot be timed: pipeline_stagger: true is refused there naming what to
    set; auto keeps them in step and says why, as it does on CPU nodes. One node, or one pipeline a node, has nothing
    to stagger."""
    pipeline = {"pipeline_parallel": 2, "gradient_accumulation_steps": 2, "pipeline_schedule": "zbv"}
    zero3 = gpu_plan({**pipeline, "parallel": "zero3", "link_gbps": 100})
    assert zero3.pipeline_stagger_rate == 0 and zero3.why["pipeline_stagger"].startswith("off: zero3 gathers")
    with pytest.raises(ConfigError, match=r"pipeline_stagger: true: zero3 gathers each stage's weights .* or set "
                                          r"pipeline_stagger: auto"):
        gpu_plan({**pipeline, "parallel": "zero3", "link_gbps": 100, "pipeline_stagger": True})
    with pytest.raises(ConfigError, match=r"pipeline_stagger: true: the link's rate, which times a hop, is unknown: "
                                          r"set link_gbps"):
        gpu_plan({**pipeline, "parallel": "zero2", "pipeline_stagger": True})
    named = gpu_plan({**pipeline, "parallel": "zero2", "link_gbps": 100})  # a pipeline the config names, priced too
    assert named.pipeline_stagger_rate > 0 and named.why["pipeline_stagger"].startswith("on: the node's 8 pipelines")
    one_node = gpu_plan({**pipeline, "parallel": "zero2", "link_gbps": 100}, nodes=1)
    assert one_node.why["pipeline_stagger"] == "off: one node: no stage boundary crosses a link"
    alone = gpu_plan({**pipeline, "parallel": "zero2", "link_gbps": 100, "pipeline_stagger": True}, per_node=1)
    assert alone.why["pipeline_stagger"].startswith("not used: a node holds one pipeline")
    assert plan_for({"pipeline_stagger": False}).why["pipeline_stagger"].startswith("not used: the run has no pipeline")
    # CPU nodes: gloo's sends share the cores that compute; staggering measured no faster there, so auto keeps step
    cpu = plan_for({**pipeline, "parallel": "ddp", "link_gbps": 0.05, "finetuning_type": "full"}, 4, 2)
    assert cpu.pipeline_stagger_rate == 0 and cpu.why["pipeline_stagger"].startswith("off: on CPU nodes gloo's sends")
