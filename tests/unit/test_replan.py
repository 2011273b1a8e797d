"""A resume's plan (planner/replan.py): reused when nothing it was made for changed, else planned again with the
reason and the decided knobs that differ; the plan itself is frozen and JSON round-trips."""

from __future__ import annotations

import json

import pydantic
import pytest
from test_memory_limits import stopped
from test_plan import N, est

from memfit import config
from memfit.memory.planner.replan import plan_at_resume, plan_changes, trained_as, why_replan
from memfit.reports import PlanReport, ResumePoint

pytestmark = pytest.mark.unit


def _plan(**update) -> PlanReport:
    fields = {"policy": "none", "every_k": 2, "precision": "fp32", "micro_batch_size": 8, "grad_accum_steps": 2,
              "reason": "fastest", "description": "none", "block_kinds": ["none", "none"], "loss": "plain",
              "optimizer": "adamw", "predicted_peak_bytes": 12_000_000, "device": "cpu"}
    return PlanReport(**{**fields, **update})


def test_the_plan_is_frozen_and_round_trips_as_json():
    plan = _plan()
    with pytest.raises(pydantic.ValidationError):
        plan.precision = "bf16-mixed"
    assert PlanReport.model_validate(json.loads(json.dumps(plan.model_dump(mode="json")))) == plan
    with pytest.raises(pydantic.ValidationError):
        PlanReport(**{**plan.model_dump(), "asked": "x"})  # extra="forbid"


def test_same_target_reuses_and_each_change_says_why():
    saved = _plan(budget_bytes=20 * 10**9)
    assert why_replan(saved, "cpu", 1, 20 * 10**9, True, ()) is None
    assert why_replan(saved, "cpu", 1, None, False, ()) is None  # a budget read off the device may drift
    assert why_replan(saved, "rtx-4090", 1, None, False, ()) == \
        "the target device changed: cpu → rtx-4090 (memory.device)"
    assert why_replan(saved, "cpu", 2, None, False, ()) == "the number of ranks changed: 1 → 2"
    assert why_replan(saved, "cpu", 1, 10 * 10**9, True, ()) == "memory.budget_gb changed: 20 GB → 10 GB"
    none = est(["none"] * N)
    why = why_replan(saved, "cpu", 1, None, False, [stopped(none, 9_800_000_000, 8_800_000_000)])
    assert why.startswith("a leaner restart: none, fp32") and "measured 9.8 GB at step 40 > limit 8.8 GB" in why


def test_plan_changes_names_the_decided_knobs_that_differ():
    old, new = _plan(), _plan(policy="mixed", block_kinds=["full", "none"], micro_batch_size=4, grad_accum_steps=4,
                              predicted_peak_bytes=9_000_000)
    assert plan_changes(old, new) == ("micro_batch_size: 8 → 4; grad_accum_steps: 2 → 4; policy: none → mixed; "
                                      "block_kinds: 2 x none → ['full', 'none']; predicted peak 0.012 GB → 0.009 GB")
    assert plan_changes(old, old).startswith("the same stack")


def test_plan_at_resume_calls_the_planner_only_when_it_must():
    calls = []

    def planner() -> PlanReport:
        calls.append(1)
        return _plan(device="h100-80gb", optimizer="adamw-fused")

    fresh = plan_at_resume(None, "cpu", 1, None, False, (), planner)
    assert calls == [1] and fresh.changes is None and fresh.reused_from_step is None
    resume = ResumePoint(checkpoint_uri="x", step=7, plan=_plan())
    reused = plan_at_resume(resume, "cpu", 1, None, False, (), planner)
    assert calls == [1] and reused.reused_from_step == 7 and reused.precision == "fp32"
    moved = plan_at_resume(resume, "h100-80gb", 1, None, False, (), planner)
    assert calls == [1, 1] and moved.changes == (
        "planned again at resume from step 7: the target device changed: cpu → h100-80gb (memory.device); "
        "optimizer: adamw → adamw-fused; predicted peak 0.012 GB → 0.012 GB")


def test_a_re_plan_keeps_the_weights_the_checkpoint_trained():
    cfg = config.load(None, ["lora.enabled=auto"])
    full = ResumePoint(checkpoint_uri="x", step=7, plan=_plan())
    assert trained_as(cfg, None) is cfg
    assert trained_as(cfg, full).lora.enabled is False  # all weights trained: another device may not pick LoRA
    qlora = ResumePoint(checkpoint_uri="x", step=7, plan=_plan(lora=True, quantize="nf4"))
    pinned = trained_as(cfg, qlora)
    assert (pinned.lora.enabled, pinned.lora.quantize, pinned.lora.r) == (True, "nf4", cfg.lora.r)
    assert cfg.lora.enabled == "auto"  # the config as asked is left alone
