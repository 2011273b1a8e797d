"""Phase 2 reuses its plan for the same config, device, architecture and code, and plans again otherwise."""

from __future__ import annotations

import logging

import pytest

from memfit import phases
from memfit.memory.planner import plan_cache, run_plan

pytestmark = pytest.mark.integration


@pytest.fixture
def counted(monkeypatch):
    """Each call of the planner proper (what the cache saves), recorded."""
    calls: list[float | None] = []
    real = run_plan.plan_for

    def plan_for(cfg, profile, budget, source, **kwargs):
        calls.append(budget)
        return real(cfg, profile, budget, source, **kwargs)

    monkeypatch.setattr(run_plan, "plan_for", plan_for)
    return calls


def test_the_same_run_reuses_its_plan_and_a_change_plans_again(tiny_config, counted, caplog, monkeypatch):
    probe = phases.check_environment_and_probe(tiny_config())
    # A budget below the plain step's peak: the planner searches (gradient checkpointing is chosen).
    budget_gb = probe.baseline["peak_bytes"] * 0.7 / 1e9
    cfg = tiny_config(**{"memory.budget_gb": budget_gb})
    first = phases.plan_stack(cfg, probe)
    assert first.policy != "none" and len(counted) == 1
    with caplog.at_level(logging.INFO, logger="memfit"):
        again = phases.plan_stack(cfg, probe)
    assert again == first and len(counted) == 1, "the same config planned again"
    assert "memory plan from cache" in caplog.text
    assert f"optimisation stack: {first.description}" in caplog.text  # the run's log reads as before
    # Another budget, another config: planned, and a budget with room chooses no recompute.
    roomy = phases.plan_stack(tiny_config(**{"memory.budget_gb": budget_gb * 100}), probe)
    assert len(counted) == 2 and roomy.policy == "none"
    # An edit to memfit's code (or a library upgrade) is another key too.
    from memfit.memory.planner.search import resolve_budget, target_profile

    profile = target_profile(cfg.memory, probe.environment["device"])
    args = (cfg, profile, *resolve_budget(cfg.memory, profile, probe.environment["device"]), probe.architecture)
    key = plan_cache.plan_key(*args)
    assert plan_cache.cache_path(cfg.run.work_dir, key).is_file()
    monkeypatch.setattr(plan_cache, "code_fingerprint", lambda: "another version of memfit")
    assert plan_cache.plan_key(*args) != key


def test_an_unreadable_cached_plan_is_planned_again_and_rewritten(tiny_config, counted, caplog):
    cfg = tiny_config()
    probe = phases.check_environment_and_probe(cfg)
    first = phases.plan_stack(cfg, probe)
    (cached,) = (plan_cache.cache_path(cfg.run.work_dir, "x").parent).glob("*.json")
    cached.write_text(cached.read_text()[:40])  # cut short, as a full disk would leave it
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert phases.plan_stack(cfg, probe) == first
    assert "ignoring unreadable plan cache" in caplog.text and len(counted) == 2
    assert plan_cache.load_plan(cached) == first  # whole again
    assert not [p for p in cached.parent.iterdir() if p.suffix != ".json"]  # no temporary file left


def test_a_plan_that_does_not_fit_is_not_cached(tiny_config, counted):
    cfg = tiny_config(**{"memory.policy": "none", "memory.budget_gb": 0.002})  # the weights fit, the step not
    probe = phases.check_environment_and_probe(tiny_config())
    assert phases.plan_stack(cfg, probe).fits is False  # a forced policy predicted not to fit: a warning
    assert phases.plan_stack(cfg, probe).fits is False
    assert len(counted) == 2
