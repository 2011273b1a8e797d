"""Memory-lean SwiGLU MLPs and RMSNorms (memory.lean_layers): the same math, fewer and smaller saved tensors."""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

log = logging.getLogger("memfit.memory")

# Rows are processed in chunks of about this many elements, so a chunk's temporary is a few MiB, not another
# [tokens, intermediate] tensor (an 8B model's is 112 MiB at 2 x 2048 tokens).
CHUNK_ELEMENTS = 1 << 22
# The layers are recognised by the lines of their forward (transformers' Llama idiom, shared by Mistral,
# Qwen2/3, SmolLM3, OLMo2, Phi-3's norm...), so a model whose layer computes something else is left as it is.
MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
NORM_SOURCE = ("hidden_states.pow(2).mean(-1, keepdim=True)", "return self.weight * hidden_states.to(input_dtype)")
_SILU_NAMES = ("SiLU", "SiLUActivation")


def _row_chunks(*tensors: torch.Tensor) -> Any:
    """The tensors as [rows, last] views, cut into row chunks of about CHUNK_ELEMENTS elements."""
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]
    step = max(1, CHUNK_ELEMENTS // max(1, flat[0].shape[1]))
    for i in range(0, flat[0].shape[0], step):
        yield [f[i:i + step] for f in flat]


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only (not silu(gate)).

    Backward writes the two gradients into the saved gate and up, chunk by chunk: nothing of the
    [tokens, intermediate] size is allocated besides a chunk of sigmoid(gate). The saved tensors are this node's
    alone (the projections that made them save their inputs, not their outputs); overwriting them bumps their
    version counter, so a second backward through the same graph (retain_graph) fails loudly, not wrongly.
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.silu(gate)
        out.mul_(up)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        grad = grad.to(gate.dtype)
        # d/dgate silu(g) = s + silu(g) (1 - s), s = sigmoid(g); the gradient of up is grad * silu(g).
        for g, u, d in _row_chunks(gate, up, grad):
            s = torch.sigmoid(g)
            g.mul_(s)                            # g := silu(gate)
            s.addcmul_(g, s, value=-1).add_(g)   # s := s - silu s + silu, the derivative of silu
            u.mul_(d).mul_(s)                    # u := the gradient of gate
            g.mul_(d)                            # g := the gradient of up
        return up, gate  # the buffers hold each other's gradient


def lean_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    # The in-place backward needs one dtype and shape (what the projections give under any precision policy).
    if torch.is_grad_enabled() and gate.dtype == up.dtype and gate.shape == up.shape:
        return self.down_proj(SwiGLU.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


class RMSNorm(torch.autograd.Function):
    """transformers' Llama RMSNorm (fp32 statistics, the result in the input dtype times the weight), saving its
    input as it came (16-bit under bf16 training, and often shared with the block's saved input) and one
    scalar per row, where autograd saves an fp32 copy of the input; backward recomputes it chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x = x.contiguous()
        dx = torch.empty_like(x)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for xc, gc, rc, dc in _row_chunks(x, grad.expand(x.shape[:-1] + grad.shape[-1:]), rstd, dx):
            xhat = xc.to(torch.float32) * rc
            y = xhat.to(x.dtype)
            if dw is not None:
                dw += (gc * y).to(torch.float32).sum(0)
            # As autograd rounds it: the gradient of the 16-bit result, then of its fp32 source.
            g = (gc * weight).to(x.dtype).to(torch.float32)
            dc.copy_(rc * (g - xhat * (g * xhat).mean(-1, keepdim=True)))
        return dx, None if dw is None else dw.to(weight.dtype), None


def lean_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def is_swiglu_mlp(m: nn.Module) -> bool:
    return (all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in _SILU_NAMES and MLP_SOURCE in _forward_source(type(m)))


def is_llama_rmsnorm(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")
            and all(line in _forward_source(type(m)) for line in NORM_SOURCE))


def apply_lean_layers(model: nn.Module) -> dict[str, int]:
    """The one place memory.lean_layers touches a model: its SwiGLU MLPs and RMSNorms run the lean functions
    while gradients are recorded (evaluation and export run the model's own code). Returns what it changed."""
    counts = {"mlp": 0, "rmsnorm": 0}
    for m in model.modules():
        if is_swiglu_mlp(m):
            m.forward = types.MethodType(lean_mlp_forward, m)
            counts["mlp"] += 1
        elif is_llama_rmsnorm(m):
            m.forward = types.MethodType(lean_norm_forward, m)
            counts["rmsnorm"] += 1
    if not any(counts.values()):
        log.warning("memory.lean_layers: %s has no SwiGLU MLP or Llama-style RMSNorm; nothing changed",
                    type(model).__name__)
    return counts

