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
- the gradients cross once an optimizer step, during its last micro-step's backward (about 2/3 of a micro-step's
  compute); what does not fit that window is exposed, and at least the last unit's share always is (it starts when
  backward ends). The weights' gathers overlap the rest of the step.

Link speeds: the bus bandwidth the doctor measured between the simulated nodes (--from), and line rates of
--link-gbps (Gb/s a node) at --link-efficiency of the line rate (what NCCL's all-reduce reaches on a healthy
network; an assumption, not a measurement).

  python bench/scaling_model.py --from results/two_node_speed.json --job full-1.5b
  python bench/scaling_model.py --job lora-7b --compute-step-s 1.9 --gpus-per-node 8 --global-batch 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_node_speed import JOBS, accumulation_for  # noqa: E402

SEED_TABLE = {2: 0.95, 4: 0.88, 8: 0.80}  # per-GPU efficiency a seed document gives for Qwen LoRA on A100 nodes
BACKWARD_SHARE = 2 / 3  # of a micro-step's compute: backward is about twice forward's FLOPs


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
                     len(blocks))
    trainable = size.parameters
    if job.method != "full":
        trainable = sum(p.numel() for p in add_lora(model, job_config(job, "auto")).parameters() if p.requires_grad)
    return ModelFacts(size, trainable, counter.dense_params, counter.layers, counter.heads * counter.head_dim)


def step_seconds(job: Job, facts, nodes: int, per_node: int, busbw: float, compute_s: float,
                 gpu_bytes: float) -> tuple[float, str, dict]:
    """The modelled optimizer step on `nodes` nodes, the mode auto picks there, and the parts of the step."""
    from meshtune.doctor.traffic import collective_seconds, parallel_mode, step_collectives
    from meshtune.plan import default_blocks_per_unit

    cfg = job_config(job, "auto")
    mode, _ = parallel_mode(cfg, nodes * per_node, per_node, True, gpu_bytes, facts.size)
    if nodes == 1:
        return compute_s, mode, {"compute": compute_s}
    crossing = step_collectives(cfg, mode, facts, True, True, nodes * per_node, gpu_bytes)
    gathers = [c for c in crossing if c.kind == "all-gather"]
    reductions = [c for c in crossing if c.kind != "all-gather"]
    gather_s = collective_seconds(gathers, busbw, nodes)
    reduce_s = collective_seconds(reductions, busbw, nodes)
    units = max(1, facts.size.blocks // default_blocks_per_unit(facts.size.block_parameters))
    window = BACKWARD_SHARE * compute_s / job.accumulation
    exposed_reduce = max(reduce_s / units, reduce_s - window)
    exposed_gather = max(0.0, gather_s - (compute_s - window))
    parts = {"compute": compute_s, "reduce": reduce_s, "gather": gather_s, "exposed": exposed_reduce + exposed_gather}
    return compute_s + exposed_reduce + exposed_gather, mode, parts


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
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=64, help="of the measured job: sets its accumulation")
    p.add_argument("--nodes", default="2,4,8,16")
    p.add_argument("--link-gbps", default="100,200,400", help="line rates a node, Gb/s")
    p.add_argument("--link-efficiency", type=float, default=0.9)
    p.add_argument("--gpu-gib", type=float, default=141.0, help="GPU memory, for the mode auto picks")
    p.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the dtype gradients cross the network in (meshtune's grad_reduce_dtype)")
    p.add_argument("--out", type=Path, help="write the tables here (markdown) and beside it as JSON")
    args = p.parse_args(argv)
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
