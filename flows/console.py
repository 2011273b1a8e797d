"""The terminal of `memfit run`: an expected error is memfit's one line; Prefect's traceback goes to a log file."""

from __future__ import annotations

import datetime as dt
import logging
import traceback
from collections.abc import Callable
from pathlib import Path

from memfit.errors import MemfitError


class OneLineErrors(logging.Filter):
    """On console handlers: drop Prefect's "Task run failed" / "Flow run encountered an exception" records whose
    exception is a MemfitError (or any exception once a stop signal came), appending their traceback to
    `log_file` instead. The Prefect UI keeps the message, as the failed state's message and in the API logs."""

    def __init__(self, log_file: Path, signalled: Callable[[], bool] = lambda: False) -> None:
        super().__init__("memfit-one-line-errors")
        self.log_file = log_file
        self.signalled = signalled
        self.captured: list[BaseException] = []

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not (isinstance(exc, MemfitError) or self.signalled()):
            return True
        self._append(record, exc)
        return False

    def _append(self, record: logging.LogRecord, exc: BaseException) -> None:
        self.captured.append(exc)
        try:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            when = dt.datetime.now().isoformat(" ", "seconds")
            text = "".join(traceback.format_exception(exc))
            with self.log_file.open("a") as fh:
                fh.write(f"--- {when} {record.name}: {record.getMessage()}\n{text}\n")
        except OSError:
            pass  # the one line still reaches the terminal; the file is an extra

    def holds(self, err: BaseException) -> bool:
        """True when the traceback of `err` (or an exception with the same message) went to the log file."""
        return any(e is err or str(e) == str(err) for e in self.captured)


def _console_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    seen: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            # Console output only: files and Prefect's API log handler keep every record, tracebacks included.
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                seen[id(h)] = h
    return list(seen.values())


def quiet_expected_errors(log_file: Path, signalled: Callable[[], bool] = lambda: False) -> OneLineErrors:
    """Install the filter on every console handler Prefect and memfit have set up (call after importing them)."""
    flt = OneLineErrors(log_file, signalled)
    for h in _console_handlers():
        if not any(isinstance(f, OneLineErrors) for f in h.filters):
            h.addFilter(flt)
    return flt


def remove_filters() -> None:
    for h in _console_handlers():
        for f in [f for f in h.filters if isinstance(f, OneLineErrors)]:
            h.removeFilter(f)
