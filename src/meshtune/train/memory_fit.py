"""`gradient_checkpointing_ratio: auto`: the fewest recomputed blocks whose step fits `memory_budget`, from steps
measured before training rather than from a guess.

The run's largest micro-batch (the most tokens this rank will ever see at once) goes forward and backward three
times, without an optimizer step: once to compile and warm the allocator, once with every block recomputed, once
with one block keeping its activations. The peak of the second gives the fixed part of a step (weights, gradients,
the optimizer state still to be allocated, the loss head, one block's recompute); the memory held when the forward
ends, third against second, gives what each kept block adds. As many blocks as fit under the budget keep their
activations, spread evenly, the same on every rank (the largest figures of all ranks decide). Gradients are
dropped and the random state put back afterwards, so the run trains exactly as it would with that ratio set by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtune.data.sampler import GlobalBatchPlan, Row
from meshtune.distributed import all_reduce_max
from meshtune.errors import MemoryFitError
from meshtune.hardware import smallest_gpu_memory
from meshtune.model.loading import transformer_blocks
from meshtune.model.parallel import finish_gradient_sync, unwrap
from meshtune.model.recompute import recompute_blocks
from meshtune.train.objectives import Objective, normalised

GIB = 2**30
DEFAULT_SHARE = 0.9  # of the card: CUDA's context, NCCL's buffers and the allocator's cache live outside the count
HEADROOM = 0.03  # of the budget: allocator rounding, and steps that differ from the measured one in ways not modelled
CONTEXT_BYTES = 0.5 * GIB  # of the card outside the allocator: CUDA's context with cuBLAS's and kernels' memory
NCCL_BYTES = 0.5 * GIB  # outside the allocator too where processes talk over NCCL: its channels' buffers


@dataclass
class MemoryFit:
    blocks: int
    kept: int  # blocks that keep their activations; the others are recomputed
    peak_all: float  # bytes of a step with every block recomputed, the optimizer state to come included
    per_block: float  # bytes each kept block adds
    budget: float
    tokens: int  # of the measured micro-batch
    cached_all: float = 0.0  # bytes the allocator held beyond its peak allocation in the step measured
    card: float = 0.0  # bytes of the smallest card (or gpu_memory_limit), where the budget is the default share
    outside: float = CONTEXT_BYTES  # bytes of the card the allocator never sees (CUDA's context, NCCL's buffers)

    @property
    def ratio(self) -> float:
        return (self.blocks - self.kept) / self.blocks

    def describe(self) -> str:
        gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        # what the allocator caches besides its allocations needs the card too, but is not counted in the budget
        cached = f"; the allocator held {gib(self.cached_all)} more at its peak" if self.cached_all else ""
        fits = self.peak_all <= self.budget  # a kept block is measured only then
        kept = f", and each block kept holds {gib(self.per_block)} of activations" if fits else ""
        head = (f"gradient_checkpointing_ratio auto: a step of the largest micro-batch ({self.tokens:,} tokens) takes "
                f"{gib(self.peak_all)} with every block recomputed{kept}{cached}; memory_budget {gib(self.budget)}"
                + (f" (the default, {DEFAULT_SHARE:.0%} of the card's {gib(self.card)})" if self.card else ""))
        if not fits and self.trains_on_the_card():
            return (f"{head}: over the default share, but the card has room for it -> every block recomputed (ratio "
                    f"1.00), {gib(self.spare_on_the_card())} of the card left beside the allocator's cache for what "
                    f"it never sees (CUDA's context{', NCCL' if self.outside > CONTEXT_BYTES else ''}); a kept block "
                    f"would not fit")
        if not fits:
            return (f"{head}: it does not fit even with every block recomputed. {self.room_on_the_card()}Lower "
                    f"per_device_train_batch_size (with more gradient_accumulation_steps for the same global batch) "
                    f"or cutoff_len, shard more (parallel: zero3, more GPUs), or raise memory_budget if the card has "
                    f"room")
        return (f"{head} -> {self.blocks - self.kept} of {self.blocks} blocks recomputed (ratio "
                f"{self.ratio:.2f}), step peak at most about {gib(self.peak_all + self.kept * self.per_block)}")

    def needed_budget(self) -> float:
        """GiB of memory_budget that fits the step with every block recomputed, the fit's headroom included (rounded
        up to a tenth, as a key's value)."""
        return math.ceil(self.peak_all / (1 - HEADROOM) / GIB * 10) / 10

    def spare_on_the_card(self, budget: float | None = None) -> float:
        """Bytes of the card left beside `budget` bytes (the step with every block recomputed and the fit's headroom)
        and the allocator's cache; 0 where the budget was set."""
        budget = self.peak_all / (1 - HEADROOM) if budget is None else budget
        return self.card - budget - self.cached_all if self.card else 0.0

    def trains_on_the_card(self) -> bool:
        """The default share is only a default: a step that fits the card itself with every block recomputed, what
        the allocator never sees still left free, trains (a 32B model's Q-LoRA on a 24 GiB card is such a step)."""
        return bool(self.card) and self.spare_on_the_card() >= self.outside

    def room_on_the_card(self) -> str:
        """Where only the default share refused the step but the card is short of what the allocator never sees:
        the memory_budget that trains it, if CUDA's context alone would fit beside it."""
        spare = self.spare_on_the_card(self.needed_budget() * GIB)
        if not self.card or spare < CONTEXT_BYTES:
            return ""
        return (f"The card has room for it: memory_budget: {self.needed_budget():g} trains it with every block "
                f"recomputed, {spare / GIB:.2f} GiB of the card left beside the allocator's cache for CUDA's context "
                f"(the default share keeps {1 - DEFAULT_SHARE:.0%} for it, NCCL's buffers and the cache). Else ")


def budget_bytes(memory_budget: float | None, card: float) -> float:
    """memory_budget in bytes: GiB above 1, a share of `card` at 1 or below."""
    if memory_budget is None:
        return DEFAULT_SHARE * card
    return memory_budget * card if memory_budget <= 1 else memory_budget * GIB


def blocks_to_keep(peak_all: float, per_block: float, budget: float, blocks: int) -> int:
    """How many blocks may keep their activations: the room under the budget (less the headroom) over what one
    adds. A block that adds nothing measurable costs nothing to keep."""
    room = budget * (1 - HEADROOM) - peak_all
    if room <= 0:
        return 0
    if per_block <= 0:
        return blocks
    return min(blocks, int(room // per_block))


def largest_micro_batch(batches: GlobalBatchPlan, start: int, total: int, rank: int, padding_free: bool
                        ) -> list[Row]:
    """This rank's micro-batch with the most tokens over steps start..total-1 (padded: rows x longest row); empty
    when no step is left (a run resumed at its end)."""
    largest, size_of_largest = [], -1
    for step in range(start, total):
        epoch, in_epoch = batches.position(step)
        for rows in batches.micro_batches(epoch, in_epoch, rank):
            if not rows:
                continue
            lengths = [batches.row_length(row) for row in rows]
            size = sum(lengths) if padding_free else len(rows) * max(lengths)
            if size > size_of_largest:
                largest, size_of_largest = rows, size
    return largest


def pending_optimizer_bytes(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> int:
    """AdamW's two moments, allocated at its first step: nothing once they exist (a resumed run)."""
    if optimizer.state:
        return 0
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
    return sum(2 * local(p).numel() * local(p).element_size() for p in params)


def allocated(device: torch.device) -> float:
    """Bytes the caching allocator has handed out on `device` (host-side bookkeeping: no sync)."""
    return float(torch.cuda.memory_allocated(device))


def measured(step: Callable[[], float], device: torch.device) -> tuple[float, float]:
    """(peak bytes allocated on `device` while `step` runs, what `step` returns: the bytes held when its forward
    ended, activations saved for backward included)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = step()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device)), held


def cached_beyond_allocated(device: torch.device) -> float:
    """Bytes the caching allocator held past its peak allocation since the peaks were last reset: memory the card
    must also have, which the budget (counted as allocated) does not see."""
    if device.type != "cuda":
        return 0.0
    return max(float(torch.cuda.max_memory_reserved(device) - torch.cuda.max_memory_allocated(device)), 0.0)


def can_measure(device: torch.device) -> bool:
    return device.type == "cuda"


def largest_over_ranks(value: float, device: torch.device) -> float:
    return all_reduce_max(torch.tensor(value, dtype=torch.float64, device=device)).item()


class RandomState:
    """torch's CPU and device generators, put back after the measured steps (dropout draws from them)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def fit_recomputation(model: torch.nn.Module, step: Callable[[], float], pending_bytes: int, budget: float,
                      tokens: int, device: torch.device) -> MemoryFit:
    """Measure `step` (forward and backward of the largest micro-batch, gradients dropped; it returns the bytes
    held when its forward ended) and recompute the fewest blocks that fit `budget`. Every rank calls it: the steps
    hold the data-parallel collectives.

    A kept block's cost is what it holds at the end of forward, not the difference of two peaks: where the peak
    lies elsewhere (full fine-tuning: in backward, with every gradient allocated), one kept block may not move it,
    yet 28 would. The fixed part plus that cost per kept block bounds the step's peak from above."""
    model = unwrap(model)  # DDP's wrapper holds the blocks one level down; the steps still run through it
    blocks = len(transformer_blocks(model))
    random_state = RandomState(device)
    try:
        recompute_blocks(model, blocks)
        measured(step, device)  # compiles, and warms the allocator
        peak, held_all = measured(step, device)
        cached_all = largest_over_ranks(cached_beyond_allocated(device), device)
        peak_all = largest_over_ranks(peak + pending_bytes, device)
        kept, per_block = 0, 0.0
        if peak_all < budget:  # the same decision on every rank: below it, one kept block would not fit anyway
            recompute_blocks(model, blocks - 1)
            _, held_one = measured(step, device)
            per_block = max(largest_over_ranks(held_one - held_all, device), 0.0)
            kept = blocks_to_keep(peak_all, per_block, budget, blocks)
    finally:
        random_state.restore()
    recompute_blocks(model, blocks - kept)
    return MemoryFit(blocks, kept, peak_all, per_block, budget, tokens, cached_all)


def fit_run_to_memory(model: torch.nn.Module, objective: Objective, params: list[torch.nn.Parameter],
                      optimizer: torch.optim.Optimizer, largest: Callable[[], list[Row]],
                      to_batch: Callable[[list[Row]], object], memory_budget: float | None,
                      gpu_memory_limit: float | None, device: torch.device,
                      split: Callable = nullcontext, more_room: str = "") -> tuple[float, str]:
    """Choose the recomputed blocks of an `auto` run (the model in train mode); returns the share of blocks
    recomputed, as gradient_checkpointing_ratio would set it, and the line to log (the run plan's reason).
    `largest()` finds the run's largest micro-batch (`largest_micro_batch`, a scan of the steps left, done only
    where memory is measured), which `to_batch` collates. Every rank has one, or none, alike: a run's steps are the
    same on every rank. `split(batch)`: the context giving this process's share of it (context parallel).
    `more_room`: what else would make room, said where nothing fits."""
    if not can_measure(device):
        return 1.0, "gradient_checkpointing_ratio auto: every block recomputed (memory is measured on GPUs only)"
    largest_rows = largest()
    if not largest_rows:
        return 1.0, "gradient_checkpointing_ratio auto: no step left to train; every block recomputed"
    batch = to_batch(largest_rows).to(device)

    def step() -> float:
        with split(batch) as local:
            loss = objective.loss_sum(local)
            held = allocated(device)  # the saved activations are all alive here
            normalised(loss, objective.count(batch)).backward()
        finish_gradient_sync(model)
        for p in params:
            p.grad = None
        return held

    # the smallest card of the job, or gpu_memory_limit where lower: one budget for every rank (a collective)
    card = smallest_gpu_memory(device, gpu_memory_limit)
    budget = budget_bytes(memory_budget, card)
    fit = fit_recomputation(model, step, pending_optimizer_bytes(optimizer, params), budget, batch.num_tokens, device)
    if memory_budget is None:
        fit.card = card  # the default share may give way to the card's own room
        fit.outside = CONTEXT_BYTES + (NCCL_BYTES if talks_over_nccl() else 0.0)
    # the same on every rank (the largest figures decide): all train, or all stop before step 1
    if fit.peak_all > fit.budget and not fit.trains_on_the_card():
        raise MemoryFitError(fit.describe() + more_room)
    return fit.ratio, fit.describe()


def talks_over_nccl() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "nccl"
