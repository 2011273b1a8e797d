"""Signal handlers that take no lock: what a signal asks for runs on a relay thread, never inside the handler."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Callable

# Why: Python runs a handler in the main thread between two bytecodes, wherever that thread is, also inside a
# critical section it holds. A handler that logs then waits for the lock of whatever log handler the main thread was
# in the middle of: Prefect's API log handler takes a plain threading.Lock on every record (APILogWorker.instance),
# and a SIGTERM landing while the loop logged its training checkpoint hung the run until the machine's drain deadline
# killed it, with its last save lost (2 of 4 preemptions in one suite run). The same holds for Event.set (a plain
# Lock) when a second signal lands inside the first handler. So a handler here writes one byte to a pipe (no lock,
# safe at any point) and a thread does the rest.

_STOP = 0  # no signal has number 0: the relay's own "stop reading"


class SignalRelay:
    """A daemon thread that calls `on_signal(signum)` for every `notify(signum)`, in order."""

    def __init__(self, on_signal: Callable[[int], None], name: str = "memfit-signal-relay") -> None:
        self._on_signal = on_signal
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        # In the context of the code that installed it: a Prefect flow run's logs carry its flow run id only there
        # (without, the line never reached the Prefect UI and Prefect warned "without a flow run id").
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name=name, daemon=True)
        self._thread.start()

    @property
    def write_fd(self) -> int:
        """The pipe's non-blocking write end, also fit for signal.set_wakeup_fd (the interpreter writes each
        signal's number there, as notify does)."""
        return self._w

    def notify(self, signum: int) -> None:
        """Called from a signal handler: one write, no lock, never blocks."""
        try:
            os.write(self._w, bytes([signum]))
        except OSError:  # a full pipe already holds a byte that will wake the thread; a closed one: relay over
            pass

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == _STOP:
                    return
                try:
                    self._on_signal(signum)
                except Exception:  # noqa: BLE001 - a failing callback must not end the relay for later signals
                    logging.getLogger("memfit.runtime.signal_relay").exception("signal %d not relayed", signum)

    def close(self, timeout: float = 5.0) -> None:
        """Relay what came before, then end the thread and close the pipe."""
        try:
            os.write(self._w, bytes([_STOP]))
        except OSError:
            pass
        self._thread.join(timeout)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
