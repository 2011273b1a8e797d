"""The one training step: the trainer runs it, the probe measures it, the estimator traces it (fake tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from memfit.memory.estimator.tracker import HOST, StepTracker
from memfit.memory.techniques.loss import Batch, LossPolicy, PlainLoss
from memfit.memory.techniques.optim import StepInBackward, make_adamw, param_groups


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


def make_optimizer(model: nn.Module, weight_decay: float = 0.01, foreach: bool | None = None, kind: str = "adamw",
                   fake: bool = False) -> torch.optim.Optimizer:
    """The trainer's AdamW recipe (same groups, same state), at a learning rate that barely moves the weights.

    fake: for the estimator's fake tensors, where bitsandbytes' kernels (data-dependent) and torchao's
    CPU offload (pinned host memory) cannot run: EmulatedAdamW allocates their state instead.
    """
    if fake and kind in ("adamw-8bit", "adamw-cpu-offload"):
        return EmulatedAdamW(param_groups(model, weight_decay), kind)
    return make_adamw(model, 1e-6, weight_decay, foreach=foreach, kind=kind)


# bitsandbytes' 8-bit AdamW: blockwise quantized moments (one fp32 absmax per block), fp32 moments below this size.
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096


class EmulatedAdamW(torch.optim.Optimizer):
    """What an AdamW variant holds, on fake tensors: its state tensors, with the shapes, dtypes and devices the
    real one allocates, and a step that allocates nothing on the device (both update in place: bitsandbytes'
    blockwise kernel on the GPU, torchao's on the CPU).

    adamw-8bit: uint8 moments + fp32 absmax per 256-value block, shared 256-entry quantization maps, fp32 moments
    for tensors under 4096 values. adamw-cpu-offload: on the host (booked on the tracker's host device) a copy of
    the parameter, of its gradient (pinned) and two moments, in the parameter's dtype.
    """

    def __init__(self, groups: list[dict[str, Any]], kind: str) -> None:
        super().__init__(groups, {"lr": 1e-6, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})
        self.kind = kind
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p].update(self._new_state(p))
                self.state[p]["step"] += 1

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        if self.kind == "adamw-cpu-offload":
            host = {"device": HOST, "dtype": p.dtype}
            return {"step": 0, "exp_avg": torch.empty(p.shape, **host), "exp_avg_sq": torch.empty(p.shape, **host),
                    "param_copy": torch.empty(p.shape, **host), "grad_copy": torch.empty(p.shape, **host)}
        if p.numel() < BNB_MIN_8BIT:
            return {"step": 0, "state1": torch.zeros_like(p, dtype=torch.float32),
                    "state2": torch.zeros_like(p, dtype=torch.float32)}
        if self._qmaps is None:
            self._qmaps = (torch.zeros(256, device=p.device), torch.zeros(256, device=p.device))
        blocks = -(-p.numel() // BNB_BLOCK)
        return {"step": 0, "state1": torch.zeros_like(p, dtype=torch.uint8), "qmap1": self._qmaps[0],
                "state2": torch.zeros_like(p, dtype=torch.uint8), "qmap2": self._qmaps[1],
                "absmax1": torch.zeros(blocks, device=p.device), "absmax2": torch.zeros(blocks, device=p.device)}


def host_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state kept in host memory (the CPU-offloaded AdamW's)."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.device == HOST)


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


def train_step(model: nn.Module, batches: Iterable[Batch], precision: str, loss_fn: LossPolicy, n: int, *,
               backward: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
               micro_batch: Callable[[bool], AbstractContextManager[Any]] | None = None,
               divide: bool = True, total: torch.Tensor | None = None, tracker: StepTracker | None = None
               ) -> torch.Tensor | None:
    """The forward and backward of a step's `n` micro-batches, as the trainer, the probe and the estimator run
    them: each forward under autocast, its mean loss divided by `n` (unless the strategy divides: `divide`
    False), then `backward` (the strategy's: loss scaling; plain `loss.backward()` without one), inside
    `micro_batch(last)` (DDP: no all-reduce but on the last). What `backward` returns is summed into `total`
    (the step's loss); the optimizer step after it is the caller's. `tracker` marks each phase of each
    micro-batch (the estimator's segments)."""
    for m, batch in enumerate(batches):
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker needs this between calls of the root module
            tracker.phase("fwd", f"m{m}.")
        with micro_batch(m == n - 1) if micro_batch is not None else nullcontext():
            with autocast_context(batch["input_ids"].device, precision):
                loss = loss_fn(model, batch)
                if divide:
                    loss = loss / n
            if tracker is not None:
                tracker.phase("bwd", f"m{m}.")
            share = backward(loss) if backward is not None else loss.backward()
            del loss
        if share is not None and total is not None:
            total += share
    return total


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: Sequence[torch.Tensor],
             precision: str, tracker: StepTracker | None = None, max_grad_norm: float | None = 1.0,
             loss_fn: LossPolicy | None = None, in_backward: bool = False) -> None:
    """train_step over token blocks (labels = inputs), then clip and step as the trainer's optimizer does.

    in_backward: each parameter is stepped, and its gradient freed, as soon as the gradient is accumulated
    (memory.optimizer_in_backward); then there is no step after backward.
    """
    loss_fn = loss_fn or PlainLoss()
    hooks = StepInBackward(optimizer) if in_backward and optimizer is not None else None
    try:
        train_step(model, ({"input_ids": b, "labels": b} for b in batches), precision, loss_fn, len(batches),
                   tracker=tracker)
    finally:
        if hooks is not None:
            hooks.remove()
    if optimizer is not None:
        if tracker is not None:
            tracker.phase("opt")  # empty when every parameter stepped in backward
        if hooks is None:
            if max_grad_norm is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if tracker is not None:
        tracker.phase("idle")

