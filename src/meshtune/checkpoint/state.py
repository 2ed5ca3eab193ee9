"""What a checkpoint holds, as DCP `Stateful` objects, so one `dcp.save` writes it all and `dcp.load` reshards it.

Keys in the checkpoint (DCP flattens nested dicts with dots):
  model_optim.model.*   model (or, trainable_only, adapter) weights: sharded DTensors under FSDP2, plain otherwise
  model_optim.optim.*   optimizer state keyed by parameter name, so it follows the weights across world sizes
  scheduler.*           the LR scheduler's own state_dict
  trainer.json          the loop's counters (`TrainingProgress`) as one JSON string
  rng.rank_{r}          rank r's random streams, one opaque blob per rank
"""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from meshtune.checkpoint.manifest import CheckpointError


class ModelOptimizerState(Stateful):
    """Model and optimizer through `get_state_dict` / `set_state_dict`: names without DDP's `module.` prefix and
    FSDP2 shards as DTensors, so a checkpoint moves between DDP, FSDP2, a bare module and any world size.

    `trainable_only` (LoRA) saves only parameters with requires_grad and their optimizer state; the frozen base
    comes from the model directory again on resume.

    `by_name` (pipeline stages, each holding other parameters): the optimizer's param groups are saved by parameter
    name too (torch's flattened optimizer state dict), not as a list of groups each naming its parameters, which
    DCP would keep from one rank only. A checkpoint is read in the form it was written (`reading_by_name`, set by
    the manager from its keys), so either form resumes on any layout.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool,
                 by_name: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.trainable_only = trainable_only
        self.by_name = by_name
        self.reading_by_name: bool | None = None  # None: as this run writes

    @property
    def _by_name(self) -> bool:
        return self.by_name if self.reading_by_name is None else self.reading_by_name

    @property
    def _holds_nothing(self) -> bool:
        """A pipeline process whose stages hold no trainable weight (LoRA's embedding and head alone): nothing of
        it to save or load, and torch's state-dict helpers refuse an empty optimizer."""
        return self.trainable_only and not any(group["params"] for group in self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        if self._holds_nothing:
            return {"model": {}, "optim": {}}
        # get_state_dict gives a fresh optimizer its state (a zero-lr step), so a resume template exists pre-step
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(
            ignore_frozen_params=self.trainable_only, flatten_optimizer_state_dict=self._by_name))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False only when frozen weights are left out on purpose: dcp.load has already failed on any
        # requested (trainable) key the checkpoint lacks
        if self._holds_nothing:
            return
        options = StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only,
                                   flatten_optimizer_state_dict=self._by_name)
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=options)


@dataclass
class TrainingProgress:
    """The loop's counters, kept by every checkpoint: a resumed run goes on from them."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch of the last step done
    nonfinite_skipped: list[int] = field(default_factory=list)  # steps not applied for a non-finite loss or gradient
    loss_scale: dict[str, Any] | None = None  # fp16's dynamic loss scale (GradScaler's state), None without fp16


class TrainerState(Stateful):
    """The loop's counters, stored as one JSON string.

    One leaf instead of one per key: DCP loads only the keys its template names, and a resuming loop cannot
    know them in advance. Values must be the same on every rank (DCP keeps one rank's copy).
    """

    def __init__(self, progress: TrainingProgress):
        self.progress = progress

    def state_dict(self) -> dict[str, Any]:
        try:
            return {"json": json.dumps(asdict(self.progress), sort_keys=True)}
        except TypeError as error:
            message = f"the trainer state must be JSON (numbers, strings, lists, dicts): {error}"
            raise CheckpointError(message) from error

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = json.loads(state_dict["json"])
        fresh = TrainingProgress()  # a counter the checkpoint does not hold starts from its default
        for counter in fields(TrainingProgress):
            setattr(self.progress, counter.name, saved.get(counter.name, getattr(fresh, counter.name)))


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the device this rank uses
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGState(Stateful):
    """This rank's random streams under its own key `rank_{r}`.

    Each rank writes and reads only its key, so a checkpoint from N ranks loads on M: ranks below N get their
    streams back (`restored`), the others keep their seeded streams. The state is one pickled blob rather than
    tensors: DCP would need a template of the same shapes (and of the same CUDA device count) to load tensors.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.restored = False

    @property
    def key(self) -> str:
        return f"rank_{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: pickle.dumps(capture_rng())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_rng(pickle.loads(state_dict[self.key]))
        self.restored = True


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                   progress: TrainingProgress, rank: int, trainable_only: bool,
                   optimizer_by_name: bool = False) -> dict[str, Any]:
    """The state dict the loop hands to `CheckpointManager.save` and `.load`.

    `progress` is updated in place on load; `state["rng"].restored` tells whether this rank got its streams back.
    `optimizer_by_name`: param groups saved by parameter name (ModelOptimizerState).
    """
    return {"model_optim": ModelOptimizerState(model, optimizer, trainable_only, optimizer_by_name),
            "scheduler": scheduler,
            "trainer": TrainerState(progress), "rng": RNGState(rank)}
