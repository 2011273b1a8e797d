"""One training step exactly as the trainer runs it, for measuring (real tensors) and estimating (fake ones)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from memfit.memory.devices import DeviceProfile
from memfit.memory.tracker import StepTracker, tensors_of
from memfit.optim import make_adamw
from memfit.training.loss import LossPolicy, PlainLoss


def autocast_context(device: torch.device, precision: str):
    """Mixed precision as autocast; fp32 and bf16-true (weights already bf16) need none.

    cache_enabled=False: autocast's cache would keep a low-precision copy of every weight until the forward
    ends, even in checkpointed blocks that saved nothing else; each weight is cast once per forward anyway.
    """
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    if precision == "fp16-mixed":
        return torch.autocast(device.type, dtype=torch.float16, cache_enabled=False)
    return nullcontext()


def make_optimizer(model: nn.Module, weight_decay: float = 0.01, foreach: bool | None = None
                   ) -> torch.optim.Optimizer:
    # The trainer's AdamW recipe (same groups, same state), at a learning rate that barely moves the weights.
    return make_adamw(model, 1e-6, weight_decay, foreach=foreach)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's moments without moving the weights (a step at lr 0 on zero gradients).

    Every step after the first runs with the optimizer state already allocated: that steady state is what
    the probe measures and the estimator predicts.
    """
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: Sequence[torch.Tensor],
             precision: str, tracker: StepTracker | None = None, max_grad_norm: float | None = 1.0,
             loss_fn: LossPolicy | None = None) -> None:
    """Forward + backward per micro-batch (loss / accumulation steps), then clip and step, like the trainer."""
    loss_fn = loss_fn or PlainLoss()
    n = len(batches)
    for m, batch in enumerate(batches):
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker needs this between calls of the root module
            tracker.phase("fwd", f"m{m}.")
        with autocast_context(batch.device, precision):
            loss = loss_fn(model, {"input_ids": batch, "labels": batch}) / n
        if tracker is not None:
            tracker.phase("bwd", f"m{m}.")
        loss.backward()
        del loss
    if optimizer is not None:
        if tracker is not None:
            tracker.phase("opt")
        if max_grad_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if tracker is not None:
        tracker.phase("idle")


def op_cost_model(profile: DeviceProfile) -> Callable[[Any, tuple, dict, Any], float]:
    """Seconds per op on `profile`: a roofline (FLOPs at peak, or bytes at memory bandwidth) plus launch cost."""
    from torch.utils.flop_counter import flop_registry

    def op_seconds(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        if getattr(func, "is_view", False):
            return 0.0  # views launch no kernel
        flops = 0
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            try:
                flops = formula(*args, **kwargs, out_val=out)
            except Exception:  # noqa: BLE001 - a formula that does not cover an overload: count its bytes only
                flops = 0
        ts = tensors_of(args, kwargs, out)
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        dtype = str(ts[0].dtype).removeprefix("torch.") if ts else "float32"
        return max(flops / profile.flops_per_s(dtype), nbytes / profile.bandwidth) + profile.op_overhead_s

    return op_seconds
