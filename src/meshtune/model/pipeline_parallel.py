"""Pipeline parallel stages, as torchtitan builds them: each stage is the whole model with the blocks of the other
stages taken out, the input embedding only on the first stage, the final norm and the output head only on the last.
Parameter names stay those of the whole model, so a DCP checkpoint of any layout loads on any other."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtune.config import TrainConfig
from meshtune.distributed import DistEnv
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
        return base.lm_head(hidden) if self.last else hidden


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside peft's wrapper (or the model itself)."""
    return getattr(model, "get_base_model", lambda: model)()


def keep_stage(model: nn.Module, stage: int, blocks: tuple[int, int], stages: int) -> None:
    """Take out of `model`, in place, what stage `stage` of `stages` does not run: the blocks outside [first, end),
    the embedding unless first, the final norm and the head unless last. Their parameters are freed."""
    base = causal_lm(model)
    decoder = base.model
    first, end = blocks
    for i in range(len(decoder.layers)):
        if not first <= i < end:
            decoder.layers[i] = BlockOfAnotherStage()
    if stage > 0:
        decoder.embed_tokens = None
    if stage < stages - 1:
        decoder.norm = nn.Identity()
        base.lm_head = None


def pipeline_mesh(env: DistEnv, stages: int) -> DeviceMesh:
    """(pp, dp): the stages outermost, so a stage is consecutive ranks (one node's, with a stage a node) and the
    processes of one pipeline, one of each stage, are `world_size / stages` ranks apart."""
    return init_device_mesh(env.device.type, (stages, env.world_size // stages), mesh_dim_names=("pp", "dp"))


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
