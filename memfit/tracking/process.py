"""The run's MLflow tracker in a process of its own, started before torch imports, driven over a pipe."""

# MLflow costs the training process ≈ 4 s of imports and store set-up before the first step, and its writer threads
# share that process's GIL with the training step. `memfit run` starts the tracking process (child.py) at once, beside
# the Prefect server, so both run on the other core while this one imports torch; phase 3 takes it (`take`), and hands
# it back at its end (`close`) for phase 5, which logs the model, registers it and draws the plots there (records.py).
# Everything else (`memfit profile`, `memfit export`, tests calling phases) keeps the in-process MLflowTracker: one
# tracker class does the MLflow work in either place.

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from memfit.errors import TrackingError
from memfit.tracking.base import scrub

log = logging.getLogger("memfit.tracking")
CALL_TIMEOUT_S = 600.0  # a call that gets no answer this long is an error, not a hang
_prestarted: dict[str, TrackingProcess] = {}


def tracker_kwargs(tracking_cfg: Any) -> dict[str, Any]:
    """MLflowTracker's arguments for a `tracking` config section (the same in this process or the child)."""
    return {"tracking_uri": tracking_cfg.resolved_uri(), "experiment": tracking_cfg.experiment,
            "system_metrics": tracking_cfg.system_metrics,
            "system_metrics_interval_s": tracking_cfg.system_metrics_interval_s,
            "missing_run": tracking_cfg.missing_run}


class TrackingProcess:
    """The child, a thread that sends it requests in order and one that matches its answers to Futures."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        env = dict(os.environ)
        # The child imports this very memfit, wherever it was imported from (a checkout on PYTHONPATH, too).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Its own session: Ctrl-C and a group SIGTERM are this process's to handle within its grace period,
        # which still needs the child to write its last metrics. It ends at its stdin's EOF, which the kernel
        # brings however this process ends (SIGKILL included).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memfit.tracking.child", json.dumps(kwargs)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, bufsize=1, start_new_session=True)
        self._ready: Future[dict[str, Any]] = Future()  # answered once the store is open (request id 0)
        self._futures: dict[int, Future[dict[str, Any]]] = {0: self._ready}
        self._next, self._lock = 1, threading.Lock()
        self._outbox: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.exited: str | None = None
        threading.Thread(target=self._send, name="memfit-tracking-send", daemon=True).start()
        threading.Thread(target=self._receive, name="memfit-tracking-receive", daemon=True).start()
        atexit.register(self.stop)

    def request(self, op: str, *args: Any, reply: bool = True, **kwargs: Any) -> Future[dict[str, Any]] | None:
        fut: Future[dict[str, Any]] | None = None
        with self._lock:
            if self.exited:
                raise TrackingError(f"tracking: {self.exited}")
            rid = None
            if reply:
                rid, self._next = self._next, self._next + 1
                fut = self._futures[rid] = Future()
            # In the lock: the outbox order is the order of the ids.
            self._outbox.put(json.dumps({"id": rid, "op": op, "args": args, "kwargs": kwargs}, default=str))
        return fut

    def ready(self) -> Future[dict[str, Any]]:
        return self._ready

    def _send(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        while (line := self._outbox.get()) is not None:
            try:
                stdin.write(line + "\n")
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                break
        try:
            stdin.close()
        except OSError:
            pass

    def _receive(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # not an answer (the child sends only JSON lines; be safe anyway)
                log.debug("tracking process: %s", line.rstrip())
                continue
            with self._lock:
                fut = self._futures.pop(msg["id"], None)
            if fut is not None:
                fut.set_result(msg)
        code = self.proc.wait()
        with self._lock:
            self.exited = f"the tracking process (pid {self.proc.pid}) exited with code {code}"
            pending, self._futures = list(self._futures.values()), {}
        for fut in pending:
            fut.set_exception(TrackingError(f"tracking: {self.exited}"))

    def stop(self, timeout: float = 15.0) -> None:
        """Let the child write what it buffered and end (bounded: exit must never wait on a dead server)."""
        if self.proc.poll() is None:
            self._outbox.put(json.dumps({"id": None, "op": "exit"}))
            self._outbox.put(None)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _result(msg: dict[str, Any]) -> Any:
    """The answer's value; its log records logged here, in the caller's thread (and so in its Prefect run)."""
    for level, name, text in msg.get("logs", []):
        logging.getLogger(name).log(level, "%s", text)
    if "error" in msg:
        text = msg["error"]
        raise TrackingError(text if text.startswith("tracking") else f"tracking: {text} ({msg.get('type')})")
    return msg.get("ok")


class ProcessTracker:
    """The Tracker Protocol over a TrackingProcess. Metrics are sent without an answer; params, tags, texts,
    tables and datasets without waiting for theirs (phase 3's ≈ 0.4 s of them before the first step would be
    waiting for MLflow's first writes): an error or a warning in one is raised or logged at the next call, in
    the caller's thread, as the child answers in order. What reads from MLflow waits for every call before."""

    def __init__(self, child: TrackingProcess) -> None:
        self.child = child
        self.tracking_uri: str = child.kwargs["tracking_uri"]
        self.experiment: str = child.kwargs["experiment"]
        self.run_id: str | None = None
        self.continued = False
        self.caller_seconds = 0.0  # time log_metrics spent on the caller's (training) thread
        self.step_seconds = 0.0
        self._unsettled: collections.deque[Future[dict[str, Any]]] = collections.deque()
        self._settling = threading.Lock()  # the training thread and the checkpoint writer both call in
        _result(child.ready().result(CALL_TIMEOUT_S))

    def _settle(self) -> None:
        """Log and raise what the answers of earlier unwaited calls carry, as far as they have come."""
        while True:
            with self._settling:
                if not (self._unsettled and self._unsettled[0].done()):
                    return
                answer = self._unsettled.popleft().result()
            _result(answer)

    def _call(self, op: str, *args: Any, settle_first: bool = True, **kwargs: Any) -> Any:
        if settle_first:
            self._settle()
        fut = self.child.request(op, *args, **kwargs)
        assert fut is not None
        out = _result(fut.result(CALL_TIMEOUT_S))
        self._settle()  # answered in order: every earlier call has its answer now
        return out

    def _send(self, op: str, *args: Any, **kwargs: Any) -> None:
        """A call whose answer is settled later (_settle); the same check as MLflowTracker's first."""
        self._settle()
        if self.run_id is None:
            raise TrackingError("tracking: no run started")
        fut = self.child.request(op, *args, **kwargs)
        assert fut is not None
        self._unsettled.append(fut)

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        out = self._call("start_run", run_name, run_id=run_id, tags=tags)
        self.run_id, self.continued = out["run_id"], out["continued"]
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        self._send("log_params", params)  # values the JSON line cannot carry go as str(), as MLflow logs them

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        t0 = time.perf_counter()
        self._settle()
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if "step_time_s" in clean:
            self.step_seconds += clean["step_time_s"]
        self.child.request("log_metrics", clean, int(step), reply=False)
        self.caller_seconds += time.perf_counter() - t0

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("set_tags", tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._send("log_text", text, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifact", str(Path(local_path).absolute()), artifact_path)

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        self._send("log_table", data, artifact_file)

    def log_dataset(self, name: str, digest: str, source: str, context: str,
                    profile: dict[str, Any] | None = None) -> None:
        # A relative source names a file in this process's folder: the child's folder may differ.
        if "://" not in source and Path(source).exists():
            source = str(Path(source).absolute())
        self._send("log_dataset", name, digest, source, context, profile)

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(int(s), float(v)) for s, v in self._call("metric_history", key)]

    def flush(self) -> None:
        self._call("flush")

    def flush_async(self) -> Future[None]:
        """Done once every metric sent before it is written (the child answers in order)."""
        self._settle()
        done: Future[None] = Future()
        fut = self.child.request("flush")
        assert fut is not None

        def settle(f: Future[dict[str, Any]]) -> None:
            try:
                done.set_result(_result(f.result()))
            except Exception as err:  # noqa: BLE001 - the waiter (the checkpoint writer) reports it
                done.set_exception(err)

        fut.add_done_callback(settle)
        return done

    def overhead(self) -> dict[str, float] | None:
        """As MLflowTracker's: the training thread's share here, the writer's share measured in the child."""
        if self.step_seconds <= 0:
            return None
        theirs = self._call("overhead") or {}
        return {"tracking_overhead_fraction": self.caller_seconds / self.step_seconds,
                "tracking_writer_fraction": theirs.get("tracking_writer_fraction", 0.0)}

    def call_records(self, op: str, *args: Any) -> Any:
        """child.RECORDS[op](tracker, *args), run in the tracking process (records.on_tracker calls it)."""
        return self._call("records", op, *args)

    # Both do their work before an earlier call's error is raised, as MLflowTracker ends a run whose flush failed.
    def close(self) -> None:
        """Write what is buffered; the run stays open and the process goes back to be taken by the next phase
        (phase 5 continues the same run in it, with MLflow already imported and the store open)."""
        try:
            self._call("close", settle_first=False)
        finally:
            if not self.child.exited:
                _prestarted.setdefault(_pool_key(self.child.kwargs), self.child)

    def end_run(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self._call("end_run", status, settle_first=False)

    def describe(self) -> str:
        return f"MLflow at {scrub(self.tracking_uri)}, experiment {self.experiment!r} (tracking process)"


def _pool_key(kwargs: dict[str, Any]) -> str:
    return json.dumps(kwargs, sort_keys=True)


def _key(tracking_cfg: Any) -> str | None:
    """Which prestarted process serves this config; None where tracking has no MLflow."""
    return _pool_key(tracker_kwargs(tracking_cfg)) if tracking_cfg.backend == "mlflow" else None


def prestart(tracking_cfg: Any) -> None:
    """Start the tracking process for this config now (a no-op without MLflow or when already started)."""
    key = _key(tracking_cfg)
    if key is not None and key not in _prestarted:
        _prestarted[key] = TrackingProcess(tracker_kwargs(tracking_cfg))


def prestarted(tracking_cfg: Any) -> bool:
    """Whether a tracking process for this config waits to be taken."""
    return _key(tracking_cfg) in _prestarted


def take(tracking_cfg: Any) -> ProcessTracker | None:
    """The prestarted tracker for this config, once (TrackingError if it could not open the store); else None."""
    child = _prestarted.pop(_key(tracking_cfg), None)
    return ProcessTracker(child) if child is not None else None
