"""Next-token cross-entropy over the target tokens: `stage: sft` (a conversation's trained turns) and `stage: pt`
(every token of raw text). The unit of data is a sample of the tokenized dataset, its labels marking the targets;
the normaliser is the count of target tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtune.data.collate import IGNORE, Batch, collate
from meshtune.data.sampler import Row
from meshtune.distributed import DistEnv
from meshtune.model.loss_head import targets_for
from meshtune.model.parallel import unwrap
from meshtune.model.vocab_parallel_loss import VocabShard, vocab_parallel_loss_sum
from meshtune.train.objectives import normalised


@dataclass(frozen=True)
class TokenLoss:
    """`loss_sum`: summed token loss of a micro-batch; with `fused_loss` the model's head computes it
    (model/loss_head.py). fp16 computes through autocast in every mode (FSDP2 then keeps and gathers fp32
    parameters). `vocab`: the logits are this process's share of the vocabulary (tensor parallel), the loss computed
    across the shares. Rows are padded to a multiple of `pad_to_multiple` (tensor and context parallel), or laid end
    to end in one row (`padding_free`)."""

    model: torch.nn.Module
    env: DistEnv
    pad_id: int
    autocast_bf16: bool
    fused_loss: bool
    autocast_fp16: bool = False
    vocab: VocabShard | None = None
    pad_to_multiple: int = 1
    padding_free: bool = False

    def collate(self, rows: list[Row], dataset, packed: bool) -> Batch:
        return collate(rows, dataset=dataset, pad_id=self.pad_id, packed=packed, pad_to_multiple=self.pad_to_multiple,
                       padding_free=self.padding_free)

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        return forward_loss(self.model, batch, self.env, self.autocast_bf16, self.fused_loss, self.autocast_fp16,
                            self.vocab)

    def count(self, batch: Batch) -> int:
        return batch.num_targets

    def prepare_step(self, step_rows: list[Row], micro_rows: list[list[Row]], dataset) -> None:
        pass  # each micro-batch's loss is its own

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ()  # the loss says it all

    def metric_sums(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64, device=self.env.device)

    def metrics(self, sums: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.metric_names, normalised(sums, count)))  # each a sum over the step / the normaliser


def forward_loss(model: torch.nn.Module, batch: Batch, env: DistEnv, autocast_bf16: bool,
                 fused_loss: bool, autocast_fp16: bool = False, vocab: VocabShard | None = None) -> torch.Tensor:
    """Summed token loss of one micro-batch (see TokenLoss)."""
    dtype = torch.float16 if autocast_fp16 else torch.bfloat16
    with torch.autocast(env.device.type, dtype=dtype, enabled=autocast_bf16 or autocast_fp16):
        if fused_loss:
            with targets_for(unwrap(model), batch.target_positions, batch.target_ids):
                return model(**batch.model_inputs(), use_cache=False).logits
        logits = model(**batch.model_inputs(), use_cache=False).logits
    if vocab is not None:
        return vocab_parallel_loss_sum(logits, batch.targets, vocab)
    return token_loss_sum(logits, batch.targets)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over target tokens, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
