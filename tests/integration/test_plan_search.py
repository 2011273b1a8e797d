"""The search's shortcut: a stack whose no-checkpointing estimate already fits, or is already slower than a stack
that fits, has its checkpointed forms left untraced; the plan is the one the exhaustive search makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit import config
from memfit.config.devices import get_profile
from memfit.memory.planner import search

pytestmark = pytest.mark.integration  # ~50 fake-tensor traces of a tiny model
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _plan(cfg: config.MemfitConfig, est: search.Estimator, budget: int, *, shortcut: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[search.Plan, int]:
    """The plan, and how many kind traces the estimator holds after it (shared: the exhaustive search traces
    only what the shortcut left out)."""
    with monkeypatch.context() as m:
        if not shortcut:
            m.setattr(search, "settled", lambda *a, **k: False)
        plan = search.plan_for(cfg, get_profile("cpu"), budget, "memory.budget_gb", estimator=est)
    return plan, len(est._traces)


def test_the_shortcut_makes_the_exhaustive_searchs_plan_with_fewer_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(TINY, ["tracking.backend=null", "train.batch_size=8", "train.grad_accum_steps=1",
                                   "memory.lean_layers=false", "memory.optimizer=adamw"])
    est = search.make_estimator(cfg, get_profile("cpu"))
    stack = search.configured_stack(cfg)
    n = est.n_blocks
    none, full = (est.estimate(stack, k).peak_bytes for k in (("none",) * n, ("full",) * n))
    # Only a smaller micro-batch fits; checkpointing at the configured one fits.
    budgets = [int((full + (none - full) * f) / 0.95) for f in (-0.5, 0.5)]
    cut = fewer = 0
    for budget in budgets:
        est = search.make_estimator(cfg, get_profile("cpu"))
        fast, traced = _plan(cfg, est, budget, shortcut=True, monkeypatch=monkeypatch)
        slow, exhaustive = _plan(cfg, est, budget, shortcut=False, monkeypatch=monkeypatch)
        assert fast.fits == slow.fits and fast.chosen is not None and slow.chosen is not None, budget
        assert (fast.chosen.stack, fast.chosen.kinds) == (slow.chosen.stack, slow.chosen.kinds), budget
        assert fast.chosen.step_seconds == slow.chosen.step_seconds and fast.reason == slow.reason
        assert traced <= exhaustive
        cut += fast.settled_stacks
        fewer += traced < exhaustive
    assert cut > 0 and fewer > 0  # the shortcut took effect somewhere, and spared traces there
