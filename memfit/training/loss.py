"""The loss policy: how a batch's training loss is computed from the model (one place for loop, eval and estimator)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

# A batch is a dict of tensors: input_ids and labels always ([batch, seq]; labels -100 where nothing is learned),
# attention_mask / position_ids when the data's packing mode needs them.
Batch = dict[str, torch.Tensor]


def blocks_batch(blocks: torch.Tensor, idx: torch.Tensor | slice, device: torch.device | None = None) -> Batch:
    """The batch of fixed token blocks `idx`: every token is learned (labels are the inputs, shifted in the loss)."""
    ids = blocks[idx]
    if device is not None:
        ids = ids.to(device, non_blocking=True)
    return {"input_ids": ids, "labels": ids}


def trained_tokens(batch: Batch) -> int:
    """Tokens whose prediction is trained (labels shifted by one, as the causal-LM loss does)."""
    return int((batch["labels"][..., 1:] != -100).sum())


class LossPolicy(Protocol):
    """Mean next-token loss over the batch's trained tokens."""

    name: str

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...


class PlainLoss:
    """The model's own loss: full [batch, seq, vocab] logits, then cross-entropy (what transformers does)."""

    name = "plain"

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(**batch).loss


def make_loss(cfg: object | None = None) -> LossPolicy:
    """The run's loss policy (the one place a loss is chosen)."""
    return PlainLoss()
