"""Phase 2 task: the optimisation stack (gradient checkpointing policy, precision, accumulation)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from memfit import phases
from memfit.config import MemfitConfig
from memfit.reports import PlanReport, ProbeReport, ResumePoint


@task(name="optimisation-stack", cache_policy=NO_CACHE, timeout_seconds=600)
def setup_task(config: MemfitConfig, probe: ProbeReport, resume: ResumePoint | None = None) -> PlanReport:
    plan = phases.plan_stack(config, probe, resume)
    create_markdown_artifact(
        key="memory-plan",
        description="The optimisation stack chosen for this run",
        markdown="\n".join([
            "# Memory plan", "", "| setting | value |", "|---|---|",
            f"| gradient checkpointing | `{plan.policy}` — {plan.description} |",
            f"| precision | `{plan.precision}` |",
            f"| micro-batch × accumulation | {plan.micro_batch_size} × {plan.grad_accum_steps} |",
            f"| LoRA | {'yes' if plan.lora else 'no'} |",
            f"| predicted peak | {(plan.predicted_peak_bytes or 0) / 1e9:.4g} GB |",

            f"| ranks | {plan.world_size} ({plan.strategy}"
            + (f", ≈ {plan.sharding['total'] / 1e9:.3f} GB each" if plan.sharding else "") + ") |",
            "", f"Why: {plan.reason}",
            *([f"At resume: {plan.changes}"] if plan.changes else []),
            *([f"Reused from the training checkpoint at step {plan.reused_from_step}."]
              if plan.reused_from_step is not None else []),
            "", "## Candidates estimated", "", plan.table_markdown or "(none)",
        ]),
    )
    return plan
