"""Preemption: SIGTERM/SIGINT (or a spot notice) set a stop flag the training loop checks after each step."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memfit.runtime.signal_relay import SignalRelay

log = logging.getLogger("memfit.runtime.preemption")


class SignalFlag(threading.Event):
    """An Event a signal handler can set without a lock: `note()` flips a plain attribute, which is_set and wait read
    (the loop sees it at its very next check); the relay thread then wakes the waiters (wake, or set)."""

    def __init__(self) -> None:
        super().__init__()
        self._noted = False

    def note(self) -> None:
        self._noted = True

    def wake(self) -> None:
        """Off the handler's thread: wake the waiters of a noted flag (its state stays as note() left it)."""
        with self._cond:
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._noted or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._noted:
            return True
        super().wait(timeout)  # ends at set(), wake() or the timeout
        return self.is_set()

    def clear(self) -> None:
        self._noted = False
        super().clear()


class StopFlag(SignalFlag):
    """A flag that also records why and when it was first set (a signal name, a spot notice)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None
        self.requested_at: float | None = None  # time.monotonic() of the first request
        self._reason_lock = threading.Lock()

    def note_signal(self, reason: str) -> None:
        """From a signal handler: plain attribute writes only (a thread's request() racing it can at worst give
        its own reason)."""
        if self.reason is None:
            self.reason, self.requested_at = reason, time.monotonic()
        self.note()

    def request(self, reason: str) -> None:
        with self._reason_lock:
            if self.reason is None:
                self.reason, self.requested_at = reason, time.monotonic()
        self.set()

    def seconds_since_request(self) -> float | None:
        return None if self.requested_at is None else time.monotonic() - self.requested_at


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[StopFlag]:
    """Yield a StopFlag set by the first SIGTERM/SIGINT; a second SIGINT interrupts as usual.

    The handler notes the stop (a plain attribute: the loop's next check sees it) and hands the rest to a relay
    thread (signal_relay.py: a handler that logged could wait forever on a lock the interrupted main thread held),
    which says so and wakes the flag's waiters. Handlers can only
    be installed from the main thread; elsewhere the flag still works for callers (the spot watcher, a test) but
    signals keep their default action, and a warning says so.
    """
    stop = StopFlag()
    previous: dict[int, Any] = {}

    def relayed(signum: int) -> None:
        name = signal.Signals(signum).name
        log.warning("received %s: finishing the current optimizer step, then saving a training checkpoint", name)
        stop.request(name)

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt
        stop.note_signal(signal.Signals(signum).name)  # seen by the loop's next check, as it always was
        relay.notify(signum)  # the log line and the waiters' wake-up, off this thread

    relay: SignalRelay | None = None
    if threading.current_thread() is threading.main_thread():
        relay = SignalRelay(relayed, name="memfit-stop-relay")
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
    else:
        log.warning("not on the main thread: SIGTERM will not trigger a last training checkpoint")
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if relay is not None:
            relay.close()


@contextmanager
def save_on_signal(sig: int = signal.SIGUSR1) -> Iterator[threading.Event]:
    """Yield an Event set by `sig`: a request for an extra training checkpoint (a rank's rebalance notice). Set
    through a relay thread too: a second signal landing inside the first handler's Event.set would wait on the
    Event's own lock for ever."""
    requested = SignalFlag()
    previous, relay = None, None

    def handler(signum: int, frame: Any) -> None:
        requested.note()
        relay.notify(signum)

    if threading.current_thread() is threading.main_thread():
        relay = SignalRelay(lambda signum: requested.wake(), name="memfit-save-relay")
        previous = signal.signal(sig, handler)
    try:
        yield requested
    finally:
        if previous is not None:
            signal.signal(sig, previous)
        if relay is not None:
            relay.close()
