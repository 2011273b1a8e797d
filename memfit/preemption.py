"""Preemption: SIGTERM/SIGINT set a stop flag the training loop checks after each optimizer step."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("memfit.preemption")


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[threading.Event]:
    """Yield an Event set by the first SIGTERM/SIGINT; a second SIGINT interrupts as usual.

    Handlers can only be installed from the main thread; elsewhere the event still works for callers
    (a spot-notice watcher, a test) but signals keep their default action, and a warning says so.
    """
    stop = threading.Event()
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("received %s: finishing the current optimizer step, then saving a training checkpoint",
                    signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
    else:
        log.warning("not on the main thread: SIGTERM will not trigger a last training checkpoint")
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
