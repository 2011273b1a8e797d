"""The kill-trials benchmark, short: two SIGKILLs in the default mode, one in training, each rerun bitwise equal."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_two_killed_runs_one_in_training_resume_to_the_reference_weights(default_mode_bench):
    import kill_trials

    bench = default_mode_bench
    # The benchmark's own seeded plan: the first target outside training, and the one landing mid-upload.
    plan = bench.plan(len(kill_trials.TARGETS), seed=12)
    early = next(t for t in plan if t.aim not in ("training", "mid-upload"))
    upload = next(t for t in plan if t.aim == "mid-upload")
    trials = [bench.trial("kill-early", early), bench.trial("kill-training", upload)]
    report = kill_trials.table(trials)

    for t in trials:
        assert t.kill_s is not None and not t.note.startswith("ended"), report  # each really was killed
        assert t.ok and t.equal, report
        assert t.resumed == t.newest, report  # from the newest complete checkpoint the kill left
    in_training = trials[1]
    assert in_training.phase.startswith("training") and in_training.resumed > 0, report
    assert 0 < in_training.resumed < 40, report
