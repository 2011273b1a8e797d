"""Recovery's rules: a logical run's attempts, the restart budget, the backoff, the record, the automations."""

from __future__ import annotations

import json

import pytest

from memfit import config as cfgmod
from memfit.errors import ConfigError
from memfit.runtime import recovery as rules
from memfit.runtime.recovery import PastAttempt, decide_attempt

pytestmark = pytest.mark.unit


def _a(i: int, name: str, kind: str, message: str = "", end: float | None = None) -> PastAttempt:
    return PastAttempt(f"run-{i}", name, kind, message, start_time=100.0 * i, end_time=end or 100.0 * i + 50)


def test_a_fresh_run_is_attempt_one():
    d = decide_attempt([], max_restarts=3, key="k")
    assert (d.attempt, d.proceed, d.cause, d.run_key) == (1, True, None, "k")


def test_each_restartable_end_is_one_restart_and_the_cause_comes_from_the_state():
    history = [_a(1, "Preempted", "FAILED"), _a(2, "Crashed", "CRASHED", rules.SILENT_MESSAGE.format(seconds=90))]
    d = decide_attempt(history, max_restarts=3)
    assert (d.attempt, d.restarts_used, d.proceed, d.cause, d.previous_flow_run) == (3, 2, True, "vanished", "run-2")
    assert d.previous_end == 250.0
    assert decide_attempt([_a(1, "Crashed", "CRASHED", "process exited")], 3).cause == "crashed"
    assert decide_attempt([_a(1, "MemoryLimit", "FAILED")], 3).cause == "memory_limit"


def test_past_the_budget_the_run_stops_naming_the_budget_and_the_last_cause():
    history = [_a(1, "Preempted", "FAILED"), _a(2, "Preempted", "FAILED")]
    d = decide_attempt(history, max_restarts=1)
    assert not d.proceed and d.attempt == 3 and d.restarts_used == 1
    assert "1 of recovery.max_restarts=1" in d.reason and "preempted" in d.reason
    assert not decide_attempt([_a(1, "Crashed", "CRASHED")], max_restarts=0).proceed


def test_an_end_for_good_starts_a_new_logical_run():
    # Completed, failed on input, cancelled or budget spent: the next run with the same key starts afresh.
    for name, kind in (("Completed", "COMPLETED"), ("Failed", "FAILED"), ("Cancelled", "CANCELLED"),
                       (rules.BUDGET_SPENT, "FAILED")):
        d = decide_attempt([_a(1, "Preempted", "FAILED"), _a(2, name, kind)], max_restarts=1)
        assert (d.attempt, d.proceed) == (1, True), name
    # A run still running or queued with the same key is not an ended attempt.
    assert decide_attempt([_a(1, "Preempted", "FAILED"), _a(2, "Running", "RUNNING")], 3).attempt == 2


def test_backoff_doubles_up_to_the_cap_and_counts_time_already_waited():
    assert rules.backoff_delays(10, 300) == [10, 20, 40, 80, 160, 300]
    assert rules.backoff_delays(0, 300) == [0]
    assert rules.backoff_wait(1, 10, 300, since_end_s=12) == 0
    assert rules.backoff_wait(3, 10, 300, since_end_s=15) == 25
    assert rules.backoff_wait(40, 10, 300, since_end_s=0) == 300


def test_the_run_key_is_the_name_and_the_store():
    a = rules.run_key("my run/1", "s3://b/x")
    assert a.startswith("my-run-1-") and a != rules.run_key("my run/1", "s3://b/y")
    assert a == rules.run_key("my run/1", "s3://b/x")


def test_the_recovery_record_says_cause_step_and_what_was_lost():
    d = decide_attempt([_a(1, "Crashed", "CRASHED", "memfit: no heartbeat for 90 s")], 3).model_dump()
    metrics, tags = rules.recovery_record(d, resumed_step=40, last_logged_step=47, last_seen=150.0, now=230.0)
    assert metrics == {"recovery/resumed_from_step": 40.0, "recovery/steps_lost": 7.0, "recovery/downtime_s": 80.0,
                       "recovery/attempt": 2.0}
    assert tags["memfit.recovery.last_cause"] == "vanished" and tags["memfit.attempts"] == "2"
    assert tags["memfit.recovery.2"] == "cause=vanished from_step=40 steps_lost=7 downtime_s=80.0 " \
                                        "previous_flow_run=run-1"
    # A rerun by hand (memfit run after exit 75): no attempt, the cause unknown, nothing invented.
    metrics, tags = rules.recovery_record(None, resumed_step=20, last_logged_step=None, last_seen=None, now=1.0)
    assert metrics == {"recovery/resumed_from_step": 20.0, "recovery/steps_lost": 0.0}
    assert tags == {"memfit.recovery.rerun": "cause=rerun from_step=20 steps_lost=0", "memfit.recovery.last_cause":
                    "rerun"}


@pytest.mark.parametrize(("override", "field"), [
    ("recovery.max_restarts=-1", "recovery.max_restarts"),
    ("recovery.heartbeat_seconds=100", "recovery.heartbeat_seconds"),
    ("recovery.heartbeat_seconds=10", "recovery.heartbeat_seconds"),
    ("recovery.backoff_seconds=500", "recovery.backoff_seconds"),
    ("recovery.on_memory_limit=retry", "recovery.on_memory_limit"),
])
def test_bad_recovery_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfgmod.load(None, [override])


def test_the_automations_follow_the_config():
    from flows.recovery import SAME_PARAMETERS, apply_automations, automations

    cfg = cfgmod.load(None, ["recovery.silent_after_seconds=120", "recovery.backoff_seconds=15"])
    silent, restart, shutdown = automations(cfg)
    assert silent.trigger.posture.value == "Proactive" and silent.trigger.within.total_seconds() == 120
    assert silent.actions[0].state.value == "CRASHED" and "no heartbeat" in silent.actions[0].message
    assert restart.trigger.expect == {"prefect.flow-run.Crashed", "prefect.flow-run.Preempted",
                                      "prefect.flow-run.MemoryLimit"}
    action = restart.actions[0]
    assert action.source == "inferred" and action.schedule_after.total_seconds() == 15
    assert action.parameters == SAME_PARAMETERS and "flow_run.parameters" in json.dumps(action.parameters)
    # A Cancelled is followed only with the message Prefect's runner sets when it shuts down, never a person's.
    assert shutdown.trigger.expect == {"prefect.flow-run.Cancelled"}
    assert shutdown.trigger.match.root["prefect.state-message"] == rules.RUNNER_SHUTDOWN_MESSAGE
    assert shutdown.actions[0].parameters == SAME_PARAMETERS
    rows = apply_automations(cfg, dry_run=True)
    assert [r["name"] for r in rows] == [silent.name, restart.name, shutdown.name] and "applied" not in rows[0]
    assert "with state message 'Runner is shutting down.'" in rows[2]["trigger"]


def test_a_cancel_by_a_shutting_down_runner_is_a_restart_and_a_persons_cancel_ends_the_run():
    shutdown = _a(2, "Cancelled", "CANCELLED", rules.RUNNER_SHUTDOWN_MESSAGE)
    d = decide_attempt([_a(1, "Preempted", "FAILED"), shutdown], max_restarts=3)
    assert (d.attempt, d.restarts_used, d.proceed, d.cause) == (3, 2, True, "runner_shutdown")
    assert "after the previous attempt runner_shutdown" in d.reason
    # Counted against the budget like any other restart.
    assert not decide_attempt([_a(1, "Preempted", "FAILED"), shutdown], max_restarts=1).proceed
    # A person's cancel (UI, CLI: Prefect's runner ends it with another message) is the end of the logical run.
    person = _a(2, "Cancelled", "CANCELLED", "Flow run was cancelled successfully.")
    assert decide_attempt([_a(1, "Preempted", "FAILED"), person], max_restarts=3).attempt == 1
    assert rules.cause_of(person) == "cancelled"


def _live(run_id: str, created: float, key: str | None, lr: float = 1e-3) -> rules.LiveRun:
    return rules.LiveRun(run_id, created, {"config": {"train": {"lr": lr}}}, key)


def test_of_two_restarts_of_one_end_the_later_is_the_duplicate_and_each_says_so_alone():
    early, late = _live("r1", 10.0, "automation a1, action 0, invocation i1"), \
        _live("r2", 11.0, "automation a2, action 0, invocation i2")
    assert rules.duplicate_of(late, [early, late]) == "r1"
    assert rules.duplicate_of(early, [early, late]) is None
    tie = _live("r0", 11.0, "automation a3, action 0, invocation i3")  # same second: the smaller id goes on
    assert rules.duplicate_of(late, [tie, late]) == "r0"


def test_a_run_a_person_or_a_schedule_made_is_never_a_duplicate_nor_makes_a_restart_one():
    restart = _live("r2", 50.0, "automation a1, action 0, invocation i1")
    scheduled_nightly = _live("s1", 1.0, "scheduled 7b1c 9f4e 2026-12-06 02:00:00+00:00")  # created days ahead
    by_hand = _live("m1", 2.0, None)
    assert rules.duplicate_of(restart, [scheduled_nightly, by_hand, restart]) is None
    assert rules.duplicate_of(by_hand, [restart, by_hand]) is None
    other_params = _live("r1", 10.0, "automation a1, action 0, invocation i0", lr=2e-3)
    assert rules.duplicate_of(restart, [other_params, restart]) is None


def test_applying_without_a_server_is_one_line(monkeypatch):
    from flows.recovery import apply_automations

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}), pytest.raises(ConfigError, match="PREFECT_API_URL"):
        apply_automations(cfgmod.load(None, []))
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}), \
            pytest.raises(ConfigError, match=r"PREFECT_API_URL=http://127\.0\.0\.1:9/api: cannot apply"):
        apply_automations(cfgmod.load(None, []))
