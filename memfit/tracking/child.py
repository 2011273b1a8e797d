"""The tracking process: MLflow imported and its store opened in a process of its own, fed over a pipe."""

# Started by `memfit.tracking.process` before the training process imports torch, so MLflow's ≈ 4 s of imports and
# store set-up run on the other core, and its writes never take the training process's GIL. It reads one JSON request
# per line on stdin and answers on stdout; it ends when stdin closes (memfit exited or was SIGKILLed: the kernel
# closes the pipe) or on SIGTERM, after writing what it buffered.

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from memfit.release.registry import publish_on_tracker
from memfit.runtime.importing import collector_paused
from memfit.tracking.records import log_loss_curve, log_memory_figure

# The calls a parent may make: the Tracker Protocol's, and RECORDS (plots, the registry step) by name; anything
# else is refused (the pipe carries data, never code). This process's entry point sits above release/ (layers).
RECORDS = {op.__name__: op for op in (log_loss_curve, log_memory_figure, publish_on_tracker)}
OPS = frozenset({"start_run", "log_params", "log_metrics", "set_tags", "log_text", "log_artifact", "log_table",
                 "log_dataset", "metric_history", "flush", "overhead", "close", "end_run"})
EXIT_FLUSH_S = 10.0  # at most this long to write buffered metrics when the parent is gone


class _Collect(logging.Handler):
    """Log records kept for the next answer: the parent logs them in the caller's thread (and Prefect run)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[list[Any]] = []
        self._guard = threading.Lock()  # not `lock`: Handler.handle holds that one around emit

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            self.records.append([record.levelno, record.name, record.getMessage()])

    def take(self) -> list[list[Any]]:
        with self._guard:
            out, self.records = self.records, []
        return out


def _answer(out: Any, lock: threading.Lock, logs: _Collect, msg: dict[str, Any]) -> None:
    msg["logs"] = logs.take()
    line = json.dumps(msg, default=str) + "\n"
    with lock:
        out.write(line)
        out.flush()


def _finish(tracker: Any) -> None:
    """Write what is buffered (bounded: a dead server must not keep this process alive), then leave."""
    if tracker is not None:
        worker = threading.Thread(target=tracker.close, daemon=True)
        worker.start()
        worker.join(EXIT_FLUSH_S)
    os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (its grace period)
    try:
        os.nice(10)  # the same niceness as the in-process writer thread had: training wins the cores
    except OSError:
        pass
    logs = _Collect()
    logging.basicConfig(level=logging.INFO, handlers=[logs])
    # The answers get a private copy of stdout; fd 1 itself becomes stderr, so that whatever a library prints
    # goes to the terminal and can never be read as an answer.
    out, out_lock = os.fdopen(os.dup(1), "w"), threading.Lock()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    tracker: Any = None
    signal.signal(signal.SIGTERM, lambda *_: _finish(tracker))
    kwargs = json.loads(sys.argv[1])
    try:
        with collector_paused(freeze=True):  # MLflow's imports and the store's set-up (memfit/runtime/importing.py)
            from memfit.tracking.mlflow_tracker import MLflowTracker

            tracker = MLflowTracker(**kwargs)
        _answer(out, out_lock, logs, {"id": 0, "ok": None})
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it in its own words
        _answer(out, out_lock, logs, {"id": 0, "error": str(err), "type": type(err).__name__})
        _finish(None)
    deferred: Exception | None = None  # a fire-and-forget call's failure, raised by the next flush
    for line in sys.stdin:
        req = json.loads(line)
        op, rid = req.get("op"), req.get("id")
        try:
            if op == "exit":
                break
            if op == "records":  # [name, *args]: RECORDS[name](tracker, *args)
                name, *args = req.get("args", [])
                if name not in RECORDS:
                    raise ValueError(f"unknown tracking call records/{name!r}")
                result = RECORDS[name](tracker, *args)
            else:
                if op not in OPS:
                    raise ValueError(f"unknown tracking call {op!r}")
                if op == "flush" and deferred is not None:
                    err, deferred = deferred, None
                    raise err
                result = getattr(tracker, op)(*req.get("args", []), **req.get("kwargs", {}))
                if op == "start_run":
                    result = {"run_id": result, "continued": tracker.continued}
            if rid is not None:
                _answer(out, out_lock, logs, {"id": rid, "ok": result})
        except Exception as err:  # noqa: BLE001 - the caller gets it; a fire-and-forget call at the next flush
            if rid is not None:
                _answer(out, out_lock, logs, {"id": rid, "error": str(err), "type": type(err).__name__})
            else:
                deferred = deferred or err
    _finish(tracker)


if __name__ == "__main__":
    main()
