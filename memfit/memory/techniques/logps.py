"""DPO's log-probs: the summed log-probs of each row's trained tokens, and the head kept from where they start."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, count) of each row's trained-token log-probs: the token at t+1 predicted at t, labels -100 skipped.
    In fp32 (the logits upcast), as TRL and the causal-LM loss compute them. The labels move one to the left (the
    last position predicts nothing) rather than the logits being cut: cutting [rows, seq, vocab] logits costs a
    copy of them forward and a zeroed gradient of their whole size backward."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    mask = shifted != -100
    logp = torch.log_softmax(logits.float(), dim=-1)
    token = logp.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * mask).sum(-1), mask.sum(-1)


def first_predicting(labels: torch.Tensor) -> int:
    """The first position whose logits predict a trained label in some row (labels[t+1] is predicted at t)."""
    trained = labels[:, 1:] != -100
    width = trained.shape[1]
    first = torch.where(trained.any(dim=1), trained.int().argmax(dim=1), width)  # width: a row with none
    start = int(first.min())  # one read from the device a forward
    return 0 if start >= width else start


def keeps_logits(model: nn.Module) -> bool:
    """Whether the causal LM under the wrappers (DDP, FSDP2, peft, DeepSpeed) takes logits_to_keep."""
    found = getattr(model, "_memfit_keeps_logits", None)
    if found is None:
        inner = model
        for _ in range(6):
            if hasattr(inner, "get_base_model"):
                inner = inner.get_base_model()
            elif isinstance(getattr(inner, "module", None), nn.Module):
                inner = inner.module
            else:
                break
        found = "logits_to_keep" in inspect.signature(inner.forward).parameters
        model.__dict__["_memfit_keeps_logits"] = found
    return found
