"""The plan in training checkpoints: a resume on the same device reuses it without planning; on another
memory.device it plans again, and the log and the MLflow run say what changed and why."""

from __future__ import annotations

import json
import logging

import pytest

from memfit import phases
from memfit.memory.planner import run_plan

pytestmark = pytest.mark.integration


def _first_run(cfg):
    """Phases 1, 4, 2 and 3 as the flow runs them; returns the probe and the plan trained with."""
    probe = phases.check_environment_and_probe(cfg)
    resume = phases.recover_training_checkpoint(cfg)
    assert resume.plan is None  # a fresh run
    plan = phases.plan_stack(cfg, probe, resume)
    report = phases.train(cfg, plan, resume, probe)
    assert report.steps == cfg.train.max_steps
    return probe, plan


def _decided(plan) -> dict:
    return plan.model_dump(exclude={"reused_from_step", "changes"})


def test_resume_on_the_same_device_reuses_the_saved_plan_without_planning(tiny_config, tmp_path, monkeypatch,
                                                                          caplog):
    common = {"tracking.backend": "null", "checkpoint.every_steps": 2}
    probe, plan = _first_run(tiny_config(**common, **{"train.max_steps": 4}))
    saved = json.loads((tmp_path / "checkpoints" / "step-00000004" / "state.json").read_text())["plan"]
    assert saved["precision"] == plan.precision and saved["device"] == "cpu"

    longer = tiny_config(**common, **{"train.max_steps": 6})  # max_steps may grow: the same run
    resume = phases.recover_training_checkpoint(longer)
    assert resume.step == 4 and _decided(resume.plan) == _decided(plan)

    def no_planning(*_a, **_k):
        raise AssertionError("the planner ran on a resume that should reuse the saved plan")

    monkeypatch.setattr(run_plan, "plan_for", no_planning)
    monkeypatch.setattr(phases, "load_plan", no_planning)  # not the plan cache either
    with caplog.at_level(logging.INFO, logger="memfit"):
        reused = phases.plan_stack(longer, probe, resume)
    assert "plan reused from the training checkpoint at step 4" in caplog.text
    assert _decided(reused) == _decided(plan) and reused.reused_from_step == 4 and reused.changes is None
    report = phases.train(longer, reused, resume, probe)
    assert report.resumed_from == 4 and report.steps == 6
    again = json.loads((tmp_path / "checkpoints" / "step-00000006" / "state.json").read_text())["plan"]
    assert again["reused_from_step"] == 4 and again["precision"] == plan.precision


def test_resume_on_another_device_plans_again_and_says_what_changed(tiny_config, tmp_path, caplog):
    import mlflow

    probe, plan = _first_run(tiny_config(**{"train.max_steps": 4, "checkpoint.every_steps": 2}))
    assert plan.device == "cpu"
    # The same run on a (profiled) H100: another target, so the saved plan is not reused.
    moved = tiny_config(**{"train.max_steps": 6, "checkpoint.every_steps": 2, "memory.device": "h100-80gb"})
    resume = phases.recover_training_checkpoint(moved)
    assert resume.plan is not None and resume.plan.device == "cpu"
    with caplog.at_level(logging.INFO, logger="memfit"):
        replanned = phases.plan_stack(moved, probe, resume)
    assert "plan reused" not in caplog.text
    line = next(r.getMessage() for r in caplog.records if "planned again at resume" in r.getMessage())
    assert "from step 4: the target device changed: cpu → h100-80gb (memory.device)" in line
    assert replanned.device == "h100-80gb" and replanned.changes == line
    differs = [k for k in ("precision", "optimizer", "micro_batch_size", "policy")
               if getattr(plan, k) != getattr(replanned, k)]
    assert all(f"{k}: {getattr(plan, k)} → {getattr(replanned, k)}" in line for k in differs)
    assert "predicted peak" in line
    report = phases.train(moved, replanned, resume, probe)  # the new plan trains from the saved step
    assert report.resumed_from == 4 and report.steps == 6
    mlflow.set_tracking_uri(moved.tracking.resolved_uri())
    run = mlflow.get_run(report.mlflow_run_id)
    assert run.data.tags["memfit.plan"] == "replanned" and run.data.tags["memfit.plan_changes"] == line
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "memory")}
    assert "memory/plan-at-step-4.json" in artifacts
