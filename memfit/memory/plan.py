"""Choosing the optimisation stack: a pure function of the config and the baseline probe."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class StackPlan:
    """What the optimisation-stack phase decided, and why; logged to MLflow as the plan."""

    policy: str
    every_k: int
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_policy(requested: str, baseline_peak_bytes: int | None, budget_bytes: int | None,
                  baseline_oom: bool = False) -> tuple[str, str]:
    """`auto`: no recompute when the plain step fits the budget; full recompute when it does not.

    A later planner replaces this rule with estimates per policy; the interface stays.
    """
    if requested != "auto":
        return requested, f"memory.policy={requested} set in the config"
    if baseline_oom:
        return "full", "the plain step ran out of memory: recompute every block"
    if budget_bytes is None or baseline_peak_bytes is None:
        return "none", "no memory budget known: keep every activation (fastest)"
    if baseline_peak_bytes <= budget_bytes:
        return "none", (f"the plain step peaks at {baseline_peak_bytes / GB:.4f} GB, within the "
                        f"{budget_bytes / GB:.4f} GB budget: no recompute needed")
    return "full", (f"the plain step peaks at {baseline_peak_bytes / GB:.4f} GB, over the "
                    f"{budget_bytes / GB:.4f} GB budget: recompute every block")


def make_plan(memory_cfg: Any, train_cfg: Any, baseline_peak_bytes: int | None, budget_bytes: int | None,
              baseline_oom: bool = False) -> StackPlan:
    policy, reason = choose_policy(memory_cfg.policy, baseline_peak_bytes, budget_bytes, baseline_oom)
    return StackPlan(policy=policy, every_k=memory_cfg.every_k, precision=train_cfg.precision,
                     micro_batch_size=train_cfg.micro_batch_size, grad_accum_steps=train_cfg.grad_accum_steps,
                     reason=reason)
