"""Baseline OOM probe: one real training step, its peak memory, and a fits / would-OOM verdict."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.memory.estimator.step import autocast_context, init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.techniques.policies import find_blocks

__all__ = ["autocast_context", "measure_step", "verdict", "budget_bytes", "explain_oom"]

GB = 1e9


@dataclass
class StepMemory:
    """Peak memory of one training step (forward, backward, optimizer step)."""

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    step_seconds: float = 0.0
    oom: bool = False
    method: str = ""
    error: str | None = None


@dataclass
class ProbeVerdict:
    peak_bytes: int
    budget_bytes: int | None
    budget_source: str
    fits: bool
    headroom_bytes: int | None
    oom: bool
    breakdown: dict[str, int]
    step_seconds: float
    method: str
    batch_size: int
    seq_len: int
    message: str
    estimate: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_step(model: nn.Module, batches: torch.Tensor | list[torch.Tensor], precision: str = "fp32",
                 max_grad_norm: float | None = 1.0) -> StepMemory:
    """Run one steady-state AdamW step on `model` (mutated: pass a throwaway copy) and measure its peak.

    The optimizer state is allocated first (as on every step after the first), then the micro-batches
    (one tensor, or a list of them: accumulation) run forward and backward, then clipping and the step.
    CUDA: the caching allocator's max_memory_allocated, with a real OOM caught. CPU: memfit's tracker
    (torch's MemTracker), which attributes every live tensor to params, grads, optimizer, activations, other.
    """
    model.train()
    micro = list(batches) if isinstance(batches, (list, tuple)) else [batches]
    optimizer = make_optimizer(model, foreach=None)
    device = micro[0].device
    t0 = time.perf_counter()
    if device.type == "cuda":
        try:
            init_optimizer_state(optimizer)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            run_step(model, optimizer, micro, precision, None, max_grad_norm)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError as err:
            peak = torch.cuda.max_memory_allocated(device)
            optimizer.zero_grad(set_to_none=True)
            del optimizer
            torch.cuda.empty_cache()
            return StepMemory(peak_bytes=int(peak), oom=True, method="cuda.max_memory_allocated",
                              step_seconds=time.perf_counter() - t0, error=str(err).splitlines()[0])
        return StepMemory(peak_bytes=int(torch.cuda.max_memory_allocated(device)),
                          method="cuda.max_memory_allocated", step_seconds=time.perf_counter() - t0)

    init_optimizer_state(optimizer)
    tracker = StepTracker(find_blocks(model))
    tracker.track_external(model, optimizer)
    t0 = time.perf_counter()
    with tracker:
        run_step(model, optimizer, micro, precision, tracker, max_grad_norm)
    seconds = time.perf_counter() - t0
    result = tracker.result()
    return StepMemory(peak_bytes=result.peak_bytes, breakdown=dict(result.peak), step_seconds=seconds,
                      method=f"MemTracker (peak at {result.peak_label})")


def weights_to_device(model: nn.Module, device: torch.device) -> StepMemory | None:
    """Move the probe's model to `device`; when the weights alone do not fit, the OOM as a StepMemory."""
    try:
        model.to(device)
    except torch.OutOfMemoryError as err:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return StepMemory(peak_bytes=int(peak), oom=True, method="cuda.max_memory_allocated",
                          error=f"the weights alone do not fit on {device}: {first}")
    return None


def verdict(step: StepMemory, budget_bytes: int | None, budget_source: str, batch_size: int,
            seq_len: int) -> ProbeVerdict:
    """Compare a measured step with the budget and say by how much it does or does not fit."""
    if step.oom:
        fits = False
    else:
        fits = budget_bytes is None or step.peak_bytes <= budget_bytes
    headroom = None if budget_bytes is None else budget_bytes - step.peak_bytes
    if step.oom:
        msg = (f"OOM: a plain step at micro-batch {batch_size} x {seq_len} tokens ran out of memory "
               f"after {step.peak_bytes / GB:.3f} GB ({step.error})")
    elif budget_bytes is None:
        msg = f"a plain step at micro-batch {batch_size} x {seq_len} peaks at {step.peak_bytes / GB:.4f} GB (no budget)"
    elif fits:
        msg = (f"fits: a plain step at micro-batch {batch_size} x {seq_len} peaks at {step.peak_bytes / GB:.4f} GB, "
               f"{headroom / GB:.4f} GB under the {budget_bytes / GB:.4f} GB budget ({budget_source})")
    else:
        msg = (f"would OOM: a plain step at micro-batch {batch_size} x {seq_len} peaks at "
               f"{step.peak_bytes / GB:.4f} GB, {-headroom / GB:.4f} GB over the {budget_bytes / GB:.4f} GB "
               f"budget ({budget_source})")
    return ProbeVerdict(peak_bytes=step.peak_bytes, budget_bytes=budget_bytes, budget_source=budget_source,
                        fits=fits, headroom_bytes=headroom, oom=step.oom, breakdown=step.breakdown,
                        step_seconds=step.step_seconds, method=step.method, batch_size=batch_size,
                        seq_len=seq_len, message=msg)


def budget_bytes(budget_gb: float | None, device_report: dict[str, Any]) -> tuple[int | None, str]:
    """The memory a run may use: memory.budget_gb when set, else a GPU's free memory; none on CPU."""
    if budget_gb is not None:
        return int(budget_gb * GB), "memory.budget_gb"
    if device_report.get("type") == "cuda":
        return int(device_report["memory_free_bytes"]), f"free memory of {device_report.get('name')}"
    return None, "none (CPU without memory.budget_gb)"


def explain_oom(estimate: Any, budget: int | None, budget_source: str) -> str:
    """The estimator's breakdown of a step that does not fit: what takes the memory, and how much is over."""
    b = estimate.breakdown
    parts = ", ".join(f"{k} {v / GB:.4g} GB" for k, v in sorted(b.items(), key=lambda kv: -kv[1]) if v)
    over = "" if budget is None else (f"; {(estimate.peak_bytes - budget) / GB:.4g} GB over the "
                                      f"{budget / GB:.4g} GB budget ({budget_source})")
    fixed = b["params"] + b["grads"] + b["optimizer"]
    what = ("weights, gradients and optimizer state alone exceed the budget: only LoRA, a lower precision "
            "or more memory help" if budget is not None and fixed > budget else
            "activations are what gradient checkpointing or a smaller micro-batch reduce")
    return (f"estimator (no checkpointing): peak {estimate.peak_bytes / GB:.4g} GB at {estimate.peak_at}: {parts}"
            f"{over}; {what}")
