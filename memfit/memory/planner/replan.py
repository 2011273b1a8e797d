"""A resume's plan: the training checkpoint's own reused on the same target, or planned again and the change said."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from memfit.reports import PlanReport, ResumePoint

log = logging.getLogger("memfit.phases")  # phase 2's own line in the run's log

# The knobs a plan decides, in the order a change is told (the rest of a plan is its evidence).
DECIDED = ("precision", "micro_batch_size", "grad_accum_steps", "policy", "every_k", "block_kinds", "lora",
           "quantize", "loss", "optimizer", "optimizer_in_backward", "lean_layers", "strategy", "world_size")


def plan_at_resume(resume: ResumePoint | None, device: str, world_size: int, budget: int | None, budget_fixed: bool,
                   measured: Sequence[Any], plan: Callable[[], PlanReport]) -> PlanReport:
    """The plan the resumed training checkpoint saved, when nothing it was made for changed (said in the log);
    else `plan()`, whose `changes` then say why it was planned again and what differs (also a warning)."""
    saved = resume.plan if resume is not None else None
    if saved is None:
        return plan()
    why = why_replan(saved, device, world_size, budget, budget_fixed, measured)
    if why is None:
        log.info("plan reused from the training checkpoint at step %s: %s (%s)", resume.step, saved.description,
                 saved.reason)
        return saved.model_copy(update={"reused_from_step": resume.step, "changes": None})
    new = plan()
    changes = f"planned again at resume from step {resume.step}: {why}; {plan_changes(saved, new)}"
    log.warning("%s", changes)
    return new.model_copy(update={"changes": changes})


def trained_as(cfg: Any, resume: ResumePoint | None) -> Any:
    """The config a re-plan at resume plans from: the weights stay those the checkpoint trained — LoRA or all of
    them, on a base quantized or not — as its saved plan decided (a `lora.enabled: auto` may not flip on another
    device: the saved state would not load into the other kind of model)."""
    saved = resume.plan if resume is not None else None
    if saved is None:
        return cfg
    lora = cfg.lora.model_copy(update={"enabled": saved.lora, "quantize": saved.quantize})
    return cfg.model_copy(update={"lora": lora})


def why_replan(saved: PlanReport, device: str, world_size: int, budget: int | None, budget_fixed: bool,
               measured: Sequence[Any]) -> str | None:
    """Why a resume cannot reuse the plan its training checkpoint saved, or None when it can: another target
    device or number of ranks, another memory.budget_gb, or a stop at the memory limit (a leaner restart)."""
    if measured:
        m = measured[-1]
        return (f"a leaner restart: {m.label()} measured {m.measured_bytes / 1e9:.4g} GB at step {m.step} > limit "
                f"{m.limit_bytes / 1e9:.4g} GB ({m.limit_source})")
    if saved.device != device:
        return f"the target device changed: {saved.device} → {device} (memory.device)"
    if saved.world_size != world_size:
        return f"the number of ranks changed: {saved.world_size} → {world_size}"
    if budget_fixed and saved.budget_bytes != budget:
        return f"memory.budget_gb changed: {_gb(saved.budget_bytes)} → {_gb(budget)}"
    return None


def plan_changes(saved: PlanReport, new: PlanReport) -> str:
    """The decided knobs that differ, `name: old → new`, or that none does."""
    diffs = [f"{k}: {_short(getattr(saved, k))} → {_short(getattr(new, k))}" for k in DECIDED
             if getattr(saved, k) != getattr(new, k)]
    peak = f"; predicted peak {_gb(saved.predicted_peak_bytes)} → {_gb(new.predicted_peak_bytes)}"
    return ("; ".join(diffs) if diffs else "the same stack") + peak


def _gb(n: int | None) -> str:
    return "none" if n is None else f"{n / 1e9:.4g} GB"


def _short(v: Any) -> str:
    if isinstance(v, list) and len(set(v)) == 1:
        return f"{len(v)} x {v[0]}"
    return str(v)
