"""MLflow tracker: one MlflowClient bound to an explicit URI, metrics batched and written off the training step."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from memfit.errors import TrackingError
from memfit.runtime.procs import lower_thread_priority
from memfit.tracking.base import redact, scrub, scrub_obj
from memfit.tracking.sqlite_seed import open_client, sqlite_path

log = logging.getLogger("memfit.tracking")

_MAX_PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
_MAX_PARAM_LEN = 6000
_MAX_DIGEST_LEN = 32  # MLflow stores dataset digests in a 36-character column
NULL_RUN_PREFIX = "null-"  # run ids of the null tracker (a run that started without a server)


def display_uri(uri: str) -> str:
    """The URI as it may be shown or logged: any password inside it masked."""
    return scrub(uri)


def _check_sqlite(uri: str) -> None:
    db = sqlite_path(uri)
    if db is None:
        return
    folder = db.parent
    if not folder.is_dir():
        raise TrackingError(f"tracking.uri {uri}: folder {folder} does not exist; create it or point "
                            "tracking.uri / MLFLOW_TRACKING_URI elsewhere")
    if not (db.exists() and db.stat().st_size) and not _writable(folder):
        raise TrackingError(f"tracking.uri {uri}: cannot create the SQLite store in {folder} (not writable)")


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK)


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail early, naming the URI, when the tracking store cannot work (MLflow would retry for minutes)."""
    if uri.startswith("sqlite:"):
        _check_sqlite(uri)
        return
    if not uri.startswith(("http://", "https://")):
        return
    shown = display_uri(uri)
    parts = urllib.parse.urlsplit(uri)
    # urllib does not turn user:password@ into a header: strip it from the URL and send it as basic auth.
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    req = urllib.request.Request(url)
    if parts.username is not None:
        cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        req.add_header("Authorization", "Basic " + base64.b64encode(cred.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the user's own server
            if resp.status >= 500:
                raise TrackingError(f"tracking.uri {shown}: server answered {resp.status} on /health")
    except urllib.error.HTTPError as err:
        if err.code >= 500:
            raise TrackingError(f"tracking.uri {shown}: server answered {err.code} on /health") from None
    except (urllib.error.URLError, OSError) as err:
        raise TrackingError(f"tracking.uri {shown}: MLflow server unreachable ({getattr(err, 'reason', err)}); "
                            "start it or fix tracking.uri / MLFLOW_TRACKING_URI, or set "
                            "tracking.fail_if_unreachable=false to run without tracking") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class MLflowTracker:
    def __init__(self, tracking_uri: str, experiment: str, flush_every: int = 20, system_metrics: bool = False,
                 system_metrics_interval_s: float = 10.0, missing_run: str = "new_run") -> None:
        check_reachable(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.client = open_client(tracking_uri)
        self.run_id: str | None = None
        self.missing_run = missing_run
        self.continued = False  # start_run reopened the run it was given (False: a new run)
        self._pending: list[Any] = []
        self._flush_every = flush_every
        self._system_metrics = system_metrics
        self._interval = system_metrics_interval_s
        self._monitor: Any = None
        # One writer thread keeps batches in order and the training thread free of store latency; nicer than
        # the training threads, so its SQLite/HTTP work takes no core from the step.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-mlflow",
                                          initializer=lower_thread_priority)
        self._inflight: list[Future[None]] = []
        self._lock = threading.Lock()
        self.caller_seconds = 0.0  # time log_metrics spent on the caller's (training) thread
        self.step_seconds = 0.0  # sum of the step_time_s values it was given, to relate the two
        self.writer_seconds = 0.0  # time the writer thread spent in log_batch (off the training thread)

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment, artifact_location=self._artifact_location())
        except Exception:  # noqa: BLE001 - another process created it in between
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _artifact_location(self) -> str | None:
        """SQLite stores keep artifacts beside the database (MLflow's default is ./mlruns of whatever cwd)."""
        db = sqlite_path(self.tracking_uri)
        if db is None:
            return None  # a server decides (--artifacts-destination); other stores keep their defaults
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.experiment)[:60]
        digest = hashlib.sha256(self.experiment.encode()).hexdigest()[:8]
        return (db.parent / "mlruns" / f"{slug}-{digest}").as_uri()

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        """A new run, or the run `run_id` continued (after a preemption), reopened as RUNNING."""
        if run_id and run_id.startswith(NULL_RUN_PREFIX):
            log.warning("the training checkpoint was written without tracking (run %s); starting a new MLflow "
                        "run", run_id)
            run_id = None
        run = self._find_run(run_id) if run_id else None
        if run is not None:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.continued = True
            if tags:
                self.set_tags(tags)
        else:
            extra = {"memfit.resumed_from_run_id": run_id} if run_id else {}
            run = self.client.create_run(self._experiment_id(), run_name=run_name,
                                         tags=redact({**(tags or {}), **extra}))
            self.run_id = run.info.run_id
            self.continued = False
        self._start_system_metrics()
        return self.run_id

    def _find_run(self, run_id: str) -> Any:
        """The run to continue, or None (with a warning) when this store does not hold it and policy allows."""
        try:
            return self.client.get_run(run_id)
        except Exception as err:  # noqa: BLE001 - mlflow raises MlflowException subclasses
            where = display_uri(self.tracking_uri)
            if self.missing_run == "error":
                raise TrackingError(f"tracking: run {run_id} from the training checkpoint is not in {where} "
                                    f"({_first_line(err)}); point tracking.uri at the store it was logged to, or set "
                                    "tracking.missing_run=new_run to train on in a new run") from None
        log.warning("MLflow run %s named by the training checkpoint is not in %s (a new machine with its own store?): "
                    "training goes on in a new run, tagged memfit.resumed_from_run_id=%s. To keep one run across "
                    "machines, use a shared tracking server (tracking.uri=http://...); tracking.missing_run=error "
                    "makes this an error", run_id, where, run_id)
        return None

    def _start_system_metrics(self) -> None:
        if not self._system_metrics or self._monitor is not None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: a continued run (resume, then export) goes on from the last system step.
            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self._interval,
                                                 resume_logging=True, tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception as err:  # noqa: BLE001 - system metrics are an extra, never a reason to fail
            log.warning("system metrics off: %s", err)
            self._monitor = None

    def _stop_system_metrics(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.finish()

    def _require_run(self) -> str:
        if self.run_id is None:
            raise TrackingError("tracking: no run started")
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._require_run()
        items = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in redact(params).items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i:i + _MAX_PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        t0 = time.perf_counter()
        ts = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None)
        if "step_time_s" in metrics:
            self.step_seconds += float(metrics["step_time_s"])
        if len(self._pending) >= self._flush_every * max(1, len(metrics)):
            self._submit()
        self.caller_seconds += time.perf_counter() - t0

    def _submit(self) -> None:
        if not self._pending or self.run_id is None:
            return
        pending, self._pending = self._pending, []
        with self._lock:
            self._inflight = [f for f in self._inflight if not f.done() or f.exception() is not None]
            self._inflight.append(self._writer.submit(self._write, self.run_id, pending))

    def _write(self, run_id: str, metrics: list[Any]) -> None:
        t0 = time.perf_counter()
        try:
            for i in range(0, len(metrics), 1000):  # MLflow accepts at most 1000 metrics per batch
                self.client.log_batch(run_id, metrics=metrics[i:i + 1000])
        finally:
            self.writer_seconds += time.perf_counter() - t0

    def flush_async(self) -> Future[None] | None:
        """Hand everything buffered to the writer thread without waiting; the returned Future is done once it,
        and every batch before it (one thread, in order), is written. Failures surface at the next `flush`."""
        self._submit()
        with self._lock:
            return self._inflight[-1] if self._inflight else None

    def flush(self) -> None:
        """Write everything buffered and wait for it; TrackingError if a batch could not be written."""
        self._submit()
        with self._lock:
            inflight, self._inflight = self._inflight, []
        errors = []
        for fut in inflight:
            try:
                fut.result()
            except Exception as err:  # noqa: BLE001
                errors.append(err)
        if errors:
            raise TrackingError(f"tracking: {len(errors)} metric batch(es) could not be written to "
                                f"{display_uri(self.tracking_uri)}: {errors[0]}")

    def overhead(self) -> dict[str, float] | None:
        """Metric logging time as fractions of the step time logged: on the training thread, and in the writer."""
        if self.step_seconds <= 0:
            return None
        return {"tracking_overhead_fraction": self.caller_seconds / self.step_seconds,
                "tracking_writer_fraction": self.writer_seconds / self.step_seconds}

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        run_id = self._require_run()
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in redact(tags).items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self._require_run(), scrub(text), artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(local_path)
        if p.is_dir():
            self.client.log_artifacts(self._require_run(), str(p), artifact_path)
        else:
            self.client.log_artifact(self._require_run(), str(p), artifact_path)

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        self.client.log_table(self._require_run(), data=scrub_obj(data), artifact_file=artifact_file)

    def log_dataset(self, name: str, digest: str, source: str, context: str,
                    profile: dict[str, Any] | None = None) -> None:
        """The data as an MLflow dataset input (name, digest, where it came from) with its context tag."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import Dataset, DatasetInput, InputTag

        path = Path(source)
        if "://" not in source and path.exists():
            from mlflow.data.dataset_source_registry import resolve_dataset_source

            ds_source = resolve_dataset_source(str(path.absolute()))
        else:
            ds_source = CodeDatasetSource(tags={"memfit.data.source": scrub(source)})
        meta = MetaDataset(ds_source, name=name, digest=digest[:_MAX_DIGEST_LEN]).to_dict()
        entity = Dataset(name=meta["name"], digest=meta["digest"], source_type=meta["source_type"],
                         source=meta["source"], schema=meta.get("schema"),
                         profile=json.dumps(scrub_obj({"sha256": digest, **(profile or {})})))
        self.client.log_inputs(self._require_run(), datasets=[
            DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)])])

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        hist = self.client.get_metric_history(self._require_run(), key)
        return sorted((int(m.step), float(m.value)) for m in hist)

    def close(self) -> None:
        """Stop system metrics and write buffered metrics, leaving the run open for the next phase."""
        self._stop_system_metrics()
        self.flush()

    def end_run(self, status: str = "FINISHED") -> None:
        if self.run_id is None:
            return
        self._stop_system_metrics()
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status=status)

    def describe(self) -> str:
        return f"MLflow at {display_uri(self.tracking_uri)}, experiment {self.experiment!r}"


def run_url(tracking_uri: str, run_id: str) -> str | None:
    """The MLflow UI page of a run when the tracking URI is a server; None for local stores."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    exp_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    return f"{tracking_uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
