"""LoRA's dropout with counter-based masks (`lora_dropout_masks: counter`): each element is kept or dropped by a
hash of a seed and its position, not by a draw from torch's random state inside the block.

Why: a recomputed block's checkpoint inside its compiled forward (model/recompute.py) replays the forward's random
draws in the backward graph, which torch 2.11 cannot partition on CUDA; with torch's dropout such blocks keep the
checkpoint in their call and run their compiled forward twice a step. With counter masks the only draw is the
block's seed, taken before the checkpoint (a forward pre-hook), so the checkpointed forward is a pure function of
its inputs: the recompute rebuilds the same masks, and the backward needs no saved mask at all.

The masks are statistically those of torch's dropout (each element kept with probability 1 - p, independently,
scaled by 1 / (1 - p)), drawn from another stream: the same seed gives other masks than `torch.nn.Dropout`. The
seeds come from torch's generator, so a run is as reproducible, and resumes as exactly, as with torch's dropout.
"""

from __future__ import annotations

import torch

from meshtune.model.loading import transformer_blocks

MASK_BITS = 24  # of each hash compared against p: drop probabilities in steps of 2^-24
# splitmix64's constants as signed 64-bit integers (torch has no uint64 arithmetic on every backend)
GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
MIX_1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
MIX_2 = -7723592293110705685  # 0x94D049BB133111EB
SALT = 0x632BE59BD9B4E019  # spreads the dropout layers of one block apart


def shifted_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def as_int64(value: int) -> int:
    """A Python integer wrapped to a signed 64-bit one, as int64 arithmetic would leave it."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def mixed(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: every output bit depends on every input bit (int64, wrapping multiplication)."""
    values = (values ^ shifted_right(values, 30)) * MIX_1
    values = (values ^ shifted_right(values, 27)) * MIX_2
    return values ^ shifted_right(values, 31)


def salt_bits(salt: int) -> int:
    """A dropout layer's number `salt` spread over 64 bits (computed once, outside the compiled graph: a Python
    integer traced as a dynamic size would make the wrap a symbolic expression inductor cannot print)."""
    return as_int64(salt * SALT)


def keep_mask(like: torch.Tensor, seed: torch.Tensor, salt: int, p: float) -> torch.Tensor:
    """Whether each element of `like` is kept: hash(seed, salt, position) >= p, in its low MASK_BITS bits. `seed`: a
    0-dimensional int64 tensor on `like`'s device; `salt`: a layer's `salt_bits`."""
    position = torch.arange(like.numel(), device=like.device, dtype=torch.int64).view(like.shape)
    # the seed first: the compiler then knows no bounds of the products to fold (position x GOLDEN alone overflows
    # its int64 range analysis); the wrapping arithmetic is the same
    values = mixed((position + (seed ^ salt)) * GOLDEN)
    return (values & ((1 << MASK_BITS) - 1)) >= round(p * (1 << MASK_BITS))  # the low bits: mixed as well as the high


def new_seed(device: torch.device) -> torch.Tensor:
    return torch.randint(-(2**62), 2**62, (), device=device, dtype=torch.int64)


class BlockSeed:
    """The seed a block's counter dropouts share for one forward: drawn by the block's pre-hook, before its
    checkpoint, and handed to the checkpointed forward as an input (`run`), so that the recompute, whenever it
    comes (a pipeline schedule runs other micro-batches' forwards first), rebuilds that forward's masks."""

    def __init__(self):
        self.seed: torch.Tensor | None = None

    def run(self, forward, block: torch.nn.Module, seed: torch.Tensor, *args, **kwargs):
        """`forward(block, *args, **kwargs)` with `seed` as the block's seed (model/recompute.py checkpoints this)."""
        previous, self.seed = self.seed, seed
        try:
            return forward(block, *args, **kwargs)
        finally:
            self.seed = previous


class CounterDropout(torch.nn.Module):
    """Dropout with counter-based masks; identity in eval or with p = 0. No parameters or buffers: a model's state
    dict, its adapters and their export are those of torch's dropout."""

    def __init__(self, p: float, salt: int, block_seed: BlockSeed | None = None):
        super().__init__()
        self.p, self.salt, self.block_seed = p, salt_bits(salt), block_seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = self.block_seed.seed if self.block_seed is not None else None
        if seed is None:  # outside a block (no pre-hook): a draw of its own
            seed = new_seed(x.device)
        return x * keep_mask(x, seed, self.salt, self.p).to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, counter masks"


def use_counter_dropout(model: torch.nn.Module) -> int:
    """Replace every LoRA layer's dropout (peft's `lora_dropout`, torch.nn.Dropout with p > 0) with counter masks,
    each block's layers sharing one seed drawn by a pre-hook at each of its forwards. Returns how many.

    A block's dropouts are numbered (their salts) alike in every block: the seeds already set blocks apart, and
    dynamo guards on a module's integer attributes, so salts that differ from block to block would compile a graph
    for each block and, past its recompile limit, leave the later blocks uncompiled."""
    numbered: dict[int, int] = {}  # dropouts so far, by the BlockSeed they share (id(None): those outside blocks)
    in_block: dict[int, BlockSeed] = {}
    for block in transformer_blocks(model):
        block_seed = block.counter_seed = BlockSeed()
        block.register_forward_pre_hook(seeding(block_seed), with_kwargs=True)
        in_block.update({id(module): block_seed for module in block.modules()})
    for module in list(model.modules()):
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, dropout in dropouts.items():
            if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
                block_seed = in_block.get(id(module))
                numbered[id(block_seed)] = salt = numbered.get(id(block_seed), 0) + 1
                dropouts[name] = CounterDropout(dropout.p, salt, block_seed)
    return sum(numbered.values())


def seeding(block_seed: BlockSeed):
    def draw(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training:  # as torch's dropout draws in training, with or without gradients
            hidden = args[0] if args else kwargs.get("hidden_states")
            block_seed.seed = new_seed(hidden.device)
    return draw
