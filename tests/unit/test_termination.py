"""A stop signal is never lost: raised again at memfit's own check points when library code swallowed it."""

from __future__ import annotations

import signal

import pytest

from memfit.runtime.termination import EXIT_PREEMPTED, ExitGuard, Interrupted

pytestmark = pytest.mark.unit


def _guard() -> ExitGuard:
    guard = ExitGuard(grace_s=30)
    guard._deadline = lambda: None  # the grace timer would end this test process
    return guard


def test_a_signal_swallowed_by_library_code_is_raised_again_at_the_check():
    guard = _guard()
    guard.check()  # no signal yet: nothing happens
    try:
        guard._handler(signal.SIGINT, None)  # as the interpreter runs it when Ctrl-C lands during an import
    except Exception:  # noqa: BLE001 - what Prefect's import does around its analytics start-up
        pass
    assert guard.signalled and guard.signal_name == "SIGINT"
    with pytest.raises(Interrupted, match="stopped by SIGINT") as raised:
        guard.check()
    assert raised.value.exit_code == EXIT_PREEMPTED == 75
    with pytest.raises(Interrupted):  # every later check too: the run cannot go on past any of them
        guard.check()


def test_a_signal_seen_only_by_the_wakeup_watcher_also_stops_at_the_check():
    # Another handler (Prefect's, the trainer's) ran instead of ours: the wakeup fd still armed the guard.
    guard = _guard()
    guard.arm("SIGTERM")
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        guard.check()
