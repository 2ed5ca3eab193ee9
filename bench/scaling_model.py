"""What a job's per-GPU speed becomes on more nodes than one machine has: a model from the measured one-node step
and the bytes each parallel mode moves between nodes, checked against the simulated two nodes.

For N nodes of G GPUs each, every GPU keeping its batch and accumulation (the global batch grows with the nodes):

  step(N) = compute + exposed gradient reduction + exposed weight gathers

- compute: the one-node step, measured (bench/two_node_speed.py's one-node runs, or --compute-step-s). Traffic
  inside a node rides NVLink and is counted in it.
- what crosses the nodes each optimizer step: meshtune.doctor.traffic, the doctor's own estimate (ddp: the trainable
  gradients' all-reduce; hsdp: the same between the replicas; zero2: the weights' all-gather once a step, zero3:
  twice a micro-step, and the gradients' reduce-scatter), in the mode `parallel: auto` picks for that many nodes;
  seconds = bytes x 2(N-1)/N (all-reduce) or (N-1)/N (all-gather, reduce-scatter) / the link's bus bandwidth.
- how much of it the step hides: meshtune.crossing, the arithmetic the run plan chooses `parallel: auto` by (with
  link_gbps): the gradients cross during their micro-step's backward (about 2/3 of its compute); what does not fit
  that window is exposed, and at least the last unit's share always is (it starts when backward ends). The weights'
  gathers overlap the rest of the step. A pipeline (a stage a node, data-parallel inside it) sends its micro-batches'
  activations forward and their gradients back at each stage boundary; its step is torch's schedule simulated over
  the stages the run builds, each stage's cost from its FLOPs, a send delaying what waits on it, the node's
  pipelines in step or, where shorter, started a hop apart (meshtune.shared_link.priced_pipeline, over
  meshtune.plan.pipeline_shapes: the link choice's own).

Link speeds: the bus bandwidth the doctor measured between the simulated nodes (--from), and line rates of
--link-gbps (Gb/s a node) at --link-efficiency of the line rate (what NCCL's all-reduce reaches on a healthy
network; an assumption, not a measurement).

  python bench/scaling_model.py --from results/two_node_speed.json --job full-1.5b
  python bench/scaling_model.py --job lora-7b --compute-step-s 1.9 --gpus-per-node 8 --global-batch 64

Every mode (--project), from the formula's bytes or calibrated by a shaped link's (--from-link, bench/shaped_link.py's
JSON): for each mode the link run measured, the ratio of the bytes its interfaces counted to what
meshtune.doctor.traffic predicts for that run (its model, processes and gloo) scales the formula's bytes for the
projected job (NCCL, bf16 weights), so a formula that misses part of the traffic is corrected by the wire; a mode
it did not run is marked "(formula)". Projected for full 7B, full 72B, LoRA 7B and Q-LoRA 72B (--jobs) at --nodes x 8
GPUs over --link-gbps, each GPU at the one-GPU rate of PROJECTED (cited; or --tokens-per-s JOB=RATE), 4 sequences of
576 tokens a GPU a step (64 sequences at 2 nodes), the same overlap as above. The pipeline rows put a stage on each
node (pp = nodes; "—" where the stages outnumber the blocks; Q-LoRA's stages zero3 inside a node), their
micro-batches 4 sequences (pp: per_device_train_batch_size 4) or 1 (pp-mb1: pipeline_row_micro_batches, or
per_device_train_batch_size 1 with gradient_accumulation_steps 4), each pipeline taking the stages' times the
micro-steps so the global batch stays; under 1f1b, or two stages a process under interleaved_1f1b (-interleaved) and
zbv (-zbv). The auto row gives the shape meshtune.plan's link choice picks among these at each link and count. A mode
whose weights and state do not fit --gpu-gib a GPU is marked so:

  python bench/scaling_model.py --from-link results/shaped_link.json --out results/projection
  python bench/scaling_model.py --project --out results/projection

What the pipeline rows would give with levers meshtune does not have (--what-if, bench/pipeline_levers.py): every
stage the mean stage's cost (boundaries inside blocks), the hops' bytes at a share (8-bit activations across nodes);
and the plan's pricing taken apart: a node's pipelines kept in step (in-step), or simulated one by one on its
shared link in step (shared-link), where the plan would start them a hop apart (pipeline_stagger):

  python bench/scaling_model.py --project --jobs full-7b --link-gbps 100 --what-if even-stages,hop-bytes=0.5
  python bench/scaling_model.py --project --jobs full-7b --link-gbps 100 --what-if in-step
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_levers import WhatIf  # noqa: E402
from two_node_speed import JOBS, accumulation_for  # noqa: E402

SEED_TABLE = {2: 0.95, 4: 0.88, 8: 0.80}  # per-GPU efficiency a seed document gives for Qwen LoRA on A100 nodes


@dataclass(frozen=True)
class Job:
    name: str
    size: str
    method: str
    bs: int           # sequences a GPU a micro-step
    accumulation: int
    reduce: str = "fp32"  # the dtype gradients cross in (grad_reduce_dtype)


def job_config(job: Job, mode: str):
    from meshtune.config import build_config

    return build_config(dict(model_name_or_path="model", dataset=["data"], finetuning_type=job.method, lora_rank=64,
                             lora_alpha=16, lora_target="all", per_device_train_batch_size=job.bs,
                             gradient_accumulation_steps=job.accumulation, parallel=mode,
                             grad_reduce_dtype=job.reduce))


def model_facts(job: Job):
    """The job's model on the meta device, counted as the doctor counts it (LoRA's adapters included)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from meshtune.doctor.traffic import ModelFacts
    from meshtune.model.flops import FlopCounter
    from meshtune.model.loading import transformer_blocks
    from meshtune.model.lora import add_lora
    from meshtune.plan import ModelSize
    from workspace import model_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config(job.size))
    counter = FlopCounter.of(model)
    blocks = transformer_blocks(model)
    size = ModelSize(sum(p.numel() for p in model.parameters()), sum(p.numel() for p in blocks[0].parameters()),
                     len(blocks), model_type="qwen2", hidden=model.config.hidden_size,
                     head_parameters=model.lm_head.weight.numel())
    trainable = size.parameters
    if job.method != "full":
        trainable = sum(p.numel() for p in add_lora(model, job_config(job, "auto")).parameters() if p.requires_grad)
    return ModelFacts(size, trainable, counter.dense_params, counter.layers, counter.heads * counter.head_dim,
                      model.config.hidden_size)


def step_seconds(job: Job, facts, nodes: int, per_node: int, busbw: float, compute_s: float,
                 gpu_bytes: float) -> tuple[float, str, dict]:
    """The modelled optimizer step on `nodes` nodes, the mode auto picks there, and the parts of the step."""
    from meshtune.crossing import data_parallel_step
    from meshtune.doctor.traffic import parallel_mode, step_collectives

    cfg = job_config(job, "auto")
    mode, _ = parallel_mode(cfg, nodes * per_node, per_node, True, gpu_bytes, facts.size)
    if nodes == 1:
        return compute_s, mode, {"compute": compute_s}
    crossing = step_collectives(cfg, mode, facts, True, True, nodes * per_node, gpu_bytes)
    step = data_parallel_step(crossing, nodes, busbw, compute_s, job.accumulation, units_of(facts))
    parts = {"compute": compute_s, "reduce": step.reduce_s, "gather": step.gather_s, "exposed": step.exposed_s}
    return step.step_s, mode, parts


def units_of(facts) -> int:
    """FSDP2's units of blocks by default (or DDP's buckets): the last one's crossing is never hidden."""
    from meshtune.crossing import fsdp_units

    return fsdp_units(facts.size)


def measured_from(path: Path, job: str) -> dict:
    """From bench/two_node_speed.py's report: the one-node step (median), each two-node layout's per-GPU tokens/s
    and step (medians) by link, and the doctor's bus bandwidth by link."""
    data = json.loads(path.read_text())
    runs = [r for r in data["runs"] if r["job"] == job and "per_gpu" in r]
    one = [r for r in runs if r["layout"] == "one-node"]
    if not one:
        raise SystemExit(f"{path}: no one-node run of {job} to take the compute step from")
    two = {}
    for link in {r["link"] for r in runs if r["layout"] == "two-nodes"}:
        mine = [r for r in runs if r["layout"] == "two-nodes" and r["link"] == link]
        two[link] = {"per_gpu": statistics.median(r["per_gpu"] for r in mine),
                     "step_s": statistics.median(r["step_s"] for r in mine)}
    return {"compute_s": statistics.median(r["step_s"] for r in one),
            "per_gpu": statistics.median(r["per_gpu"] for r in one),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in one),
            "two_nodes": two, "busbw": {link["link"]: link["busbw_gbs"] * 1e9 for link in data.get("links", [])
                                        if "busbw_gbs" in link}}


# The one-GPU rate each projected job computes at (tokens/s a GPU), from docs/benchmarks/, and its modes: the
# link run's variant whose measured bytes calibrate each, and the config keys the mode sets.
PROJECTED = {
    "full-7b": ("7b", "full", 6622.0, "full 7B, zero3 on 4 × H100, 36.1% MFU (docs/benchmarks/one-gpu.md, 7B models)"),
    "full-72b": ("72b", "full", None, "full 7B's rate × 7B / 72B FLOPs a token (an assumption: the same MFU)"),
    "lora-7b": ("7b", "lora", 14556.0, "LoRA 7B, one node of 2 × H200, ddp (docs/benchmarks/scaling.md)"),
    "qlora-72b": ("72b", "qlora", None, "LoRA 7B's rate × 7B / 72B FLOPs a token × 0.70 (Q-LoRA 7B ran at 0.70× "
                                        "LoRA 7B: docs/benchmarks/one-gpu.md, 7B models)"),
}
DERIVED = {"full-72b": ("full-7b", 1.0), "qlora-72b": ("lora-7b", 0.70)}  # rate from: job, factor
# name: (parallel, keys, the link variant that calibrates it); a pipeline's stages are the nodes (PIPELINE_MODES)
FULL_MODES = {"ddp": ("ddp", {}, "ddp"), "zero2": ("zero2", {}, "zero2"), "zero3": ("zero3", {}, "zero3"),
              "zero3-node": ("zero3", {"zero3_reshard_to_node": True}, "zero3-node"), "hsdp": ("hsdp", {}, "hsdp"),
              "hsdp-bf16": ("hsdp", {"grad_reduce_dtype": "bf16"}, "hsdp-bf16"),
              **{f"pp{split}{suffix}": ("zero2", {"pipeline_schedule": schedule}, "pp2")
                 for split in ("", "-mb1") for schedule, suffix in (("1f1b", ""), ("interleaved_1f1b", "-interleaved"),
                                                                    ("zbv", "-zbv"))}}
LORA_MODES = {"lora-ddp": ("ddp", {}, "lora-ddp"),
              "lora-ddp-bf16": ("ddp", {"grad_reduce_dtype": "bf16"}, "lora-ddp-bf16"),
              "lora-pp-mb1": ("ddp", {"pipeline_schedule": "1f1b"}, "pp2")}
QLORA_MODES = {**LORA_MODES, "qlora-pp-mb1": ("zero3", {"pipeline_schedule": "1f1b"}, "pp2")}
# a stage a node, dp inside it; the step's sequences a GPU in micro-batches of this many (the config's
# per_device_train_batch_size; the plan's auto runs gradient_accumulation_steps x stages of them)
SEQUENCES_A_GPU, TOKENS_A_SEQUENCE = 4, 576
PIPELINE_MODES = {name: 1 if "mb1" in name else SEQUENCES_A_GPU for name in [*FULL_MODES, *QLORA_MODES]
                  if "pp" in name}


def link_calibration(path: Path | None) -> dict[str, float]:
    """Per variant of a shaped-link report: the bytes a node sent a step, measured over predicted by the formula
    for that very run (none without a report: the formula's bytes)."""
    from meshtune.config import build_config
    from meshtune.crossing import sent_by_each_node
    from meshtune.doctor.traffic import model_facts, step_collectives

    if path is None:
        return {}
    report = json.loads(path.read_text())
    nodes, per_node = report["nodes"], report["nproc_per_node"]
    ratios = {}
    for row in report["rows"]:
        cfg = build_config({**report["base_config"], **report["variants"][row["variant"]]})
        if cfg.powersgd_rank:
            continue  # not in the formula: its factors depend on each matrix's shape
        if cfg.named_parallel is None and cfg.link_gbps is not None:
            continue  # auto by the link: its mode is the plan's choice at start-up, not in the report
        mode = cfg.named_parallel or "ddp"
        predicted = sent_by_each_node(step_collectives(cfg, mode, model_facts(cfg), False, True, nodes * per_node,
                                                       None, per_node, True), nodes)
        ratios[row["variant"]] = row["tx_per_node"]["median"] / predicted
    return ratios


def state_gib(method: str, mode: str, facts, nodes: int, per_node: int, stages: int = 1) -> float:
    """Weights, gradients and AdamW state a GPU holds (no activations): full fine-tuning 2 bytes of bf16 weights
    whole where unsharded or gathered, and its shard of the fp32 state; LoRA and Q-LoRA the frozen base (bf16 /
    NF4) and the adapters' state. The state is the plan's one estimate (meshtune.plan.full_state_bytes). A pipeline
    stage holds 1 / `stages` of it, sharded in its node."""
    from meshtune.crossing import NF4_BYTES, default_blocks_per_unit
    from meshtune.plan import full_state_bytes

    cfg = mode_config("full", "auto", {})  # the projections' fp32 master weights
    n = facts.size.parameters / stages
    if method != "full":
        base = NF4_BYTES * n if method == "qlora" else 2 * n
        return (base + full_state_bytes(cfg, facts.trainable / stages, 1, whole_weights=False)) / 2**30
    shard = 1 if mode == "ddp" else per_node if mode == "hsdp" or stages > 1 else nodes * per_node
    unit = default_blocks_per_unit(facts.size.block_parameters) * facts.size.block_parameters
    whole = mode in ("ddp", "zero2")
    gathered = 0 if whole else 2 * 2 * unit  # zero3: a unit gathered and the next prefetched
    return (gathered + full_state_bytes(cfg, n, shard, whole_weights=whole)) / 2**30


def mode_config(method: str, mode: str, keys: dict, stages: int = 1, micro_batch: int = SEQUENCES_A_GPU):
    """The config of a projected mode: a GPU's 4 sequences of 576 tokens a step, in micro-batches of `micro_batch`;
    under `stages` (a pipeline stage a node) each pipeline takes `stages` times the micro-batches, as the plan's
    auto does, so the global batch is the data-parallel modes'."""
    from meshtune.config import build_config

    accumulation = SEQUENCES_A_GPU // micro_batch * stages
    return build_config(dict(model_name_or_path="model", dataset=["data"], finetuning_type=method, lora_rank=64,
                             lora_alpha=16, lora_target="all", per_device_train_batch_size=micro_batch,
                             gradient_accumulation_steps=accumulation, cutoff_len=TOKENS_A_SEQUENCE, parallel=mode,
                             pipeline_parallel=stages, pipeline_row_micro_batches=False if stages > 1 else None,
                             **keys))


def stage_sharding(facts, stages: int, per_node: int, gpu_bytes: float) -> str:
    """How the plan shards a pipeline stage of full fine-tuning over its node (meshtune.plan.sharding_for_full)."""
    from meshtune.plan import sharding_for_full

    cfg = mode_config("full", "auto", {})
    return sharding_for_full(cfg, facts.size.parameters // stages, per_node, gpu_bytes)[0]


def projected_step(cfg, mode: str, facts, nodes: int, per_node: int, busbw: float, compute_s: float,
                   ratio: float, gpu_bytes: float | None = None, what_if: WhatIf = WhatIf()) -> dict | None:
    """One optimizer step at `nodes` x `per_node` (meshtune.crossing): the formula's crossing bytes x the link's
    ratio, hidden behind the compute (gradients behind their micro-step's backward, gathers behind the rest; a
    pipeline's step simulated from torch's schedule over the stages the run builds: meshtune.plan.pipeline_shapes,
    the link choice's own, or those `what_if` supposes). None where the pipeline cannot split the model so."""
    from meshtune.crossing import data_parallel_step, sent_by_each_node
    from meshtune.doctor.traffic import step_collectives
    from meshtune.plan import pipeline_shapes
    from meshtune.plan.link import stagger_asked

    crossing = step_collectives(cfg, mode, facts, True, True, nodes * per_node, gpu_bytes, per_node)
    micro = cfg.gradient_accumulation_steps
    if cfg.pipeline_parallel > 1:
        shapes = pipeline_shapes(cfg, facts.size, cfg.pipeline_parallel, micro, mode)
        if (cfg.pipeline_schedule, False) not in shapes:
            return None
        crossing = what_if.crossing(crossing)
        step, staggered = what_if.step(crossing, nodes, busbw / ratio, compute_s,
                                       shapes[cfg.pipeline_schedule, False], per_node, stagger_asked(cfg, mode, True))
    else:
        step, staggered = data_parallel_step(crossing, nodes, busbw / ratio, compute_s, micro, units_of(facts)), False
    return {"gather_s": step.gather_s, "reduce_s": step.reduce_s, "bubble_s": step.bubble_s, "step_s": step.step_s,
            "efficiency": step.efficiency, "bytes_a_node": sent_by_each_node(crossing, nodes) * ratio,
            "staggered": staggered}


def auto_pick(method: str, facts, nodes: int, per_node: int, gbps: float, compute_s: float, gpu_bytes: float,
              micro_batch: int) -> str | None:
    """The projected mode `parallel: auto` picks with link_gbps (meshtune.plan.choose_by_link's arithmetic, at this
    compute time) for a GPU's 4 sequences in micro-batches of `micro_batch`, a pipeline's schedule and split among
    them (the row of that name); None where the link does not decide (LoRA and Q-LoRA: ddp)."""
    from meshtune.plan import pick_by_link

    if method != "full":
        return None
    cfg = mode_config(method, "auto", {"link_gbps": gbps}, micro_batch=micro_batch)
    pick, _, _ = pick_by_link(cfg, nodes * per_node, per_node, facts.size, gpu_bytes, compute_s)
    if pick.pipeline > 1:
        suffix = {"interleaved_1f1b": "-interleaved", "zbv": "-zbv"}.get(pick.schedule, "")
        return "pp" + ("-mb1" if pick.one_row or micro_batch == 1 else "") + suffix
    return pick.mode


def auto_rows(job: str, facts, nodes_list: list[int], gbps_list: list[float], per_node: int, compute_s: float,
              gpu_bytes: float, efficiency: dict, found: list) -> list[str]:
    """The table's auto row at each link: the mode (a pipeline's schedule and split) the plan's link choice picks,
    at its row's efficiency; each also appended to `found`."""
    lines = []
    for gbps in gbps_list:
        cells = []
        for nodes in nodes_list:
            pick = auto_pick("full", facts, nodes, per_node, gbps, compute_s, gpu_bytes, SEQUENCES_A_GPU)
            value = efficiency.get((pick, gbps, nodes))
            found.append(dict(job=job, micro_batch=SEQUENCES_A_GPU, nodes=nodes, gbps=gbps, mode=pick,
                              efficiency=value))
            cells.append(f"{pick} {value:.1%}" if value is not None else f"{pick}")
        lines.append(f"| auto | {gbps:g} Gb/s | " + " | ".join(cells) + " | |")
    return lines


def project(args) -> None:
    ratios = link_calibration(args.from_link)
    jobs = args.jobs.split(",")
    unknown = [job for job in jobs if job not in PROJECTED]
    if unknown:
        raise SystemExit(f"--jobs {','.join(unknown)}: choose from {', '.join(PROJECTED)}")
    rates = {name: PROJECTED[name][2] for name in jobs}
    for item in args.tokens_per_s or []:
        name, _, rate = item.partition("=")
        rates[name] = float(rate)
    needed = set(jobs) | {DERIVED[job][0] for job in jobs if rates.get(job) is None}
    facts_of = {name: model_facts(Job(name, PROJECTED[name][0], PROJECTED[name][1], SEQUENCES_A_GPU, 1))
                for name in needed}
    for job in jobs:
        if rates.get(job) is None:  # from another job's rate, by FLOPs a token
            base, factor = DERIVED[job]
            rates[job] = factor * PROJECTED[base][2] * facts_of[base].dense / facts_of[job].dense
    tokens = SEQUENCES_A_GPU * TOKENS_A_SEQUENCE
    nodes_list = [int(n) for n in args.nodes.split(",")]
    gbps_list = [float(g) for g in args.link_gbps.split(",")]
    gpu, per_node = args.gpu_gib, args.gpus_per_node
    what_if = args.what_if
    lines = ([f"What if (pipeline rows only): {what_if.describe()}", ""] if what_if.describe() else []) + [
             ("Calibration from the shaped link (bytes a node measured / the formula's): " + ", ".join(
        f"{name} {ratio:.3f}" for name, ratio in ratios.items()) + "; other modes: the formula's bytes")
             if ratios else "No shaped-link report: every mode at the formula's bytes", ""]
    result = {"calibration": ratios, "rates": rates, "rows": [], "auto": [], "what_if": what_if.describe()}
    for job in jobs:
        size, method, _, source = PROJECTED[job]
        facts = facts_of[job]
        compute_s = tokens / rates[job]
        modes = FULL_MODES if method == "full" else QLORA_MODES if method == "qlora" else LORA_MODES
        lines += [f"**{job}** ({facts.size.parameters / 1e9:.1f} B parameters, {facts.trainable / 1e6:,.0f} M "
                  f"trained): {rates[job]:,.0f} tokens/s a GPU ({source}), {tokens:,} tokens a GPU a step: "
                  f"{compute_s:.3f} s of compute", "",
                  "| mode | link | " + " | ".join(f"{n} × {per_node}" for n in nodes_list)
                  + " | GiB a GPU (state) |", "|---|---|" + "---:|" * (len(nodes_list) + 1)]
        efficiency = {}
        for name, (mode, keys, variant) in modes.items():
            ratio = ratios.get(variant, 1.0)
            pipeline = name in PIPELINE_MODES
            if pipeline and method == "qlora" and name != "qlora-pp-mb1":
                continue  # Q-LoRA's pipeline shards each stage over its node (zero3), as sharded Q-LoRA runs
            if pipeline and method == "full":  # each stage sharded inside its node as the plan shards it
                mode = stage_sharding(facts, nodes_list[0], per_node, gpu * 2**30)
            held = state_gib(method, mode, facts, nodes_list[0], per_node, nodes_list[0] if pipeline else 1)
            for gbps in gbps_list:
                cells = []
                for nodes in nodes_list:
                    # the plan shards a stage by its share of the model: more nodes, smaller stages
                    sharding = stage_sharding(facts, nodes, per_node, gpu * 2**30) if (
                        pipeline and method == "full") else mode
                    cfg = mode_config(method, sharding, keys, nodes if pipeline else 1,
                                      PIPELINE_MODES.get(name, SEQUENCES_A_GPU))
                    step = projected_step(cfg, sharding, facts, nodes, per_node,
                                          gbps / 8 * 1e9 * args.link_efficiency, compute_s, ratio, gpu * 2**30,
                                          what_if)
                    if step is None:
                        cells.append("—")  # fewer blocks than the stages need
                        continue
                    efficiency[name, gbps, nodes] = step["efficiency"]
                    result["rows"].append(dict(job=job, mode=name, nodes=nodes, gbps=gbps, state_gib=held,
                                               sharding=sharding, **step))
                    cells.append(f"{step['efficiency']:.1%}" + (f" ({sharding})" if sharding != mode else ""))
                fits = f"{held:,.0f}" + (" (does not fit)" if held > gpu else "")
                marked = name if variant in ratios or not ratios else f"{name} (formula)"
                marked += f" ({mode} inside a node)" if pipeline else ""
                lines.append(f"| {marked} | {gbps:g} Gb/s | " + " | ".join(cells) + f" | {fits} |")
        if method == "full":
            lines += auto_rows(job, facts, nodes_list, gbps_list, per_node, compute_s, gpu * 2**30, efficiency,
                               result["auto"])
        lines.append("")
    lines.append("Seed document, Qwen LoRA on A100 nodes with InfiniBand: " + ", ".join(
        f"{n} nodes {e:.0%}" for n, e in SEED_TABLE.items()))
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="full-1.5b", help=f"one of {', '.join(JOBS)}")
    p.add_argument("--from", dest="source", type=Path,
                   help="bench/two_node_speed.py's two_node_speed.json: the one-node step, the measured link and the "
                        "two-node figures to check the model against")
    p.add_argument("--compute-step-s", type=float, help="the one-node optimizer step in seconds (without --from)")
    p.add_argument("--tokens-per-step", type=float,
                   help="tokens a GPU trains an optimizer step (without --from; "
                        "default: batch x accumulation x 576, the bench's mean length)")
    p.add_argument("--gpus-per-node", type=int, help="default 2 (--from-link: 8)")
    p.add_argument("--global-batch", type=int, default=64, help="of the measured job: sets its accumulation")
    p.add_argument("--nodes", default="2,4,8,16")
    p.add_argument("--link-gbps", help="line rates a node, Gb/s (default 100,200,400; --from-link: 10,100,400)")
    p.add_argument("--link-efficiency", type=float, default=0.9)
    p.add_argument("--gpu-gib", type=float, default=141.0, help="GPU memory, for the mode auto picks")
    p.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the dtype gradients cross the network in (meshtune's grad_reduce_dtype)")
    p.add_argument("--out", type=Path, help="write the tables here (markdown) and beside it as JSON")
    p.add_argument("--project", action="store_true",
                   help="project every mode of --jobs (see above) instead of --job, at the formula's bytes where "
                        "--from-link does not calibrate them")
    p.add_argument("--from-link", type=Path,
                   help="bench/shaped_link.py's JSON: calibrate the projection's modes by what it measured (implies "
                        "--project)")
    p.add_argument("--jobs", default=",".join(PROJECTED), help=f"--project: of {', '.join(PROJECTED)}")
    p.add_argument("--what-if", metavar="LEVERS",
                   help="--project: price pipeline levers meshtune does not have, by the same simulation: "
                        "even-stages (every stage the mean stage's cost: the ranks' compute equal, as boundaries "
                        "inside blocks would nearly make it), "
                        "hop-bytes=SHARE (activations across a hop at that share of their bf16 bytes; 0.5: 8-bit), "
                        "and one of in-step (a node's pipelines kept in step, a hop all of their sends, where the "
                        "plan would stagger them) and shared-link (a node's pipelines one by one, in step, sharing "
                        "its link); comma-separated")
    p.add_argument("--tokens-per-s", action="append", metavar="JOB=RATE",
                   help="--project: a job's one-GPU tokens/s instead of the cited one")
    args = p.parse_args(argv)
    if args.what_if and not (args.from_link or args.project):
        p.error("--what-if prices the pipeline rows of --project (or --from-link)")
    try:
        args.what_if = WhatIf.parse(args.what_if)
    except ValueError as bad:
        p.error(str(bad))
    if args.from_link or args.project:
        args.link_gbps = args.link_gbps or "10,100,400"
        args.gpus_per_node = args.gpus_per_node or 8
        project(args)
        return
    args.link_gbps = args.link_gbps or "100,200,400"
    args.gpus_per_node = args.gpus_per_node or 2
    if args.job not in JOBS:
        p.error(f"--job {args.job}: choose from {', '.join(JOBS)}")
    size, method, bs = JOBS[args.job]
    job = Job(args.job, size, method, bs, accumulation_for(args.global_batch, bs, 2 * args.gpus_per_node),
              args.grad_reduce_dtype)
    measured = measured_from(args.source, args.job) if args.source else None
    compute_s = measured["compute_s"] if measured else args.compute_step_s
    if compute_s is None:
        p.error("give --from two_node_speed.json or --compute-step-s")
    tokens = measured["tokens_per_step"] / (2 * args.gpus_per_node) if measured else (
        args.tokens_per_step or bs * job.accumulation * 576)
    facts = model_facts(job)
    gpu_bytes = args.gpu_gib * 2**30
    links = {f"{gbps} Gb/s": gbps / 8 * 1e9 * args.link_efficiency for gbps in map(float, args.link_gbps.split(","))}
    for name, busbw in (measured or {}).get("busbw", {}).items():
        links = {f"measured ({name}, {busbw / 1e9:.2f} GB/s)": busbw, **links}
    result = {"job": args.job, "compute_s": compute_s, "tokens_per_gpu_step": tokens, "rows": [], "check": []}
    lines = [f"{args.job}: one-node step {compute_s:.3f} s, {tokens:,.0f} tokens a GPU a step, "
             f"{args.gpus_per_node} GPUs a node, accumulation {job.accumulation}, gradients in {job.reduce}", "",
             "| link | nodes | mode | crossing s (gather + reduce) | step s | tokens/s a GPU | efficiency | seed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, busbw in links.items():
        for nodes in [int(n) for n in args.nodes.split(",")]:
            step, mode, parts = step_seconds(job, facts, nodes, args.gpus_per_node, busbw, compute_s, gpu_bytes)
            row = dict(link=name, nodes=nodes, mode=mode, step_s=step, per_gpu=tokens / step,
                       efficiency=compute_s / step, **parts)
            result["rows"].append(row)
            seed = f"{SEED_TABLE[nodes]:.0%}" if nodes in SEED_TABLE else ""
            lines.append(f"| {name} | {nodes} | {mode} | {parts.get('gather', 0):.3f} + {parts.get('reduce', 0):.3f} | "
                         f"{step:.3f} | {tokens / step:,.0f} | {compute_s / step:.1%} | {seed} |")
    if measured:
        lines += ["", "| link | measured tokens/s a GPU | predicted | error | measured step s | predicted |",
                  "|---|---|---|---|---|---|"]
        for link, figures in measured["two_nodes"].items():
            busbw = measured["busbw"].get(link)
            if busbw is None:
                continue
            step, _, _ = step_seconds(job, facts, 2, args.gpus_per_node, busbw, compute_s, gpu_bytes)
            error = (tokens / step) / figures["per_gpu"] - 1
            result["check"].append(dict(link=link, measured=figures["per_gpu"], predicted=tokens / step, error=error))
            lines.append(f"| {link} | {figures['per_gpu']:,.0f} | {tokens / step:,.0f} | {error:+.1%} | "
                         f"{figures['step_s']:.3f} | {step:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
