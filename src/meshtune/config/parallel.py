"""Parallelism: the data-parallel mode, tensor, context and pipeline parallelism; and how gradients cross the nodes."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from meshtune.config.section import JOB, MATH, Keys, Section

PARALLELISM = Section("parallelism", JOB)
CROSS_NODE = Section("reduction across nodes: fewer bytes between the nodes (bench/shaped_link.py measures each)", JOB)


def pipeline_refusal(pipeline_parallel: int, why: str) -> str:
    """What pipeline_parallel does not combine with yet, by name with what to set."""
    return f"pipeline_parallel: {pipeline_parallel} cannot be combined with {why}"


class ParallelismKeys(Keys):
    parallel: Literal["auto", "ddp", "zero2", "zero3", "hsdp"] = PARALLELISM(
        "auto", "auto | ddp | zero2 (FSDP2, parameters kept after forward) | zero3 (FSDP2, resharded after forward) | "
                "hsdp (shard inside a node, replicate across nodes). auto: ddp for LoRA, one process and CPU; Q-LoRA "
                "on several GPUs: ddp, or zero3 where the whole 4-bit model would take over half a GPU (hsdp across "
                "nodes where a node's GPUs hold it); full fine-tuning on one node: zero2, or zero3 where zero2's whole "
                "bf16 weights plus its share of the fp32 state would take over half a GPU; on several nodes: hsdp "
                "sharded over each node's GPUs, so only the gradients' all-reduce crosses the network (zero3 over all "
                "when a node cannot hold the model's state). LoRA under zero2 runs as ddp (ZeRO-2 never shards "
                "weights; the plan says so)")
    load_weights_on: Literal["rank0", "every_rank"] = PARALLELISM(
        "rank0", "rank0: only global rank 0 reads the model files; the other processes build the model without weights "
                 "and receive rank 0's (under zero2 / zero3 / hsdp only their shard), so a node's memory holds one "
                 "copy, not one per process | every_rank: each process reads the files itself")
    cpu_offload: bool = PARALLELISM(False, "zero2 / zero3 / hsdp: FSDP2's CPUOffloadPolicy: parameters, gradients and "
                                           "optimizer state live in CPU memory and the optimizer steps on the CPU "
                                           "(DeepSpeed's offload_optimizer / offload_param): trains models whose state "
                                           "does not fit in GPU memory, several times slower")
    hsdp_shard_size: int | None = PARALLELISM(None, "hsdp: processes that shard one replica; default: the processes of "
                                                    "one node (under tensor_parallel: counted in tensor-parallel "
                                                    "groups)", gt=0)
    tensor_parallel: int = PARALLELISM(1, "processes that split each attention and MLP layer of a block between them "
                                          "(DTensor tensor parallel, Qwen2 / Qwen3 / Llama / Mistral): inside one "
                                          "node, a divisor of its processes and of the attention and key-value heads; "
                                          "the data-parallel mode (parallel) then runs over the processes / "
                                          "tensor_parallel groups. For full fine-tuning of models whose blocks crowd "
                                          "a GPU under zero3 alone; 1: off", gt=0)
    context_parallel: int = PARALLELISM(1, "processes that split every row's positions between them (torch's ring "
                                           "attention, CUDA GPUs), for samples whose activations do not fit one GPU: "
                                           "each holds 1/context_parallel of them; rows padded to a multiple of 64 x "
                                           "context_parallel. A divisor of the processes, consecutive ranks; the "
                                           "data-parallel mode shards over them too. Not with packing, padding_free "
                                           "or tensor_parallel; 1: off", gt=0)

    pipeline_parallel: int = PARALLELISM(1, "pipeline stages the model's blocks are split into (torch.distributed."
                                            "pipelining): each stage holds consecutive blocks (the embedding on the "
                                            "first, the final norm and head on the last, the blocks balanced by their "
                                            "cost and the head's) and only activations and their gradients pass "
                                            "between stages. Outermost in the mesh: with one stage a node, only "
                                            "activations cross the nodes. A divisor of the processes; each stage's "
                                            "processes are data-parallel (ddp, zero2 or zero3); every optimizer step's "
                                            "micro-batches (gradient_accumulation_steps) are the schedule's. Full, "
                                            "LoRA and Q-LoRA (each process quantizing only its stages' blocks), "
                                            "stage: sft and pt; 1: off", gt=0)
    pipeline_schedule: Literal["auto", "gpipe", "1f1b", "interleaved_1f1b", "zbv"] = PARALLELISM(
        "auto", "pipeline_parallel's schedule (torch's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B / "
                "ScheduleZBVZeroBubble): gpipe runs every micro-batch's forward, then every backward; 1f1b alternates "
                "them once the pipeline is full, so a stage holds the activations of at most pipeline_parallel "
                "micro-batches, not all of them; interleaved_1f1b gives each process pipeline_virtual_stages "
                "stages (r, r + pipeline_parallel, ...), a smaller bubble for more sends; zbv two stages a process in "
                "a V (r and 2 x pipeline_parallel - 1 - r), backward split into its input's and its weights' "
                "gradients to fill the bubble. auto: 1f1b where the step has at least pipeline_parallel "
                "micro-batches, else gpipe")
    pipeline_virtual_stages: int | None = PARALLELISM(
        None, "stages each process holds under pipeline_schedule: interleaved_1f1b (2 or more; unset: 2); zbv holds "
              "2, gpipe and 1f1b 1", gt=0)
    pipeline_row_micro_batches: bool | None = PARALLELISM(
        None, "the schedule's micro-batches: true, each row of a step's micro-steps one (per_device_train_batch_size "
              "x gradient_accumulation_steps of them, a smaller bubble for smaller sends); false, each micro-step's "
              "rows one; unset: false, or where parallel: auto chooses a pipeline by link_gbps, what it predicts "
              "faster. The same rows and loss either way")
    pipeline_stagger: Literal["auto"] | bool = PARALLELISM(
        "auto", "a pipeline across nodes with data parallelism inside each stage: a node's processes are that many "
                "pipelines sharing the node's link. true: they start each training step in turn, one micro-batch's "
                "activations at link_gbps apart, so each crosses the link alone and the next pipeline's crossing "
                "overlaps this one's compute; false: together; auto: on GPUs, in turn where the plan predicts that "
                "shorter from link_gbps (off without it, and on CPU nodes, where it measured slower). Needs "
                "link_gbps to time a hop; not with zero3 inside the stages (its weight gathers at every micro-batch "
                "put the pipelines back in step). Timing only: the losses are the same")

    @model_validator(mode="after")
    def _check_layout(self) -> "ParallelismKeys":
        if self.cpu_offload and self.parallel not in ("zero2", "zero3", "hsdp"):
            raise ValueError(f"cpu_offload: true needs a sharded mode (parallel: zero2, zero3 or hsdp), not parallel: "
                             f"{self.parallel}: the offload is FSDP2's; set parallel: zero3 (the least GPU memory)")
        if self.pipeline_parallel > 1:
            self._check_pipeline()
        return self

    def _check_pipeline(self) -> None:
        """The layouts a pipeline's stages run under (config/rules.py refuses what other sections' keys ask)."""
        pp = self.pipeline_parallel
        if self.tensor_parallel > 1 or self.context_parallel > 1:
            raise ValueError(pipeline_refusal(pp, "tensor_parallel or context_parallel above 1 (a stage's processes "
                                                  "are data-parallel only): set both to 1, or pipeline_parallel: 1"))
        self._check_pipeline_stages()
        if self.parallel == "hsdp" or self.cpu_offload:
            raise ValueError(f"pipeline_parallel: {pp} with {'cpu_offload' if self.cpu_offload else 'parallel: hsdp'}"
                             f": a stage's processes are its replicas (ddp) or shard it over all of them (zero2, "
                             f"zero3), with the stages across the nodes; set parallel: ddp, zero2 or zero3")

    def _check_pipeline_stages(self) -> None:
        """The stages a process holds against the schedule: interleaved_1f1b 2 or more, zbv its V of 2, gpipe and
        1f1b one (auto among them); zbv's split backward and what it does not run under."""
        virtual, schedule = self.pipeline_virtual_stages, self.pipeline_schedule
        if virtual is None:
            return
        if schedule == "interleaved_1f1b" and virtual < 2:
            raise ValueError(f"pipeline_virtual_stages: {virtual} under pipeline_schedule: interleaved_1f1b, which "
                             f"interleaves several stages a process: set 2 or more, or pipeline_schedule: 1f1b")
        if schedule == "zbv" and virtual != 2:
            raise ValueError(f"pipeline_virtual_stages: {virtual} under pipeline_schedule: zbv, whose V holds 2 "
                             f"stages a process: set 2 or leave it unset, or use pipeline_schedule: interleaved_1f1b")
        if schedule in ("auto", "gpipe", "1f1b") and virtual != 1:
            raise ValueError(f"pipeline_virtual_stages: {virtual} with pipeline_schedule: {schedule}, which runs one "
                             f"stage a process: use pipeline_schedule: interleaved_1f1b, or leave it unset")

    @property
    def named_parallel(self) -> str | None:
        """parallel, or None (auto): the run plan chooses the mode (plan.parallel_for)."""
        return None if self.parallel == "auto" else self.parallel


class CrossNodeKeys(Keys):
    zero3_reshard_to_node: bool = CROSS_NODE(
        False, "parallel zero3 on several nodes: after forward each unit's weights are resharded to the processes of "
               "one node, not to all (FSDP2's reshard_after_forward = processes a node, ZeRO++'s hierarchical "
               "partitioning), so backward's all-gathers stay inside the node and only forward's cross the network: "
               "a third fewer bytes between nodes a micro-step. The math is unchanged (the same losses bit for bit); "
               "each process holds 1/(processes a node) of a unit's weights between its forward and backward, not "
               "1/(all processes)")
    powersgd_rank: int = CROSS_NODE(
        0, "parallel ddp on several processes: gradients cross as PowerSGD's rank-r factors (torch's powerSGD_hook, "
           "error feedback and warm start on; the first optimizer step all-reduced whole), a matrix of m x n in "
           "(m + n) x r numbers; tensors it would not shrink 2x cross whole. Approximate: the update differs from "
           "the exact one, and the error-feedback state is not checkpointed, so a resume restarts it. Measured on "
           "the demo task (`meshtune demo`: LoRA r 8, 2 processes, 180 steps), rank 1 learns slower: eval loss "
           "0.200 / 0.130 / 0.099 at steps 60 / 120 / 180 against the exact run's 0.113 / 0.0091 / 0.0076; rank 4 "
           "compresses none of its 8 x 128 adapters (under 2x) and matches the exact run. Over the first steps the "
           "losses stay within 2% of the exact ones (tested). Measure yours before relying on it. 0: off (exact "
           "all-reduce)", ge=0, scope=MATH)
    link_gbps: float | None = CROSS_NODE(
        None, "the line rate between the nodes, Gb/s a node (100 for 100 GbE). With parallel: auto, full fine-tuning "
              "and several nodes, the plan then picks among hsdp, zero2, zero3 and pipeline parallel across the nodes "
              "(a stage a node) the mode whose predicted step exposes the least time on the link, taking the "
              "all-reduce's bus bandwidth as 90% of this rate and a GPU's compute as 40% of its measured bf16 matmul "
              "rate (on CPU nodes: ddp or a stage a node, a process's compute at 50% of the fp32 matmul rate the "
              "processes measure together, gloo's traffic not hidden); run_plan.json gives the choice, the reason and "
              "every mode's predicted per-GPU efficiency. Under a pipeline across nodes it also times "
              "pipeline_stagger. "
              "`meshtune doctor --bandwidth` measures the link's busbw (GB/s): its x 8 / 0.9 is this rate. It changes "
              "no math. Default: unset, the rules of docs/multi-node/choosing-parallel.md", gt=0.0)
    hsdp_replica_reduce_dtype: Literal["fp32", "bf16"] | None = CROSS_NODE(
        None, "parallel hsdp: the dtype of the gradients' all-reduce across the replicas (the nodes), apart from the "
              "reduce-scatter inside a node. Only grad_reduce_dtype's value is accepted: torch's FSDP2 "
              "(MixedPrecisionPolicy.reduce_dtype) reduces both in one dtype, the all-reduce running on the "
              "reduce-scatter's output. Default: grad_reduce_dtype")
