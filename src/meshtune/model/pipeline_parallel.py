"""Pipeline parallel stages, as torchtitan builds them: each stage is the whole model with the blocks of the other
stages taken out, the input embedding only on the first stage, the final norm and the output head only on the last.
A process holding several stages (interleaved_1f1b, zbv) keeps one model with all of their blocks, and each stage
runs a view of it that shares those blocks. Parameter names stay those of the whole model, so a DCP checkpoint of
any layout loads on any other."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from meshtune.config import TrainConfig
from meshtune.crossing import stage_ranks
from meshtune.model.loading import model_skeleton
from meshtune.model.lora import add_lora
from meshtune.plan import RunPlan


class BlockOfAnotherStage(nn.Module):
    """Where a block of another stage was: no parameters, its input passed on unchanged, so the decoder's own
    forward runs over this stage's blocks with their indices (and names) kept."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class StageForward(nn.Module):
    """The module torch's PipelineStage runs: the first stage takes token ids, the others the previous stage's
    hidden states (as the decoder's `inputs_embeds`); the last returns logits, the others hidden states. The
    attention mask and position ids reach every stage from the schedule's keyword arguments."""

    def __init__(self, model: nn.Module, first: bool, last: bool):
        super().__init__()
        self.model = model
        self.first, self.last = first, last

    def get_base_model(self) -> nn.Module:
        """The transformers model inside, as peft's wrapper answers: where its blocks are found by their classes."""
        return causal_lm(self.model)

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        base = causal_lm(self.model)
        given = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        hidden = base.model(**given, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        if self.last:
            return base.lm_head(hidden)
        if self.first and torch.is_grad_enabled() and not hidden.requires_grad:
            # a first stage with nothing to train (LoRA's frozen embedding alone): its output marked as needing a
            # gradient, so the next stage's input does and zbv's split backward finds that stage's weights from it
            hidden.requires_grad_()
        return hidden


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside peft's wrapper (or the model itself)."""
    return getattr(model, "get_base_model", lambda: model)()


def held_stages(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages process `rank` of the pipeline holds, in order, as torch's schedule places them and the plan
    balanced them for (crossing.stage_ranks): one (gpipe, 1f1b); r, r + pp, ... (interleaved); r and 2 pp - 1 - r
    (zbv's V, so the first and the last stage are both rank 0's)."""
    return [stage for stage, holder in enumerate(stage_ranks(schedule, pp, virtual)) if holder == rank]


def keep_stages(model: nn.Module, blocks: list[tuple[int, int]], first: bool, last: bool) -> None:
    """Take out of `model`, in place, what this process's stages do not run: the blocks outside every [first, end)
    of `blocks`, the embedding unless it holds the first stage, the final norm and the head unless the last. Their
    parameters are freed."""
    base = causal_lm(model)
    decoder = base.model
    for i in range(len(decoder.layers)):
        if not any(start <= i < end for start, end in blocks):
            decoder.layers[i] = BlockOfAnotherStage()
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()
        base.lm_head = None


def held_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks `model`, cut down by keep_stages, still holds."""
    return [layer for layer in causal_lm(model).model.layers if not isinstance(layer, BlockOfAnotherStage)]


def stage_forwards(model: nn.Module, stages: list[int], blocks: list[tuple[int, int]]) -> list[StageForward]:
    """The forward of each stage in `stages` (of all `blocks`' stages) over `model`, cut down by keep_stages: the
    model itself where it is one stage, else a view of it a stage."""
    last = len(blocks) - 1
    if len(stages) == 1:
        return [StageForward(model, first=stages[0] == 0, last=stages[0] == last)]
    return [StageForward(stage_view(model, blocks[s], s == 0, s == last), first=s == 0, last=s == last)
            for s in stages]


def stage_view(model: nn.Module, blocks: tuple[int, int], first: bool, last: bool) -> nn.Module:
    """The causal LM of `model` as one of its stages sees it: new module containers over the same blocks, embedding,
    norm and head (the same parameters, trained and saved through `model`), the other blocks passed over."""
    base = causal_lm(model)
    view, decoder = shallow(base), shallow(base.model)
    view.model = decoder
    start, end = blocks
    decoder.layers = nn.ModuleList([layer if start <= i < end else BlockOfAnotherStage()
                                    for i, layer in enumerate(base.model.layers)])
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()
        view.lm_head = None
    return view


def shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` whose children, parameters and buffers are its own to replace, and the same objects."""
    copied = copy.copy(module)
    copied._modules, copied._parameters, copied._buffers = (dict(module._modules), dict(module._parameters),
                                                            dict(module._buffers))
    return copied


def gather_stage_weights(model: nn.Module, mesh: DeviceMesh, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Every stage's weights, by the whole model's names, as CPU tensors on global rank 0 (empty elsewhere): the
    first replica of each stage sends its own to the first stage's. A collective of those processes."""
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)  # FSDP2: gathered
    own = {name: tensor.detach().cpu() for name, tensor in get_model_state_dict(model, options=options).items()}
    if mesh.get_local_rank("dp") != 0:
        return {}
    first = mesh.get_local_rank("pp") == 0
    stages: list | None = [None] * mesh["pp"].size() if first else None
    dist.gather_object(own, stages, group=mesh["pp"].get_group(), group_dst=0)
    return {name: tensor for stage in stages for name, tensor in stage.items()} if first else {}


def whole_model(cfg: TrainConfig, plan: RunPlan) -> nn.Module:
    """The whole model's modules on the meta device (no weights), LoRA's included: what `save_pretrained` walks
    to name final/'s tensors (peft keeps an adapter's weights by its modules), which the stages hold between them."""
    with torch.random.fork_rng():
        model = model_skeleton(Path(cfg.model_name_or_path).expanduser(), plan.load_dtype)
        return add_lora(model, cfg) if cfg.is_lora else model
