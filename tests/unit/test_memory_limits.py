"""A run stopped at the memory limit: the measured peak is kept, and the planner picks a leaner stack from it."""

from __future__ import annotations

import json
import logging

import pytest
from test_plan import BASE, N, candidates, est, plan

from memfit import config
from memfit.memory.estimator.compose import Stack
from memfit.memory.planner import limits
from memfit.memory.planner.plan import MeasuredPeak, choose, measured_reason, plan_table_markdown
from memfit.reports import PlanReport

pytestmark = pytest.mark.unit
GB = 10**9


def stopped(e, measured: int, limit: int, step: int = 40) -> MeasuredPeak:
    return MeasuredPeak(stack=e.stack, kinds=e.kinds, predicted_bytes=e.peak_bytes, measured_bytes=measured,
                        step=step, limit_bytes=limit, limit_source="monitor.stop_at_fraction=0.9 of 20 GB")


def test_the_stack_that_stopped_is_out_and_the_next_one_is_leaner():
    cands = candidates()
    first = plan(cands, 100 * GB)
    assert first.chosen.policy == "none"  # the fastest, chosen before the run
    limit = int(0.95 * first.chosen.peak_bytes)
    measured = [stopped(first.chosen, first.chosen.peak_bytes + GB // 10, limit)]
    again = plan(cands, 100 * GB, measured=measured)
    assert again.fits and again.chosen.kinds != first.chosen.kinds
    # Leaner by what the measurement says: its estimate, scaled by measured/predicted, is under the limit.
    assert again.chosen.peak_bytes * measured[0].ratio <= limit
    assert again.chosen.step_seconds == min(c.step_seconds for c in cands if measured_reason(c, measured) is None)
    assert "leaner than none" in again.reason and "measured 16.1 GB at step 40" in again.reason
    row = next(r for r in again.to_dict()["alternatives"] if r["kinds"] == list(first.chosen.kinds))
    assert row["fits"] is False and row["excluded"] == "measured 16.1 GB at step 40 > limit 15.2 GB"
    table = plan_table_markdown(again)
    assert "| no: measured 16.1 GB at step 40 > limit 15.2 GB |" in table  # the user reads why it is out


def test_a_candidate_the_measurement_scales_past_the_limit_is_out_though_its_estimate_fits():
    none, mixed = est(["none"] * N), est(["selective"] * 2 + ["none"] * (N - 2))
    m = stopped(none, int(none.peak_bytes * 1.2), int(none.peak_bytes * 0.99))  # the estimator was 20% short
    assert mixed.peak_bytes < m.limit_bytes  # the estimate alone would fit
    why = measured_reason(mixed, [m])
    assert why is not None and "scaled by what none, fp32, micro-batch 8x1 measured (1.2x its estimate)" in why
    assert measured_reason(est(["full"] * N), [m]) is None
    # A reading below its estimate (the first step's, before the optimizer state) scales nothing down.
    early = stopped(none, int(none.peak_bytes * 0.8), int(none.peak_bytes * 0.7))
    assert early.ratio == 1.0 and measured_reason(mixed, [early]) is not None
    assert measured_reason(est(["full"] * N), [early]) is None


def test_no_leaner_stack_left_is_one_line_naming_the_measured_peak_and_what_to_change():
    full = est(["full"] * N)
    m = stopped(full, full.peak_bytes + GB, full.peak_bytes)
    p = plan(candidates(), 100 * GB, measured=[m])
    assert not p.fits and p.chosen is None and "\n" not in p.error
    assert p.error.startswith("no leaner stack left: full, fp32, micro-batch 8x1 measured 9.8 GB at step 40 > "
                              "limit 8.8 GB")
    assert "What would help:" in p.error and "monitor.stop_at_fraction" in p.error


def test_a_fixed_policy_that_stopped_does_not_fit_and_says_memory_policy_auto():
    none = est(["none"] * N)
    m = stopped(none, none.peak_bytes + GB, none.peak_bytes)
    p = choose([none], 100 * GB, configured=BASE, baseline=none, safety_margin=0.0, fixed_policy="none",
               measured=[m])
    assert not p.fits and p.chosen is none and p.excluded(none)
    assert p.error.startswith("memory.policy=none: none, fp32, micro-batch 8x1 measured") and "memory.policy=auto" \
        in p.error


def _plan_report(**update) -> PlanReport:
    fields = {"policy": "none", "every_k": 2, "precision": "fp32", "micro_batch_size": 8, "grad_accum_steps": 2,
              "reason": "", "description": "none", "block_kinds": ["none", "none"], "loss": "plain",
              "optimizer": "adamw", "optimizer_in_backward": False, "lean_layers": False,
              "predicted_peak_bytes": 12_491_932}
    return PlanReport(**{**fields, **update})


READING = {"step": 10, "peak_bytes": 12_496_036, "budget_bytes": 13_500_000, "budget_source": "memory.budget_gb",
           "measure": "tensor_peak"}


def test_a_record_round_trips_as_json_and_matches_the_planners_stack():
    rec = limits.record_from(_plan_report(), READING, "id-1", 0.85, now=100.0)
    assert rec.stack == Stack("fp32", 8, 2, False) and rec.kinds == ("none", "none")
    text = json.dumps(limits.to_payload([rec]))
    assert limits.from_payload(json.loads(text), "x") == [rec]
    [m] = limits.measured_peaks([rec], "id-1", budget_gb=0.0135, stop_at_fraction=0.85)
    assert m.limit_bytes == 11_475_000 and m.measured_bytes == 12_496_036 and m.stack == rec.stack
    assert m.limit_source == "monitor.stop_at_fraction=0.85 of 0.0135 GB memory.budget_gb"


def test_a_record_applies_to_its_workload_while_its_peak_is_still_over_the_limit():
    rec = limits.record_from(_plan_report(), READING, "id-1", 0.85, now=100.0)
    assert limits.measured_peaks([rec], "another-workload", 0.0135, 0.85) == []
    assert limits.measured_peaks([rec], "id-1", 0.0150, 0.85) == []  # budget raised: 12.5 MB < 12.75 MB now fits
    assert limits.measured_peaks([rec], "id-1", 0.0135, None) == []  # no stop fraction: the budget is the limit
    assert len(limits.measured_peaks([rec], "id-1", 0.0135, 0.9)) == 1


def test_merge_keeps_the_newest_record_per_stack():
    a = limits.record_from(_plan_report(), READING, "id-1", 0.85, now=100.0)
    b = limits.record_from(_plan_report(), {**READING, "step": 30}, "id-1", 0.85, now=200.0)
    c = limits.record_from(_plan_report(policy="mixed", block_kinds=["selective", "none"]), READING, "id-1", 0.85,
                           now=150.0)
    merged = limits.merge([a, c], [b])
    assert [(r.kinds, r.step) for r in merged] == [(("selective", "none"), 10), (("none", "none"), 30)]


def test_kept_in_the_checkpoint_store_another_machine_finds_it(tmp_path, caplog):
    from memfit.storage import open_store

    store = open_store(str(tmp_path / "checkpoints"))
    rec = limits.record_from(_plan_report(), READING, "id-1", 0.85, now=100.0)
    here, there = tmp_path / "a" / "limits.json", tmp_path / "b" / "limits.json"
    written = limits.save(store, here, rec)
    assert written == [f"{store.uri.rstrip('/')}/memory-limits.json", str(here)]
    doc = json.loads((tmp_path / "checkpoints" / "memory-limits.json").read_text())  # JSON, never pickle
    assert doc["format"] == "memfit-memory-limits/1" and doc["records"][0]["measured_bytes"] == 12_496_036
    assert limits.load(store, there) == [rec]  # the other machine has no local copy
    assert limits.load(open_store(str(tmp_path / "empty")), here) == [rec]  # nor this one a store copy
    (tmp_path / "checkpoints" / "memory-limits.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="memfit.memory"):
        assert limits.load(store, here) == [rec]
    assert "using the local plan cache only" in caplog.text


def test_on_memory_limit_stop_plans_as_before(tmp_path):
    from memfit.run_context import identity_key, measured_peaks_for, memory_limits_path
    from memfit.storage import open_store

    sets = {"checkpoint": {"uri": str(tmp_path / "ck")}, "run": {"work_dir": str(tmp_path / "work")},
            "memory": {"budget_gb": 0.0135}, "monitor": {"stop_at_fraction": 0.85}}
    cfg = config.from_dict(sets)
    rec = limits.record_from(_plan_report(), READING, identity_key(cfg), 0.85, now=100.0)
    limits.save(open_store(str(tmp_path / "ck")), memory_limits_path(cfg), rec)
    assert len(measured_peaks_for(cfg)) == 1
    assert measured_peaks_for(config.from_dict({**sets, "recovery": {"on_memory_limit": "stop"}})) == []
