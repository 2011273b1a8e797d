"""The search's shortcuts: a stack whose no-checkpointing estimate already fits, or is already slower than a stack
that fits, has its checkpointed forms left untraced, and one that does not fit with every block fully checkpointed
has no selective form traced; the plan is the one the exhaustive search makes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from memfit import config
from memfit.config.devices import get_profile
from memfit.memory.planner import search
from memfit.memory.planner.plan import assignments, plan_table_markdown

pytestmark = pytest.mark.integration  # ~50 fake-tensor traces of a tiny model
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _plan(cfg: config.MemfitConfig, est: search.Estimator, budget: int, *, shortcut: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[search.Plan, int]:
    """The plan, and how many kind traces the estimator holds after it (shared: the exhaustive search traces
    only what the shortcut left out)."""
    with monkeypatch.context() as m:
        if not shortcut:
            m.setattr(search, "settled", lambda *a, **k: False)
            m.setattr(search, "selective_may_fit", lambda *a, **k: True)
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


def test_a_selective_block_never_peaks_below_a_full_one() -> None:
    """What sparing the selective forms rests on: each mix with selective blocks peaks at least where the same mix
    with those blocks full does (so above every block full), at every micro-batch the search tries."""
    cfg = config.load(TINY, ["tracking.backend=null", "train.batch_size=8", "train.grad_accum_steps=1",
                             "memory.lean_layers=false", "memory.optimizer=adamw", "model.num_layers=4"])
    est = search.make_estimator(cfg, get_profile("cpu"))
    n = est.n_blocks
    checked = 0
    for micro in (8, 4, 1):
        stack = replace(search.configured_stack(cfg), micro_batch_size=micro, grad_accum_steps=8 // micro)
        for kinds in assignments(n, ("none", "selective", "full")):
            if "selective" in kinds:
                as_full = tuple("full" if k == "selective" else k for k in kinds)
                assert est.estimate(stack, kinds).peak_bytes >= est.estimate(stack, as_full).peak_bytes, (micro, kinds)
                checked += 1
    assert n == 4 and checked == 3 * 10  # 4 blocks: 10 mixes with selective at each micro-batch


def test_a_stack_that_does_not_fit_fully_checkpointed_gets_no_selective_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(TINY, ["tracking.backend=null", "train.batch_size=8", "train.grad_accum_steps=1",
                             "memory.lean_layers=false", "memory.optimizer=adamw"])
    est = search.make_estimator(cfg, get_profile("cpu"))
    stack = search.configured_stack(cfg)
    full = est.estimate(stack, ("full",) * est.n_blocks).peak_bytes
    budget = int(full * 0.9 / 0.95)  # below every block full at micro-batch 8: only a smaller micro-batch can fit
    est = search.make_estimator(cfg, get_profile("cpu"))
    fast, traced = _plan(cfg, est, budget, shortcut=True, monkeypatch=monkeypatch)
    selective_at_8 = [k for k in est._traces if k[3:6] == ("selective", 8, 1)]  # the configured stack
    slow, exhaustive = _plan(cfg, est, budget, shortcut=False, monkeypatch=monkeypatch)
    assert fast.fits and (fast.chosen.stack, fast.chosen.kinds) == (slow.chosen.stack, slow.chosen.kinds)
    assert fast.chosen.stack.micro_batch_size < 8 and fast.reason == slow.reason
    assert selective_at_8 == [] and traced < exhaustive
    assert fast.no_selective_stacks >= 1 and slow.no_selective_stacks == 0
    assert f"{fast.no_selective_stacks} stack(s) without a selective row" in plan_table_markdown(fast)
    assert any(k[3:6] == ("selective", 8, 1) for k in est._traces)  # the exhaustive search traced it
