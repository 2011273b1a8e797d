"""The loss policy: how a batch's training loss is computed from the model (one place for loop, eval and estimator)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

# A batch is a dict of tensors: input_ids and labels always ([batch, seq]; labels -100 where nothing is learned),
# attention_mask / position_ids when the data's packing mode needs them.
Batch = dict[str, torch.Tensor]


def blocks_batch(blocks: torch.Tensor, idx: torch.Tensor | slice, device: torch.device | None = None,
                 fields: dict[str, torch.Tensor] | None = None, attn_implementation: str = "sdpa") -> Batch:
    """The batch of rows `idx`: input_ids, and labels (the inputs themselves for plain text blocks, else the data's
    with -100 on untrained tokens); the packing mode's position_ids / attention_mask come along from `fields`."""
    fields = fields or {}
    rows = {"input_ids": blocks[idx], **{k: v[idx] for k, v in fields.items()}}
    if "attention_mask" in rows:  # one padded example a row: cut the batch to its longest row (on the host)
        longest = int(rows["attention_mask"].sum(-1).max())
        rows = {k: v[:, :longest] for k, v in rows.items()}
    if device is not None:
        rows = {k: v.to(device, non_blocking=True) for k, v in rows.items()}
    rows.setdefault("labels", rows["input_ids"])
    if "position_ids" in rows:  # padding-free packs: no attention across the examples of a row
        from memfit.data.packing import packed_attention_mask

        mask = packed_attention_mask(rows["position_ids"], attn_implementation, torch.float32)
        if mask is not None:
            rows["attention_mask"] = mask
    return rows


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
