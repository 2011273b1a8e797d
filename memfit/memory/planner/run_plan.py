"""Phase 2's plan: the planner's search made the run's PlanReport (the chosen stack, its reason, every row)."""

from __future__ import annotations

import logging
from typing import Any

from memfit.config.devices import DeviceProfile
from memfit.errors import ConfigError, MemoryBudgetError
from memfit.memory.estimator.evaluation import plan_evaluation
from memfit.memory.estimator.fake_model import config_from_dict, model_config_for
from memfit.memory.planner.plan import held_weights, plan_table_markdown
from memfit.memory.planner.search import plan_for
from memfit.memory.techniques.policies import configured_policy
from memfit.reports import PlanReport, ProbeReport

log = logging.getLogger("memfit.phases")  # the phase's own logger: the warning reads as phase 2's


def run_plan(cfg: Any, probe_report: ProbeReport, profile: DeviceProfile, budget: int | None, source: str,
             measured: list[Any]) -> PlanReport:
    """The planner's search made the run's PlanReport: the fastest stack that fits (or a fixed policy, warned of
    when predicted not to fit), with phase 5's memory on the same device; no stack that fits is an error."""
    device = probe_report.environment["device"]
    architecture = config_from_dict(probe_report.architecture)
    plan = plan_for(cfg, profile, budget, source, hf_config=architecture, measured=measured)
    weights = None if plan.chosen is None else held_weights(plan.chosen)
    if not plan.fits and (cfg.memory.policy == "auto" or (budget is not None and weights and weights > budget)
                          or (plan.chosen is not None and plan.excluded(plan.chosen))):
        # The planner found nothing, even a forced policy cannot hold the weights themselves, or a forced policy
        # was stopped at the memory limit before (it would stop again).
        raise MemoryBudgetError(plan.error or "no stack fits the memory budget")
    if not plan.fits:
        log.warning("memory.policy=%s is predicted not to fit: %s", cfg.memory.policy, plan.error)
    chosen = plan.chosen
    assert chosen is not None
    if chosen.stack.precision in ("bf16-mixed", "bf16-true") and device["type"] == "cuda" \
            and not device["bf16_supported"]:
        raise ConfigError(f"train.precision={chosen.stack.precision}: {device['name']} has no bf16; use fp16-mixed")
    policy = configured_policy(cfg.memory, chosen.policy, chosen.every_k, chosen.kinds)
    row = plan.row(chosen)
    evaluation = plan_evaluation(architecture or model_config_for(cfg), chosen.n_params, cfg, plan.limit_bytes,
                                 device.get("name") or device["type"], profile.kind, profile.bf16)
    return PlanReport(policy=chosen.policy, every_k=chosen.every_k or cfg.memory.every_k,
                      precision=chosen.stack.precision, micro_batch_size=chosen.stack.micro_batch_size,
                      grad_accum_steps=chosen.stack.grad_accum_steps, reason=plan.reason,
                      description=policy.describe(), block_kinds=list(chosen.kinds), lora=chosen.stack.lora,
                      quantize=chosen.stack.quantize, loss=chosen.stack.loss, optimizer=chosen.stack.optimizer,
                      optimizer_in_backward=chosen.stack.optimizer_in_backward, lean_layers=chosen.stack.lean_layers,
                      fits=plan.fits, predicted_peak_bytes=chosen.peak_bytes, budget_bytes=budget, device=profile.name,
                      predicted_overhead=row["predicted_overhead"], budget_source=source, evaluation=evaluation,
                      predicted_step_seconds=row["predicted_step_seconds"], table_markdown=plan_table_markdown(plan),
                      trainable_params=chosen.n_trainable, weight_bytes=chosen.weight_bytes,
                      ranks=chosen.extra.get("ranks"),
                      alternatives=[plan.row(e) for e in plan.table if e is not chosen])
