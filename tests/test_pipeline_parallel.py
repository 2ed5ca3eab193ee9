"""Pipeline parallelism: the run plan's mesh, schedule and stages balanced by cost, and its refusals (no processes), a
stage's blocks and names and a zbv process's two stages (one process), and on gloo ranks the losses and gradient
norms of one process, full and LoRA, under pp 2 (GPipe, 1F1B, Interleaved1F1B, ZBV) and pp 2 x dp 2; a pp 2
checkpoint resumed on one process and under zero2 on 4, one process's on pp 2, and final/ the whole model."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_config, read_metrics, sentence, write_config
from meshtune.demo.model import build_tiny_model
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.plan import ModelSize, resolve
from plans import QWEN_7B, env, plan_for
from ranks import train_on_ranks


def plan_of(world_size: int = 4, local: int | None = None, size: ModelSize = QWEN_7B, **values):
    return plan_for({"pipeline_parallel": 2, **values}, world_size, local, size)


def test_the_stages_are_outermost_so_a_node_holds_a_stage_and_the_plan_names_them(tmp_path):
    """2 nodes of 2: stage 0 is node 0's ranks, stage 1 node 1's; ranks 1 and 3 share their data."""
    plan = plan_of(4, 2, finetuning_type="full", gradient_accumulation_steps=4)
    assert plan.mesh == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert plan.parallel == "ddp" and plan.grad_sync == "flat" and not plan.weights_from_rank0
    # the head (152,064 x 3,584) costs 2.34 blocks: 15 blocks, then 13 and the head
    assert plan.pipeline_stages == [(0, 15), (15, 28)] and plan.pipeline_schedule == "1f1b"
    for rank, data_rank in ((0, 0), (1, 1), (2, 0), (3, 1)):
        data = plan.data_env(env(4, 2, rank))
        assert (data.rank, data.world_size) == (data_rank, 2), rank
    assert not (plan.fused_loss or plan.padding_free or plan.compile)
    assert "logits the schedule" in plan.why["fused_loss"] and "auto: 1f1b" in plan.why["pipeline_schedule"]
    described = plan.describe()
    assert "pipeline_stages              blocks 0-14, blocks 15-27" in described
    assert "device_mesh                  pp 2 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1" in described
    plan.write(tmp_path / "run_plan.json")
    written = json.loads((tmp_path / "run_plan.json").read_text())
    assert list(written["mesh"])[0] == "pp" and written["pipeline_stages"] == [[0, 15], [15, 28]]
    assert "costs 2.34 blocks" in written["why"]["pipeline_stages"]
    assert written["pipeline_schedule"] == "1f1b"
    # fewer micro-batches than stages: GPipe, which runs any number
    assert plan_of(4, 2, gradient_accumulation_steps=1).pipeline_schedule == "gpipe"
    assert plan_of(4, 2, gradient_accumulation_steps=4, pipeline_schedule="gpipe").pipeline_schedule == "gpipe"


@pytest.mark.parametrize("blocks, stages, head, empty_ends, split", [
    (8, 4, 0.0, False, [2, 2, 2, 2]),        # equal shares where they divide and the head is not known
    (28, 2, 2.34, False, [15, 13]),          # Qwen2.5-7B: the head's 2.34 blocks beside 13
    (28, 4, 2.34, False, [7, 8, 8, 5]),      # slowest 8 blocks' work, not 7 + 2.34 with 7 each
    (27, 2, 0.0, False, [13, 14]),           # blocks the stages do not divide
    (28, 8, 2.34, True, [3, 4, 4, 4, 4, 4, 4, 1]),
    (2, 2, 1.1, False, [1, 1]),              # one stage a process: each holds a block
    (2, 4, 1.1, True, [0, 1, 1, 0]),         # several a process: the embedding alone, the head alone
])
def test_the_stages_split_the_blocks_by_cost_the_head_counted(blocks, stages, head, empty_ends, split):
    from meshtune.plan import balanced_stages

    bounds = balanced_stages(blocks, stages, head, empty_ends)
    assert [end - first for first, end in bounds] == split
    assert bounds[0][0] == 0 and bounds[-1][1] == blocks and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_1f1b"])
@pytest.mark.parametrize("pp, stage_balanced", [(2, [7, 8, 8, 5]), (4, [3, 4, 4, 4, 4, 4, 4, 1])])
@pytest.mark.parametrize("empty_ends", [False, True])
def test_two_stages_a_process_balance_the_processes_as_torch_places_the_stages(schedule, pp, stage_balanced,
                                                                                empty_ends):
    """Qwen2.5-7B's 28 blocks and 2.34 blocks' head in 2 stages a process: torch's placement (the loop of
    PipelineScheduleMulti, zbv's V), the one the model builds by; the busiest process no heavier than under the split
    that balances the stages alone (`stage_balanced`), less than a block over the mean (blocks are whole: 1.1% on 2
    processes, 5.5% on 4), and torch's schedule simulated over it no slower."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from meshtune.crossing import PipelineShape, full_model_facts, pipeline_step, stage_costs, stage_ranks
    from meshtune.model.pipeline_parallel import held_stages
    from meshtune.plan import balanced_stages, head_worth

    ranks = stage_ranks(schedule, pp, 2)
    style = "v" if schedule == "zbv" else "loop"
    assert generate_stage_to_rank_mapping(pp, 2 * pp, style) == dict(enumerate(ranks))
    assert all(held_stages(r, pp, 2, schedule) == [s for s in range(2 * pp) if ranks[s] == r] for r in range(pp))
    head = head_worth(QWEN_7B)
    bounds = balanced_stages(28, 2 * pp, head, empty_ends, ranks)
    assert bounds[0][0] == 0 and bounds[-1][1] == 28 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(end > first for first, end in bounds[1:-1])
    old, start = [], 0
    for held in stage_balanced:
        old, start = old + [(start, start + held)], start + held

    def busiest(split: list[tuple[int, int]]) -> float:
        loads = [0.0] * pp
        for stage, (first, end) in enumerate(split):
            loads[ranks[stage]] += end - first + (head if stage == 2 * pp - 1 else 0.0)
        return max(loads)

    mean = (28 + head) / pp
    assert busiest(bounds) <= busiest(old) and busiest(bounds) < mean + 1
    assert busiest(bounds) <= {2: 1.012, 4: 1.055}[pp] * mean
    if schedule == "zbv" and pp == 2:  # rank 0 held 7 + 5 blocks and the head, rank 1 8 + 8
        assert busiest(old) > 1.05 * mean and busiest(bounds) < busiest(old)
    facts = full_model_facts(QWEN_7B)
    for micro in (2 * pp, 4 * pp, 16 * pp):
        steps = [pipeline_step([], pp, 1e9, 1.0, PipelineShape(schedule, 2, micro, stage_costs(facts, split, False,
                                                                                               0.0, 576))).step_s
                 for split in (bounds, old)]
        assert steps[0] <= steps[1] + 1e-12, (micro, steps)


def test_the_plan_says_each_process_s_share_where_it_holds_two_stages():
    """zbv on 2 nodes: rank 0 holds stages 0 and 3 (8 + 5 blocks and the head), rank 1 stages 1 and 2 (7 + 8)."""
    zbv = plan_of(4, 2, gradient_accumulation_steps=4, pipeline_schedule="zbv")
    assert zbv.pipeline_stages == [(0, 8), (8, 15), (15, 23), (23, 28)]
    why = zbv.why["pipeline_stages"]
    assert why.startswith("8, 7, 8, 5 of the 28 blocks in the 4 stages (rank r holding stages r and 3 - r): the "
                          "busiest process as light as it can be")
    assert "each process's share of the cost: rank 0 50.6%, rank 1 49.4%" in why


def test_a_model_whose_blocks_the_stages_do_not_divide_is_split_by_cost_and_the_plan_says_why():
    """27 blocks of a 7B shape on 2 stages: 15, then 12 and the head; the head's worth named in run_plan.json."""
    size = ModelSize(7_000_000_000, 233_057_792, 27, 28, 4, "qwen2", head_parameters=152_064 * 3_584)
    plan = plan_of(4, 2, size=size, gradient_accumulation_steps=4)
    assert plan.pipeline_stages == [(0, 15), (15, 27)]
    assert plan.why["pipeline_stages"].startswith("15, 12 of the 27 blocks in the 2 stages (a stage a process)")
    assert "the head (vocabulary x hidden) costs 2.34 blocks' FLOPs" in plan.why["pipeline_stages"]
    interleaved = plan_of(4, 2, size=size, gradient_accumulation_steps=4, pipeline_schedule="interleaved_1f1b")
    assert interleaved.pipeline_virtual_stages == 2 and len(interleaved.pipeline_stages) == 4
    assert "rank r holding stages r, r + 2, ..." in interleaved.why["pipeline_stages"]
    zbv = plan_of(4, 2, size=size, gradient_accumulation_steps=1, pipeline_schedule="zbv")
    assert zbv.pipeline_schedule == "zbv" and "rank r holding stages r and 3 - r" in zbv.why["pipeline_stages"]
    assert "pipeline_virtual_stages      2" in zbv.describe()


def test_without_pipeline_parallel_the_plan_has_no_stages():
    cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl"})
    plan = resolve(cfg, env(4), None, lambda: QWEN_7B)
    assert "pp" not in plan.mesh and plan.pipeline_schedule is None and plan.pipeline_stages == []
    assert plan.pipeline_parallel == 1 and "pipeline" not in plan.describe()


@pytest.mark.parametrize("world_size, size, values, message", [
    (3, QWEN_7B, {}, "2 does not divide the job's 3 processes; counts that work here: 1, 3"),
    (4, ModelSize(10, 1, 3, 4, 4, "qwen2"), {"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 4},
     "8 stages need at least 6 blocks .* the model has 3; counts that work here: 1$"),
    (4, ModelSize(10, 1, 1, 4, 4, "qwen2"), {}, "2 stages need at least 2 blocks \\(a block a stage\\), and the "
     "model has 1; counts that work here: 1$"),
    (4, ModelSize(10, 1, 2, 4, 4, "gemma"), {}, "not model_type gemma"),
    (4, ModelSize(10, 1, 2, 4, 4, "qwen2", tied_embeddings=True), {}, "tie_word_embeddings"),
    (4, QWEN_7B, {"pipeline_schedule": "1f1b", "gradient_accumulation_steps": 1},
     "1f1b needs at least pipeline_parallel \\(2\\) micro-batches .* gradient_accumulation_steps to 2"),
    (4, QWEN_7B, {"pipeline_schedule": "interleaved_1f1b", "gradient_accumulation_steps": 5},
     "interleaved_1f1b .* the step's 5 .* are not; counts that work on 2 stages: 1, 2, 3, 4, 6, 8$"),
    (4, ModelSize(10, 1, 2, 4, 4, "qwen2"), {"pipeline_schedule": "zbv", "finetuning_type": "full",
                                            "parallel": "zero3"},
     "4 stages need at least 4 blocks .* several a process under ddp, .* the model has 2; counts that work here: 1$"),
])
def test_layouts_the_pipeline_cannot_split_are_refused_naming_what_works(world_size, size, values, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(world_size, size=size, **values)


@pytest.mark.parametrize("values, message", [
    ({"tensor_parallel": 2}, "tensor_parallel or context_parallel above 1"),
    ({"context_parallel": 2}, "tensor_parallel or context_parallel above 1"),
    ({"stage": "dpo"}, "stage: dpo"),
    ({"stage": "kto"}, "stage: kto"),
    ({"packing": True}, "packing: true"),
    ({"padding_free": True}, "padding_free: true"),
    ({"fp16": True}, "fp16: true"),
    ({"powersgd_rank": 2}, "powersgd_rank"),
    ({"finetuning_type": "full", "parallel": "hsdp"}, "parallel: hsdp: a stage's processes are its replicas"),
    ({"finetuning_type": "full", "parallel": "zero3", "cpu_offload": True}, "cpu_offload: a stage's processes"),
    ({"pipeline_schedule": "zbv", "pipeline_virtual_stages": 3}, "pipeline_virtual_stages: 3 under "
     "pipeline_schedule: zbv, whose V holds 2"),
    ({"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 1}, "pipeline_virtual_stages: 1 under "
     "pipeline_schedule: interleaved_1f1b"),
    ({"pipeline_schedule": "1f1b", "pipeline_virtual_stages": 2}, "pipeline_virtual_stages: 2 with "
     "pipeline_schedule: 1f1b, which runs one stage a process"),
])
def test_what_the_pipeline_does_not_combine_with_is_refused_before_any_process(values, message):
    with pytest.raises(ConfigError, match=f"(pipeline_parallel: 2 (cannot be combined )?with )?{message}"):
        build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "pipeline_parallel": 2, **values})


def test_micro_batches_are_stacked_to_a_shape_at_least_their_own_with_rows_that_train_nothing():
    """A stage's FSDP2 processes pad their micro-batches to the largest shape among them: here 3 rows of 70, the
    first micro-batch's second and third rows copies of its first with every target ignored, the length past 64
    padded to the shape given."""
    from meshtune.data.collate import IGNORE, Batch
    from meshtune.train.pipeline_step import stack, stacked_shape

    def batch(rows: int, length: int) -> Batch:
        ids = torch.arange(rows * length).view(rows, length) + 1
        return Batch(ids, ids.clone(), torch.arange(length).repeat(rows, 1), torch.ones(rows, length, dtype=torch.long),
                     rows * length)

    micro = [batch(1, 5), batch(2, 7)]
    assert stacked_shape(micro, length_cap=512) == (2, 64)
    stacked = stack(micro, 2, pad_id=0, rows=3, length=70)
    assert stacked.input_ids.shape == (6, 70)
    assert torch.equal(stacked.input_ids[1, :5], micro[0].input_ids[0]) and (stacked.targets[1:3] == IGNORE).all()
    assert torch.equal(stacked.targets[3:5, :7], micro[1].targets) and (stacked.targets[5] == IGNORE).all()
    assert (stacked.attention_mask[:, 7:] == 0).all()


def test_a_stage_keeps_its_blocks_by_the_whole_model_s_names(tiny_model_dir):
    """Stage 0 holds the embedding and block 0, stage 1 block 1, the norm and the head: together every name of the
    whole model (LoRA's too), each once, so a checkpoint of either layout loads on the other."""
    from meshtune.model.lora import add_lora
    from meshtune.model.loading import load_model
    from meshtune.model.pipeline_parallel import keep_stages

    cfg = build_config({"model_name_or_path": str(tiny_model_dir), "dataset": "d.jsonl", "lora_target": "all"})
    whole = set(add_lora(load_model(tiny_model_dir, torch.float32), cfg).state_dict())
    held = []
    for stage in (0, 1):
        model = add_lora(load_model(tiny_model_dir, torch.float32), cfg)
        keep_stages(model, [(stage, stage + 1)], first=stage == 0, last=stage == 1)
        held.append(set(model.state_dict()))
    assert not held[0] & held[1] and held[0] | held[1] == whole
    assert "base_model.model.model.embed_tokens.weight" in held[0]
    assert {"base_model.model.model.norm.weight", "base_model.model.lm_head.weight"} <= held[1]
    assert all(".layers.1." not in name for name in held[0]) and all(".layers.0." not in name for name in held[1])


def test_a_process_of_zbv_holds_two_stages_as_views_of_one_model_by_the_whole_model_s_names(tiny_model_dir):
    """zbv on 2 processes, 4 stages (the embedding; block 0; block 1; the head): rank 0 holds stages 0 and 3, one
    model with the embedding, the norm and the head, each stage's forward a view over its own share of it; the view
    of stage 3 computes the whole model's logits from the hidden states after the last block."""
    from meshtune.model.loading import load_model
    from meshtune.model.pipeline_parallel import held_stages, keep_stages, stage_forwards

    blocks = [(0, 0), (0, 1), (1, 2), (2, 2)]
    assert held_stages(0, 2, 2, "zbv") == [0, 3] and held_stages(1, 2, 2, "zbv") == [1, 2]
    assert held_stages(1, 2, 2, "interleaved_1f1b") == [1, 3]
    whole = load_model(tiny_model_dir, torch.float32)
    model = load_model(tiny_model_dir, torch.float32)
    keep_stages(model, [blocks[0], blocks[3]], first=True, last=True)
    assert {name.split(".")[1] for name in model.state_dict() if name.startswith("model.")} == {"embed_tokens", "norm"}
    assert not any(".layers." in name for name in model.state_dict())
    first, last = stage_forwards(model, [0, 3], blocks)
    first_held, last_held = ({id(p) for p in stage.parameters()} for stage in (first, last))
    assert first_held | last_held == {id(p) for p in model.parameters()} and not first_held & last_held
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        hidden = whole.model(input_ids=ids).last_hidden_state  # the whole model's blocks and final norm
        before_norm = whole.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(first(ids), whole.model.embed_tokens(ids))
        torch.testing.assert_close(last(before_norm), whole.lm_head(hidden))


class Jobs:
    """The module's training runs, each run once and shared by the tests that read it."""

    def __init__(self, workdir, model_dir, dataset):
        self.workdir, self.model_dir, self.dataset = workdir, model_dir, dataset
        self.done: dict[str, dict] = {}

    def run(self, name: str, method: str, nproc: int, pp: int, accumulation: int, per_node: int | None = None,
            **extra) -> dict:
        """A run of 4 steps at global batch 8 (2 rows a micro-step): its losses, grad norms, output_dir and plan. Its
        ranks told they are on nodes of `per_node` processes (default: one node)."""
        if name in self.done:
            return self.done[name]
        out = self.workdir / name
        out.mkdir()
        values = base_config(self.model_dir, self.dataset, out / "output", finetuning_type=method, parallel="ddp",
                             nproc_per_node=per_node or nproc, pipeline_parallel=pp, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, tokenized_path=str(self.workdir / "tokenized"),
                             learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, save_final=False,
                             max_grad_norm=0.5)
        values.update(extra)
        config = str(write_config(out, **values))
        train_on_ranks(config, nproc, out / "ranks", per_node=per_node)
        records = read_metrics(out / "output")
        self.done[name] = {"losses": [r["loss"] for r in records if "loss" in r],
                           "norms": [r["grad_norm"] for r in records if "grad_norm" in r],
                           "eval": [r["eval_loss"] for r in records if "eval_loss" in r],
                           "output": out / "output", "plan": json.loads((out / "output" / "run_plan.json").read_text())}
        return self.done[name]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_model_dir, tiny_dataset) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("pipeline"), tiny_model_dir, tiny_dataset)


@pytest.fixture(scope="module")
def jobs_4_blocks(tmp_path_factory, tiny_dataset) -> Jobs:
    """The runs of a tiny model of 4 blocks: a block for each of 4 stages."""
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 5, 30) for _ in range(300)], vocab_size=320)
    model = build_tiny_model(tokenizer, tmp_path_factory.mktemp("model-4-blocks"), seed=0, hidden_size=32,
                             intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    return Jobs(tmp_path_factory.mktemp("pipeline-4-blocks"), model, tiny_dataset)


def assert_same(values: list[float], reference: list[float], what: str) -> None:
    assert len(values) == len(reference), f"{what}: {values} vs {reference}"
    for step, (got, want) in enumerate(zip(values, reference), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step}: {got} vs one process {want}"


HELD_OUT = dict(val_size=8, eval_steps=2, per_device_eval_batch_size=3)
SAVED = dict(save_steps=2, save_final=True, **HELD_OUT)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_pp2_gives_the_losses_and_grad_norms_of_one_process(jobs, method):
    """And the held-out loss (val_size, evaluated every 2 steps: forward only through the stages)."""
    one = jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)
    assert one["losses"][-1] < one["losses"][0], one["losses"]
    pp2 = jobs.run(f"pp2-{method}", method, 2, 2, 4, **SAVED)
    assert len(one["eval"]) == 2
    assert_same(pp2["eval"], one["eval"], f"{method} pp 2 eval_loss")
    assert pp2["plan"]["mesh"]["pp"] == 2 and pp2["plan"]["pipeline_schedule"] == "1f1b", pp2["plan"]
    assert_same(pp2["losses"], one["losses"], f"{method} pp 2 loss")
    # clipped at 0.5: the norm is the whole model's, every stage's gradients in it
    assert_same(pp2["norms"], one["norms"], f"{method} pp 2 grad norm")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_interleaved_1f1b_and_zbv_on_pp2_give_the_losses_and_grad_norms_of_one_process(jobs, method):
    """Two stages a process: the 2 blocks and the head in 4 stages (the first the embedding alone, the last the
    head), rank 0 holding stages 0 and 2 (interleaved) or 0 and 3 (zbv's V); the held-out loss too. zbv's
    checkpoint-2 resumes on one process (under LoRA rank 0's stages hold no adapter: it saves nothing); zbv's LoRA
    runs once more with every block recomputed in backward (activation checkpointing under the split backward), full
    fine-tuning with each row of the step its own micro-batch of zbv (pipeline_row_micro_batches)."""
    one = jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)
    for schedule in ("interleaved_1f1b", "zbv"):
        saves = dict(save_steps=2) if schedule == "zbv" else {}
        run = jobs.run(f"pp2-{schedule}-{method}", method, 2, 2, 4, pipeline_schedule=schedule, **saves, **HELD_OUT)
        plan = run["plan"]
        assert plan["pipeline_schedule"] == schedule and plan["pipeline_virtual_stages"] == 2, plan
        assert plan["pipeline_stages"] == [[0, 0], [0, 1], [1, 2], [2, 2]], plan["pipeline_stages"]
        assert_same(run["losses"], one["losses"], f"{method} {schedule} loss")
        assert_same(run["norms"], one["norms"], f"{method} {schedule} grad norm")
        assert_same(run["eval"], one["eval"], f"{method} {schedule} eval_loss")
    if method == "lora":
        recomputed = jobs.run("pp2-zbv-lora-recomputed", method, 2, 2, 4, pipeline_schedule="zbv",
                              gradient_checkpointing_ratio=1.0, **HELD_OUT)
        assert recomputed["plan"]["recompute"] == 1.0
        assert_same(recomputed["losses"], one["losses"], "lora zbv, blocks recomputed, loss")
        assert_same(recomputed["norms"], one["norms"], "lora zbv, blocks recomputed, grad norm")
    if method == "full":  # the shape parallel: auto picks on a slow link: zbv over the step's 8 rows one by one
        rows = jobs.run("pp2-zbv-rows-full", method, 2, 2, 4, pipeline_schedule="zbv", pipeline_row_micro_batches=True,
                        **HELD_OUT)
        assert rows["plan"]["pipeline_one_row"] and rows["plan"]["pipeline_schedule"] == "zbv", rows["plan"]
        assert_same(rows["losses"], one["losses"], "full zbv, a row a micro-batch, loss")
        assert_same(rows["norms"], one["norms"], "full zbv, a row a micro-batch, grad norm")
    zbv = jobs.run(f"pp2-zbv-{method}", method, 2, 2, 4, pipeline_schedule="zbv", save_steps=2, **HELD_OUT)
    resumed = jobs.run(f"one-from-zbv-{method}", method, 1, 1, 4, **HELD_OUT,
                       resume_from_checkpoint=str(zbv["output"] / "checkpoint-2"))
    assert_same(resumed["losses"], one["losses"][2:], f"{method} zbv pp 2 -> 1 process")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_pp2_x_dp2_gives_the_losses_and_grad_norms_of_one_process(jobs, method):
    """4 processes: 2 stages of 2 replicas each, 2 micro-batches a step on each replica (global batch 8); LoRA under
    GPipe, full fine-tuning under 1F1B and under ZBV (each replica of rank 0's two stages, the embedding and the head,
    averaging their gradients with the other's)."""
    one = jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)
    for schedule in ("gpipe",) if method == "lora" else ("1f1b", "zbv"):
        pp2_dp2 = jobs.run(f"pp2-dp2-{method}-{schedule}", method, 4, 2, 2, pipeline_schedule=schedule, **HELD_OUT)
        plan = pp2_dp2["plan"]
        assert plan["pipeline_schedule"] == schedule
        assert plan["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}, plan["mesh"]
        assert plan["grad_sync"] == "flat" and plan["gradient_accumulation_steps"] == 2
        assert_same(pp2_dp2["losses"], one["losses"], f"{method} {schedule} pp 2 x dp 2 loss")
        assert_same(pp2_dp2["norms"], one["norms"], f"{method} {schedule} pp 2 x dp 2 grad norm")
        assert_same(pp2_dp2["eval"], one["eval"], f"{method} {schedule} pp 2 x dp 2 eval_loss")
    if method == "lora":  # told they are 2 nodes of 2: each node's 2 pipelines start a hop apart, the same numbers
        staggered = jobs.run("pp2-dp2-lora-staggered", method, 4, 2, 2, per_node=2, pipeline_schedule="gpipe",
                             link_gbps=0.001, pipeline_stagger=True, **HELD_OUT)
        assert staggered["plan"]["why"]["pipeline_stagger"].startswith("on: pipeline_stagger: true, the node's 2 "
                                                                       "pipelines start a hop apart (a hop "), \
            staggered["plan"]["why"]
        in_step = jobs.done["pp2-dp2-lora-gpipe"]
        assert staggered["losses"] == in_step["losses"] and staggered["norms"] == in_step["norms"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["zero2", "zero3"])
def test_fsdp2_inside_each_stage_gives_the_losses_of_one_process(jobs, parallel):
    """pp 2 x dp 2, each stage sharded over its 2 processes by FSDP2 (the stage's forward the root), full
    fine-tuning (its checkpoint-2 resumes on one process) and, under zero3, LoRA."""
    one = jobs.run("one-full", "full", 1, 1, 4, **SAVED)
    sharded = jobs.run(f"pp2-{parallel}", "full", 4, 2, 2, parallel=parallel, save_steps=2, **HELD_OUT)
    assert sharded["plan"]["parallel"] == parallel and sharded["plan"]["mesh"]["pp"] == 2
    assert_same(sharded["losses"], one["losses"], f"pp 2 x {parallel} 2 loss")
    if parallel == "zero2":
        # told they are 2 nodes of 2: each node's 2 pipelines start a hop apart, each gathering its stage's weights
        # first (zero2 keeps them whole to the last backward); the wait changes no number
        staggered = jobs.run("pp2-zero2-staggered", "full", 4, 2, 2, per_node=2, parallel="zero2", link_gbps=0.001,
                             pipeline_stagger=True, log_level_all_ranks="info", **HELD_OUT)
        assert staggered["plan"]["pipeline_stagger_rate"] > 0, staggered["plan"]["why"]
        assert staggered["losses"] == sharded["losses"] and staggered["norms"] == sharded["norms"]
        assert staggered["eval"] == sharded["eval"]
    assert_same(sharded["norms"], one["norms"], f"pp 2 x {parallel} 2 grad norm")
    assert_same(sharded["eval"], one["eval"], f"pp 2 x {parallel} 2 eval_loss")
    # the checkpoint's accumulation of 2 given, the plan keeps its global batch of 8: 4 micro-batches on one process
    resumed = jobs.run(f"one-from-pp2-{parallel}", "full", 1, 1, 2, **HELD_OUT,
                       resume_from_checkpoint=str(sharded["output"] / "checkpoint-2"))
    assert resumed["plan"]["gradient_accumulation_steps"] == 4
    if parallel == "zero3":  # LoRA's frozen base sharded too (under zero2 LoRA runs as ddp)
        lora = jobs.run("pp2-lora-zero3", "lora", 4, 2, 2, parallel="zero3", **HELD_OUT)
        assert lora["plan"]["parallel"] == "zero3"
        assert_same(lora["losses"], jobs.run("one-lora", "lora", 1, 1, 4, **SAVED)["losses"], "lora pp 2 x zero3 2")
    assert_same(resumed["losses"], one["losses"][2:], f"pp 2 x {parallel} 2 -> 1 process")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_inside_the_stages_of_interleaved_1f1b_and_zbv_gives_the_losses_of_one_process(jobs_4_blocks):
    """pp 2 x dp 2 of a 4-block model (a block a stage: FSDP2 shards a stage by its blocks), each of a process's two
    stages its own FSDP2 root: interleaved 1F1B under zero2, ZBV under zero3, full fine-tuning; ZBV's checkpoint-2
    resumes on one process. Interleaved 1F1B under zero2 again, its ranks told they are 2 nodes of 2 and their
    pipelines staggered (torch's schedule then unshards and reshards each stage's root itself): the same numbers."""
    jobs = jobs_4_blocks
    one = jobs.run("one-full", "full", 1, 1, 4, **SAVED)
    for schedule, parallel in (("interleaved_1f1b", "zero2"), ("zbv", "zero3")):
        run = jobs.run(f"{schedule}-{parallel}", "full", 4, 2, 2, pipeline_schedule=schedule, parallel=parallel,
                       save_steps=2, **HELD_OUT)
        plan = run["plan"]
        assert plan["parallel"] == parallel and plan["mesh"]["dp_shard"] == 2, plan["mesh"]
        assert plan["pipeline_stages"] == [[0, 1], [1, 2], [2, 3], [3, 4]], plan["pipeline_stages"]
        assert_same(run["losses"], one["losses"], f"{schedule} x {parallel} loss")
        assert_same(run["norms"], one["norms"], f"{schedule} x {parallel} grad norm")
        assert_same(run["eval"], one["eval"], f"{schedule} x {parallel} eval_loss")
    staggered = jobs.run("interleaved_1f1b-zero2-staggered", "full", 4, 2, 2, per_node=2,
                         pipeline_schedule="interleaved_1f1b", parallel="zero2", link_gbps=0.001,
                         pipeline_stagger=True, **HELD_OUT)
    assert staggered["plan"]["pipeline_stagger_rate"] > 0, staggered["plan"]["why"]
    in_step = jobs.done["interleaved_1f1b-zero2"]
    assert (staggered["losses"], staggered["norms"], staggered["eval"]) == (
        in_step["losses"], in_step["norms"], in_step["eval"])
    resumed = jobs.run("one-from-zbv-zero3", "full", 1, 1, 2, **HELD_OUT,
                       resume_from_checkpoint=str(jobs.done["zbv-zero3"]["output"] / "checkpoint-2"))
    assert resumed["plan"]["gradient_accumulation_steps"] == 4
    assert_same(resumed["losses"], one["losses"][2:], "zbv x zero3 -> 1 process")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_final_of_pp2_holds_the_whole_model_and_the_adapter_by_their_names(jobs):
    for method, weights in (("full", "model.safetensors"), ("lora", "adapter_model.safetensors")):
        one = load_file(str(jobs.run(f"one-{method}", method, 1, 1, 4, **SAVED)["output"] / "final" / weights))
        pp2 = load_file(str(jobs.run(f"pp2-{method}", method, 2, 2, 4, **SAVED)["output"] / "final" / weights))
        assert pp2.keys() == one.keys(), f"{method}: {sorted(set(pp2) ^ set(one))}"
        for name, tensor in one.items():
            torch.testing.assert_close(pp2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pp2_checkpoint_resumes_on_one_process_and_under_zero2_on_4_and_one_process_s_on_pp2(jobs):
    """Also on pp 2 itself: each stage's optimizer param groups name its own parameters, saved by name. Under
    zero2 on 4 processes FSDP2 shards each weight the pp 2 stages held whole, the same global batch of 8 in one
    micro-batch of 2 rows a process."""
    one = jobs.run("one-full", "full", 1, 1, 4, **SAVED)
    pp2 = jobs.run("pp2-full", "full", 2, 2, 4, **SAVED)
    from_pp2 = jobs.run("one-from-pp2", "full", 1, 1, 4, resume_from_checkpoint=str(pp2["output"] / "checkpoint-2"),
                        **HELD_OUT)
    assert from_pp2["plan"]["resumed_from"].endswith("checkpoint-2")
    assert_same(from_pp2["losses"], one["losses"][2:], "pp 2 -> 1 process")
    # the checkpoint's accumulation of 4 given, the plan keeps its global batch of 8: 1 micro-batch a process
    zero2 = jobs.run("zero2-from-pp2", "full", 4, 1, 4, parallel="zero2", **HELD_OUT,
                     resume_from_checkpoint=str(pp2["output"] / "checkpoint-2"))
    assert zero2["plan"]["parallel"] == "zero2" and "pp" not in zero2["plan"]["mesh"], zero2["plan"]
    assert zero2["plan"]["gradient_accumulation_steps"] == 1
    assert zero2["plan"]["resumed_from"].endswith("checkpoint-2")
    assert_same(zero2["losses"], one["losses"][2:], "pp 2 -> zero2 on 4 processes")
    assert_same(zero2["eval"], one["eval"][1:], "pp 2 -> zero2 on 4 processes, eval_loss")
    to_pp2 = jobs.run("pp2-from-one", "full", 2, 2, 4, resume_from_checkpoint=str(one["output"] / "checkpoint-2"),
                      **HELD_OUT)
    assert_same(to_pp2["losses"], one["losses"][2:], "1 process -> pp 2")
    again = jobs.run("pp2-from-pp2", "full", 2, 2, 4, resume_from_checkpoint=str(pp2["output"] / "checkpoint-2"),
                        **HELD_OUT)
    assert again["losses"] == pp2["losses"][2:], "pp 2 -> pp 2 goes on bit for bit"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_2_node_pipeline_with_a_node_killed_after_checkpoint_4_ends_with_the_uninterrupted_weights(
        tmp_path, tiny_model_dir, tiny_dataset):
    """One stage a node (torchrun agents on 127.0.0.1, --nnodes 2): node 1 killed with kill -9 once checkpoint-4 is
    published, relaunched alone; both stages resume from checkpoint-4 and the job ends with the losses and the
    final weights, bit for bit, of the same job without the kill (its ranks forked on this machine)."""
    from test_faults import Cluster, final_hash, job_config, kill_and_relaunch, losses
    from ranks import free_port, run_meshtune_ranks

    pipeline = dict(parallel="ddp", hsdp_shard_size=None, pipeline_parallel=2, gradient_accumulation_steps=2,
                    max_steps=8, save_steps=4, preflight=False)  # the launches' own checks are tested elsewhere
    reference = tmp_path / "uninterrupted"
    config = job_config(reference / "cfg", tiny_model_dir, tiny_dataset, reference / "output", **pipeline)
    result = run_meshtune_ranks(["train", str(config)], 2, reference / "ranks", env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    killed = tmp_path / "killed"
    config = job_config(killed / "cfg", tiny_model_dir, tiny_dataset, killed / "output", **pipeline)
    cluster = Cluster(killed)
    try:
        port = free_port()
        nodes = cluster.start_job(config, port)
        kill_and_relaunch(cluster, config, port, killed / "output", nodes, victim=1, step=4)
        for node in nodes:
            assert node.wait(240) == 0, node.output()[-4000:]
    finally:
        cluster.cleanup()
    texts = "".join(node.output() for node in cluster.nodes)
    assert f"resumed from {killed / 'output' / 'checkpoint-4'} at step 4" in texts, texts[-4000:]
    assert losses(killed / "output") == losses(reference / "output")
    assert final_hash(killed / "output") == final_hash(reference / "output")


def test_the_doctor_counts_a_pipeline_s_activations_as_what_crosses_the_nodes():
    """Full 7B (hidden 3,584) on 2 nodes x 8 GPUs, a stage a node, 64 rows of 600 tokens a step in bf16: the 8
    pipelines' activations, 64 x 600 x 3,584 x 2 bytes = 0.28 GB, cross each way, against ddp's ring all-reduce of
    15 GB of bf16 gradients; a stage on 2 nodes (pp 2 on 4 nodes) adds its replicas' all-reduce of half of them."""
    from meshtune.crossing import ModelFacts, sent_by_each_node
    from meshtune.doctor.traffic import step_collectives

    model = ModelFacts(QWEN_7B, QWEN_7B.parameters, 6_500_000_000, 28, 3584, hidden=3584)

    def sent(pp: int, nodes: int, parallel: str = "ddp", schedule: str = "auto") -> float:
        cfg = build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "finetuning_type": "full",
                            "pipeline_parallel": pp, "per_device_train_batch_size": 8 // (nodes * 8 // pp // 8),
                            "gradient_accumulation_steps": 1, "cutoff_len": 600, "grad_reduce_dtype": "bf16",
                            "parallel": parallel, "pipeline_schedule": schedule})
        return sent_by_each_node(step_collectives(cfg, parallel, model, True, True, nodes * 8, None, 8), nodes)

    assert sent(2, 2) == pytest.approx(64 * 600 * 3584 * 2)
    # two stages a process: node 0 sends stage 0's and stage 2's activations and stage 2's gradients back; zbv's V
    # turns on node 1, which sends stage 2's activations and stage 1's gradients
    assert sent(2, 2, schedule="interleaved_1f1b") == pytest.approx(3 * sent(2, 2))
    assert sent(2, 2, schedule="zbv") == pytest.approx(2 * sent(2, 2))
    assert sent(4, 4, schedule="zbv") == pytest.approx(2 * sent(4, 4)) == pytest.approx(4 * sent(2, 2))
    ddp = sent(1, 2)
    assert ddp == pytest.approx(2 * 15 / 16 * QWEN_7B.parameters * 2)
    assert sent(2, 2) / ddp < 0.02
    # 4 nodes, 2 stages: each stage's 16 replicas on 2 nodes; 2 rows a process
    four = step_collectives(build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "finetuning_type": "full",
                                          "pipeline_parallel": 2, "per_device_train_batch_size": 2,
                                          "cutoff_len": 600, "grad_reduce_dtype": "bf16"}),
                            "ddp", model, True, True, 32, None, 8)
    assert [(c.kind, c.what) for c in four] == [("send", "activations forward and their gradients back"),
                                                ("all-reduce", "a stage's gradients")]
    assert four[1].bytes == QWEN_7B.parameters * 2 / 2 and four[1].ranks == 16


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_on_a_slow_link_between_two_cpu_nodes_trains_a_stage_on_each(tmp_path, tiny_model_dir, tiny_dataset):
    """`parallel: auto` with `link_gbps` on 2 CPU nodes (torchrun agents on 127.0.0.1, --nnodes 2, one process
    each): the plan measures the processes' fp32 matmul rate together and, the gradients' all-reduce taking far longer
    on 0.001 Gb/s than the tiny model's step, puts a stage on each node (one pipeline a node: nothing to stagger);
    the job trains to its end. On 1,000 Gb/s ddp's all-reduce costs less than a pipeline's bubble: ddp, as without
    the link."""
    from test_faults import Cluster, job_config, losses

    def run(name: str, gbps: float) -> dict:
        output = tmp_path / name / "output"
        config = job_config(tmp_path / name / "cfg", tiny_model_dir, tiny_dataset, output, parallel="auto",
                            hsdp_shard_size=None, link_gbps=gbps, gradient_accumulation_steps=2, max_steps=2,
                            save_steps=0, save_final=False, preflight=False)
        cluster = Cluster(tmp_path / name)
        try:
            cluster.run(config)
        finally:
            cluster.cleanup()
        assert len(losses(output)) == 2
        return json.loads((output / "run_plan.json").read_text())

    slow = run("slow", 0.001)
    assert slow["mesh"]["pp"] == 2 and slow["parallel"] == "ddp", slow["mesh"]
    assert slow["why"]["parallel"].startswith("auto by the link (0.001 Gb/s): pipeline_parallel 2 (ddp inside"), \
        slow["why"]["parallel"]
    assert slow["why"]["pipeline_stagger"].startswith("off: a node holds one pipeline"), slow["why"]
    fast = run("fast", 1000)
    assert "pp" not in fast["mesh"] and fast["parallel"] == "ddp", fast["mesh"]
    assert fast["why"]["parallel"].startswith("auto by the link (1000 Gb/s): ddp, predicted at"), fast["why"]


def test_a_pipeline_s_keys_set_without_a_pipeline_are_named_as_unused():
    plan = plan_for({"pipeline_schedule": "zbv", "pipeline_row_micro_batches": True, "parallel": "ddp"})
    assert plan.pipeline_parallel == 1
    for key in ("pipeline_schedule", "pipeline_row_micro_batches"):
        assert plan.why[key] == "not used: the run has no pipeline (pipeline_parallel 1)", plan.why
        assert re.search(rf"{key} +not used", plan.describe()), plan.describe()
    assert "pipeline_virtual_stages" not in plan.why
    assert "pipeline_schedule" not in plan_for({"parallel": "ddp"}).why


def stagger_waits_with_its_stage_whole(device: str) -> None:
    """A staggered pipeline's wait on `device` (one process): it gathers every FSDP2 unit of its stages (zero2 keeps
    them whole to the last backward, so no gather at a micro-batch's forward puts the pipelines back in step), then
    waits its turn: 2 hops of 2 rows x 64 tokens x 32 x 4 bytes at 1 MB/s, 32.8 ms."""
    import time

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from meshtune.train.pipeline_step import Stagger

    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stage = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).to(device)
        for unit in (*stage, stage):
            fully_shard(unit, reshard_after_forward=False)
        assert all(isinstance(p, DTensor) for p in stage.parameters())
        stagger = Stagger(turn=2, pipelines=4, rate=1e6, token_bytes=32 * 4)
        seconds = stagger.seconds(2, 64)
        assert seconds == pytest.approx(2 * 2 * 64 * 128 / 1e6)
        started = time.monotonic()
        stagger.wait(seconds, [stage], torch.device(device))
        assert time.monotonic() - started >= seconds
        assert not any(isinstance(p, DTensor) for p in stage.parameters())  # whole: unsharded
        out = stage(torch.ones(2, 32, device=device))  # and the forward gathers nothing more
        assert out.shape == (2, 32)
    finally:
        dist.destroy_process_group()


def test_a_staggered_pipeline_gathers_its_zero2_stage_then_waits_its_turn():
    stagger_waits_with_its_stage_whole("cpu")
