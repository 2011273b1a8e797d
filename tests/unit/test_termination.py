"""A stop signal is never lost: raised again at memfit's own check points when library code swallowed it."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from memfit.runtime.termination import EXIT_PREEMPTED, ExitGuard, Interrupted, stop_signals_deferred

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


class _Stop(Exception):
    pass


def _raise(signum, frame):
    raise _Stop(signal.Signals(signum).name)


class _Sender:
    """A thread started before the main thread masks the signal (as the exit guard's relay is), which sends it
    process-directed: the kernel hands it to this thread, and the interpreter still runs the Python handler in
    the main thread, at its next bytecode."""

    def __init__(self, sig: int) -> None:
        self.go, self.sent = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._send, args=(sig,))
        self.thread.start()

    def _send(self, sig: int) -> None:
        self.go.wait(10)
        os.kill(os.getpid(), sig)
        self.sent.set()

    def send(self) -> None:
        self.go.set()
        self.sent.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_inside_a_deferred_block_is_handled_when_the_block_is_done(sig):
    sender = _Sender(sig)
    previous = signal.signal(sig, _raise)
    done = []
    try:
        with pytest.raises(_Stop, match=signal.Signals(sig).name), stop_signals_deferred():
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            try:
                sender.send()
                sum(range(10_000))  # bytecode enough for the handler to have run here, were it not deferred
                done.append("block")
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            done.append("unmasked")
        assert done == ["block", "unmasked"]
        assert signal.getsignal(sig) is _raise  # the handler it would have met is back
    finally:
        sender.thread.join()
        signal.signal(sig, previous)


def test_a_deferred_block_without_a_signal_leaves_the_handlers_as_they_were():
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        with stop_signals_deferred():
            pass
        assert signal.getsignal(signal.SIGTERM) is _raise
    finally:
        signal.signal(signal.SIGTERM, previous)
