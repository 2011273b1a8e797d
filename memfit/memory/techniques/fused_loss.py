"""`memory.loss: fused`: Liger's fused linear cross-entropy (Triton, CUDA), its plain-torch twin for fake tensors."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

# Liger (liger_kernel.ops.fused_linear_cross_entropy) computes the loss and, in the same forward, the gradients of
# the hidden states and of the head, chunk by chunk: a [chunk, vocab] logits buffer at a time, with chunk the power
# of two at or above tokens / ceil(vocab / hidden), so one chunk's logits are about one [tokens, hidden] tensor.
# Backward only scales what forward computed. No full-vocabulary logits are ever alive, and nothing is recomputed.


def liger_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Pure: the rows of one logits chunk as Liger sizes it (chunk_mem_const 1)."""
    inc = -(-vocab // hidden)
    rows = -(-tokens // inc)
    return min(1 << max(rows - 1, 0).bit_length(), tokens)


def fused_unavailable(device_type: str) -> str | None:
    """Why the fused loss cannot run here (None when it can): Liger's kernel is Triton, CUDA only."""
    if device_type != "cuda":
        return f"memory.loss: fused runs Liger's Triton kernel on CUDA only; this run is on {device_type}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "memory.loss: fused needs liger-kernel (pip install 'memfit[gpu]', or pip install liger-kernel)"
    return None


HEAD_SLICE = 8192  # vocabulary rows of the head's gradient accumulated at a time (the twin's only addition)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy in plain torch, allocation for allocation (mean over trained tokens).

    Where its Triton kernel cannot run: the estimator's fake tensors, a check on the CPU. Forward allocates the
    hidden states' gradient (and the head's, when it trains), then per chunk the logits in the matmul's dtype,
    turned in place into their gradient (softmax minus one-hot, over the trained-token count); backward scales.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden.shape
        rows = liger_chunk_rows(tokens, width, weight.shape[0])
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        count = (labels != -100).sum().clamp(min=1)  # a tensor (Liger reads it with .item())
        for start in range(0, tokens, rows):
            h, y = hidden[start:start + rows], labels[start:start + rows]
            logits = h @ weight.t()  # autocast's dtype under mixed precision, as in Liger
            if bias is not None:
                logits = logits + bias
            valid = y != -100
            target = y.clamp(min=0)[:, None]
            top = logits.amax(dim=1, keepdim=True)
            picked = logits.gather(1, target) - top
            total = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
            loss_1d[start:start + rows] = torch.where(valid, (total.float().log() - picked.float()).squeeze(1), 0.0)
            grad = logits.div_(total)  # softmax, in the logits' own buffer
            grad.scatter_add_(1, target, -valid[:, None].to(grad.dtype))
            grad.mul_((valid[:, None] / count).to(grad.dtype))
            grad_input[start:start + rows] = grad @ weight
            if grad_weight is not None:  # by vocabulary slices: Liger's addmm into fp32 makes no whole-head copy
                hb = h.to(grad.dtype)  # Liger casts the chunk's input once, as here
                for gw, g in zip(grad_weight.split(HEAD_SLICE), grad.t().split(HEAD_SLICE), strict=True):
                    gw.add_(torch.mm(g, hb))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del logits, grad
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        return loss_1d.sum() / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss.to(grad_input.dtype)
        return (grad_input * scale, None if grad_weight is None else grad_weight * scale.to(grad_weight.dtype),
                None if grad_bias is None else grad_bias * scale.to(grad_bias.dtype), None)


def fused_head_loss(head: nn.Linear, flat: torch.Tensor, labels: torch.Tensor, emulate: bool) -> torch.Tensor:
    """Mean cross-entropy of `flat` hidden states through `head` (labels shifted, -100 ignored): Liger's kernel,
    or its twin above where `emulate` (lazy import: liger-kernel is optional and needs Triton)."""
    if emulate:
        return FusedLinearCrossEntropy.apply(flat, head.weight, head.bias, labels)
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")(head.weight, flat, labels, head.bias)
