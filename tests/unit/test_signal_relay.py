"""A stop signal that lands while the main thread holds a log handler's lock is still relayed: no handler waits.

Seen in the suite's preemption chain: SIGTERM landed while the training loop logged its training checkpoint, the old
handler logged too, waited for ever on the lock Prefect's API log handler held, and the machine's drain deadline
killed the run with its last save lost. Here a log handler takes a plain Lock the main thread holds when the signal
comes; a handler that logged would find it taken (`acquire(timeout=...)` so the old code fails instead of hanging).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from memfit.runtime.preemption import save_on_signal, stop_on_signals
from memfit.runtime.signal_relay import SignalRelay
from memfit.runtime.termination import ExitGuard, Interrupted

pytestmark = pytest.mark.unit


class LockedHandler(logging.Handler):
    """A log handler that, like Prefect's API handler, takes a plain (not re-entrant) lock for every record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.held = threading.Lock()
        self.records: list[tuple[str, str]] = []  # (thread name, message)
        self.blocked_on_main = 0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.held.acquire(timeout=2):  # the old handler: the main thread waits on itself
            self.blocked_on_main += threading.current_thread() is threading.main_thread()
            return
        try:
            self.records.append((threading.current_thread().name, record.getMessage()))
        finally:
            self.held.release()


@pytest.fixture()
def locked_log():
    handler = LockedHandler()
    loggers = [logging.getLogger(n) for n in ("memfit.runtime.preemption", "memfit.runtime.termination")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def _signal_while_holding(lock: threading.Lock, sig: int, times: int = 1) -> None:
    """Send `sig` to this process while the main thread holds `lock`, and run bytecodes so the handler runs here."""
    with lock:
        for _ in range(times):
            os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            pass


def test_sigterm_while_the_main_thread_logs_sets_the_flag_and_is_said_by_the_relay(locked_log):
    with stop_on_signals() as stop:
        _signal_while_holding(locked_log.held, signal.SIGTERM)
        assert stop.wait(5), "the stop flag was never set"
        assert stop.reason == "SIGTERM"
        deadline = time.monotonic() + 5
        while not locked_log.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert locked_log.blocked_on_main == 0, "the handler logged on the main thread while it held the log lock"
    [(thread, message)] = locked_log.records
    assert thread != threading.main_thread().name and message.startswith("received SIGTERM: finishing")


def test_the_flag_is_set_before_the_relay_runs_so_the_loop_stops_at_the_step_it_was_in(locked_log):
    # The relay is stuck behind the log lock (held here), yet the loop's next check already sees the stop.
    with stop_on_signals() as stop, locked_log.held:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # bytecodes: the handler runs here
            pass
        assert stop.is_set() and stop.wait(0) and stop.reason == "SIGTERM"
        assert locked_log.records == []  # not said yet: the relay waits for the lock, not this thread


def test_a_save_request_cleared_after_its_save_stays_clear():
    with save_on_signal(signal.SIGUSR1) as requested:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requested.wait(5)
        requested.clear()  # the loop saved
        time.sleep(0.2)  # the relay has woken any waiter by now; it must not set the flag again
        assert not requested.is_set() and not requested.wait(0.1)


def test_two_sigterms_at_once_set_the_flag_once(locked_log):
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        _signal_while_holding(locked_log.held, signal.SIGTERM, times=2)
        assert stop.wait(5) and stop.reason == "SIGTERM"
    assert locked_log.blocked_on_main == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
    assert not [t for t in threading.enumerate() if t.name == "memfit-stop-relay"], "relay thread left running"


def test_a_second_ctrl_c_interrupts_at_once():
    with stop_on_signals() as stop, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_a_save_request_signal_is_relayed():
    with save_on_signal(signal.SIGUSR1) as requested:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requested.wait(5)


def test_the_exit_guards_handler_takes_no_lock_and_the_watcher_says_it(locked_log):
    guard = ExitGuard(grace_s=30)
    guard._deadline = lambda: None  # the grace timer would end this test process
    relayed: list[int] = []
    guard._relay = SignalRelay(relayed.append)  # what install() sets up on the wakeup fd
    with locked_log.held, pytest.raises(Interrupted, match="stopped by SIGTERM"):
        guard._handler(signal.SIGTERM, None)  # as the interpreter runs it, mid-record
    assert locked_log.blocked_on_main == 0 and locked_log.records == []
    guard._relay.close()
    assert guard.signal_name == "SIGTERM" and relayed == [signal.SIGTERM]  # handed to the watcher
    guard._on_wakeup(signal.SIGTERM)  # what the watcher thread does with it
    assert [m for _, m in locked_log.records] == [
        "received SIGTERM: stopping; the process exits 75 within 30 s (checkpoint.grace_seconds)"]


def test_the_draining_runners_notice_logs_nothing_in_the_handler():
    from flows.draining import DrainingRunner

    runner = DrainingRunner(limit=None, query_seconds=1, pause_on_shutdown=False)
    said: list[str] = []
    runner._logger = type("L", (), {"info": lambda *a: said.append(a[0]), "warning": lambda *a: said.append(a[0])})()
    scheduled: list[object] = []
    runner.started, runner._loop = True, object()
    runner.execute_in_background = lambda fn: scheduled.append(fn)
    runner.handle_sigterm(signal.SIGTERM, None)
    assert runner.draining_since is not None and runner.stopping
    assert said == [] and scheduled == [runner._drain]  # said by _drain, on the runner's loop


def test_a_relay_callback_that_fails_does_not_end_the_relay():
    got: list[int] = []

    def on_signal(signum: int) -> None:
        if not got:
            got.append(-signum)
            raise RuntimeError("first one fails")
        got.append(signum)

    relay = SignalRelay(on_signal)
    relay.notify(signal.SIGTERM)
    relay.notify(signal.SIGINT)
    relay.close()
    assert got == [-signal.SIGTERM, signal.SIGINT]


def test_the_relay_runs_in_the_context_it_was_made_in():
    # Prefect's flow run context is a contextvar: the relay's log line carries the flow run id only inside it.
    import contextvars

    var = contextvars.ContextVar("flow_run", default=None)
    seen: list[object] = []
    token = var.set("run-1")
    try:
        relay = SignalRelay(lambda signum: seen.append(var.get()))
    finally:
        var.reset(token)
    relay.notify(signal.SIGTERM)
    relay.close()
    assert seen == ["run-1"]
