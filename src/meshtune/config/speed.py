"""Speed: each lever on where it pays, and off to compare or debug; the math stays the same."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import field_validator

from meshtune.config.section import JOB, NODE, Keys, Section

SPEED = Section("speed: each lever is on where it pays and can be turned off to compare or debug; "
                "the math stays the same", JOB)


class SpeedKeys(Keys):
    padding_free: bool | None = SPEED(None, "the samples of a micro-batch end to end in one row, attended by torch's "
                                            "variable-length flash attention: no padding, no attention across samples; "
                                            "micro-batches then hold equal token counts rather than equal sample "
                                            "counts (stage: dpo: a micro-batch's pairs, both responses of each, in "
                                            "one row). Default: on with CUDA; elsewhere off (it works there too, one "
                                            "attention call per sample)")
    fused_loss: bool = SPEED(True, "the output head and cross-entropy in row chunks over target positions only: the "
                                   "full-vocabulary logits are never stored (stage: dpo: each response's summed "
                                   "log-prob the same way; off for kto). Turn off to compare with the plain "
                                   "F.cross_entropy path")
    torch_compile: bool | None = SPEED(None, "torch.compile every transformer block and the fused loss. Default: on "
                                             "with CUDA (the first steps then include compilation); turn off to debug")
    optim: Literal["auto", "adamw_torch", "adamw_torch_fused"] = SPEED(
        "auto", "auto (fused AdamW on CUDA) | adamw_torch | adamw_torch_fused")
    grad_sync: Literal["ddp", "flat"] = SPEED("ddp", "parallel ddp on several processes: ddp (DistributedDataParallel: "
                                                     "gradients all-reduced in buckets during backward) | flat (no "
                                                     "wrapper: one all-reduce of all gradients after backward; can be "
                                                     "faster for small trainable sets such as LoRA)")
    ddp_bucket_cap_mb: float | None = SPEED(None, "parallel ddp: MB of gradients DDP all-reduces at once, as HF's "
                                                  "TrainingArguments; larger buckets mean fewer collectives, each "
                                                  "starting later in backward. Default: torch's 25", gt=0)
    fsdp_blocks_per_unit: int | None = SPEED(None, "zero2 / zero3 / hsdp: consecutive transformer blocks sharded as "
                                                   "one FSDP2 unit. More blocks a unit: fewer, larger collectives and "
                                                   "fewer host hooks each step, at the memory of gathering them at "
                                                   "once. Default: as many as keep a unit within about 1B parameters, "
                                                   "at most 4; lower it if zero3 runs out of memory", ge=1)
    fsdp_prefetch: int = SPEED(0, "zero2 / zero3 / hsdp: blocks whose parameters are gathered explicitly ahead of use "
                                  "in forward and backward (0 = FSDP2's own implicit prefetching, usually "
                                  "as fast)", ge=0)
    expandable_segments: bool = SPEED(True, "CUDA: the caching allocator grows its segments instead of allocating new "
                                            "ones (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): no fragmentation "
                                            "retries when large units are gathered and freed. A "
                                            "PYTORCH_CUDA_ALLOC_CONF you set yourself is left as it is", scope=NODE)
    gc_interval: int | None = SPEED(None, "Python's garbage collection every N optimizer steps, on all ranks at the "
                                          "same step and never in between, so no rank stalls the others at a "
                                          "collective while it collects. 0 = Python's automatic collection. Default: "
                                          "50 with several processes, 0 with one", ge=0, scope=NODE)
    activation_memory_budget: float = SPEED(1.0, "torch_compile: the share of a compiled block's activations its "
                                                 "backward may keep (torch's partitioner budget). Below 1 the compiler "
                                                 "recomputes the operators that free the most memory for the least "
                                                 "time inside the block's own backward (matmul outputs last), instead "
                                                 "of recomputing whole blocks: a finer trade than "
                                                 "gradient_checkpointing_ratio for the blocks that are not "
                                                 "recomputed", gt=0.0, le=1.0)
    compile_combo_kernels: bool = SPEED(False, "torch_compile on CUDA: inductor's combo kernels, which launch "
                                               "independent small kernels of a block as one (the adapters' bf16 casts "
                                               "in forward, their fp32 gradients in backward): fewer launches where "
                                               "the host, not the GPU, sets the pace (LoRA with every block "
                                               "recomputed). The math is unchanged; Triton only, so CPU runs ignore it")
    cpu_affinity: Literal["auto", "none", "node", "exclusive"] = SPEED(
        "auto", "CUDA workers pinned to host CPUs: node (the CPUs of their GPU's NUMA node) | exclusive (a disjoint "
                "share of those CPUs for each process of the node, whole physical cores, so no two processes' host "
                "work competes for a core) | none. auto: node where the system tells the GPU's NUMA node, else nothing "
                "(exclusive is yours to try: on one-socket machines it only keeps processes off each "
                "other's cores)", scope=NODE)
    profile_steps: str | None = SPEED(None, "profile optimizer steps FIRST-LAST (e.g. 10-12) with torch.profiler: a "
                                            "Chrome trace per rank and rank 0's costliest operators in "
                                            "output_dir/profile/", scope=NODE)

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value)
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
        if not match or int(match.group(1)) < 1 or int(match.group(2) or match.group(1)) < int(match.group(1)):
            raise ValueError(f"'{text}' is not FIRST-LAST with 1 <= FIRST <= LAST (optimizer steps, e.g. 10-12)")
        return text

    @property
    def cpu_pinning(self) -> str:
        """cpu_affinity as applied: auto pins as node does (exclusive is unmeasured, so auto only keeps a worker near
        its GPU)."""
        return "node" if self.cpu_affinity == "auto" else self.cpu_affinity
