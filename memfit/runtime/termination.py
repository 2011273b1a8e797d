"""SIGTERM or Ctrl-C at any moment: the process ends within the grace period, exit 75, whatever still runs."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memfit.errors import MemfitError
from memfit.runtime.signal_relay import SignalRelay

log = logging.getLogger("memfit.runtime.termination")
EXIT_PREEMPTED = 75  # the documented code: run the same command again to resume


class Interrupted(MemfitError):
    """A stop signal arrived outside training (waiting for a slot, loading, exporting): nothing to save."""

    exit_code = EXIT_PREEMPTED

    @classmethod
    def by(cls, signal_name: str | None) -> Interrupted:
        return cls(f"stopped by {signal_name}; run the same command again to resume from the newest committed "
                   "training checkpoint")


class ExitGuard:
    """Bounds how long a stop signal may take to end the process.

    Three parts, because the handler that sees a signal is not always ours (Prefect's flow engine and the
    trainer install their own while they run): (1) our handler, active outside them, raises Interrupted;
    (2) a wakeup fd, written by the interpreter for every signal whatever handler runs, arms a deadline
    timer; (3) `exit()` runs the at-exit work (Prefect's log drain, its server stop) on a clock. At the
    deadline the process prints one line and leaves with os._exit: nothing may wait on a server that is gone.
    """

    def __init__(self, grace_s: float = 30.0, exit_budget_s: float = 15.0) -> None:
        self.grace_s = grace_s
        self.exit_budget_s = exit_budget_s
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._armed = threading.Lock()
        self._timer: threading.Thread | None = None
        self._relay: SignalRelay | None = None  # the wakeup fd's reader: arms the deadline off the handler
        self._announced = False
        self._calls = 0

    # -- installing ----------------------------------------------------------------------------------
    def install(self) -> ExitGuard:
        """Call from the main thread, before anything else installs handlers."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)
        relay = SignalRelay(self._on_wakeup, name="memfit-exit-guard")
        try:
            signal.set_wakeup_fd(relay.write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            relay.close()
            return self
        self._relay = relay
        return self

    def _on_wakeup(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.arm(signal.Signals(signum).name)

    def _handler(self, signum: int, frame: Any) -> None:
        # No lock and no log line here: the interrupted main thread may hold the lock either would wait for (a log
        # handler's, mid-record), for ever. The name is noted as it is; the watcher thread says so and starts the
        # deadline (the interpreter writes the wakeup fd for every signal; written here too, in case another library
        # took the wakeup fd over since).
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name, self.received_at = name, time.monotonic()
        if self._relay is not None:
            self._relay.notify(signum)
        # Prefect's handler re-sends the signal to this one once it has recorded the crash: that is the first
        # time this handler runs, not a second signal. A second call is a second signal: leave at once.
        self._calls += 1
        if self._calls > 1:
            self._leave(f"second {name}: stopping now")
        raise Interrupted.by(name)

    def check(self) -> None:
        """Raise Interrupted if a stop signal has come. Its handler's exception can be swallowed by the library
        code that happens to run when the signal lands: Prefect's import wraps its analytics start-up (about a
        second of imports) in `except Exception: pass`, and a Ctrl-C there let the run train on to the end."""
        if self.signal_name is not None:
            raise Interrupted.by(self.signal_name)

    # -- the deadline -------------------------------------------------------------------------------
    @property
    def signalled(self) -> bool:
        return self.signal_name is not None

    def arm(self, name: str) -> None:
        """Start the deadline at the first stop signal (idempotent). Never from a signal handler: it logs."""
        with self._armed:
            if self.signal_name is None:
                self.signal_name, self.received_at = name, time.monotonic()
            if not self._announced:
                self._announced = True
                log.warning("received %s: stopping; the process exits %d within %.0f s (checkpoint.grace_seconds)",
                            self.signal_name, EXIT_PREEMPTED, self.grace_s)
            if self._timer is not None:
                return
            self._timer = threading.Thread(target=self._deadline, name="memfit-exit-deadline", daemon=True)
            self._timer.start()

    def _deadline(self) -> None:
        assert self.received_at is not None
        time.sleep(max(0.0, self.received_at + self.grace_s - time.monotonic()))
        self._leave(f"{self.signal_name} was received {self.grace_s:.0f} s ago (checkpoint.grace_seconds) and the "
                    "run had not ended: exiting now; run the same command again to resume from the newest "
                    "committed training checkpoint")

    def _leave(self, line: str, code: int = EXIT_PREEMPTED) -> None:
        try:
            sys.stderr.write(f"error: {line}\n")
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    # -- leaving -----------------------------------------------------------------------------------
    def exit(self, code: int) -> None:
        """Leave with `code` after the at-exit work, which gets `exit_budget_s` (less once a signal came)."""
        budget = self.exit_budget_s
        if self.received_at is not None:
            budget = min(budget, max(1.0, self.received_at + self.grace_s - time.monotonic()))
        worker = threading.Thread(target=_run_exit_functions, name="memfit-atexit", daemon=True)
        worker.start()
        worker.join(budget)
        if worker.is_alive():
            log.warning("at-exit work (Prefect's log drain, server stop) took over %.0f s: leaving without it",
                        budget)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_exit_functions() -> None:
    """What a normal interpreter exit runs, in its order, but leaving to `exit` the os._exit at the end.

    First the callbacks libraries register with `threading._register_atexit`, which `threading._shutdown` runs
    before any `atexit` function: Prefect drains its log and event workers there. Skipping them left those to
    `logging.shutdown`, the last `atexit` function, after the ephemeral server's stop: the flow run's last
    log lines were lost and the exit waited out Prefect's 5 s flush timeout against a stopped server."""
    for callback in list(getattr(threading, "_threading_atexits", ())):  # CPython's list for those callbacks
        try:
            callback()
        except Exception:  # noqa: BLE001 - an at-exit failure must not change the exit code
            log.debug("threading at-exit callback failed", exc_info=True)
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001 - an at-exit failure must not change the exit code
        log.debug("at-exit work failed", exc_info=True)


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Run the block whole: a SIGINT or SIGTERM landing in it is handled as it ends, by the handler it would meet.

    Blocking the signals (pthread_sigmask) is not enough: it masks the main thread only, and the kernel then hands a
    process-directed signal to another thread (the exit guard's relay, a library's), after which the interpreter
    still runs the Python handler in the main thread at its next bytecode. So the handlers are swapped for one that
    notes the signal; the first noted one is raised again once the block is done. Outside the main thread (where
    handlers cannot change) the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None and handler != signal.SIG_IGN:  # None: set outside Python, cannot be put back
            previous[sig] = signal.signal(sig, lambda signum, _frame: noted.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])  # delivered to this thread now: its handler runs before the next line
