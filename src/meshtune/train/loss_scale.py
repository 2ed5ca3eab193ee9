"""fp16's dynamic loss scale, as HF Trainer runs fp16: the loss is multiplied before backward so that small fp16
gradients do not flush to zero, the gradients are divided back before clipping, and a step whose gradients
overflowed is skipped (the optimizer and the schedule do not move; the scale halves). torch's GradScaler under ddp,
where every rank holds the same all-reduced gradients; its ShardedGradScaler under FSDP2, where each rank holds a
shard of them and an overflow found in one shard must skip the step on every rank. Without fp16 every call passes
through."""

from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from meshtune.checkpoint import TrainingProgress


class LossScaler:
    def __init__(self, enabled: bool, sharded: bool, device: torch.device, progress: TrainingProgress) -> None:
        """`progress`: the loop's counters, already restored from the checkpoint on a resume; the scale is kept in
        them, so a resumed run goes on with its scale."""
        self.progress = progress
        self._scaler: torch.amp.GradScaler | None = None
        if enabled:
            self._scaler = ShardedGradScaler(device=device.type) if sharded else torch.amp.GradScaler(device.type)
            if progress.loss_scale is not None:
                self._scaler.load_state_dict(progress.loss_scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self._scaler is None else self._scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients back to their true values (before clipping measures them)."""
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step, unless the gradients overflowed; whether it stepped (the schedule steps with it)."""
        if self._scaler is None:
            optimizer.step()
            return True
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        self.progress.loss_scale = self._scaler.state_dict()
        return self._scaler.get_scale() >= before  # the scale falls only after an overflow, which skipped the step
