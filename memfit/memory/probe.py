"""Baseline OOM probe: one real training step, its peak memory, and a fits / would-OOM verdict."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def autocast_context(device: torch.device, precision: str):
    """Mixed precision as autocast; fp32 and bf16-true (weights already bf16) need none."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, precision: str) -> None:
    with autocast_context(batch.device, precision):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step(model: nn.Module, batch: torch.Tensor, precision: str = "fp32") -> StepMemory:
    """Run one AdamW step on `model` (mutated: pass a throwaway copy) and measure its peak memory.

    CUDA: the caching allocator's max_memory_allocated, with a real OOM caught. CPU: torch's MemTracker,
    which attributes every live tensor (params, grads, optimizer state, activations, temporaries).
    """
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    device = batch.device
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            _one_step(model, optimizer, batch, precision)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError as err:
            peak = torch.cuda.max_memory_allocated(device)
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return StepMemory(peak_bytes=int(peak), oom=True, method="cuda.max_memory_allocated",
                              step_seconds=time.perf_counter() - t0, error=str(err).splitlines()[0])
        return StepMemory(peak_bytes=int(torch.cuda.max_memory_allocated(device)),
                          method="cuda.max_memory_allocated", step_seconds=time.perf_counter() - t0)

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _one_step(model, optimizer, batch, precision)
    seconds = time.perf_counter() - t0
    snap = tracker.get_tracker_snapshot("peak")
    dev_stats = snap.get(device) or next(iter(snap.values()), {})
    breakdown = {str(getattr(k, "value", k)).lower(): int(v) for k, v in dev_stats.items()}
    total = breakdown.pop("total", sum(breakdown.values()))
    return StepMemory(peak_bytes=int(total), breakdown=breakdown, step_seconds=seconds, method="MemTracker")


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
