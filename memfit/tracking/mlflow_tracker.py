"""MLflow tracker: one MlflowClient bound to an explicit URI, metrics batched off the training step."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from memfit.errors import TrackingError
from memfit.tracking.base import redact

log = logging.getLogger("memfit.tracking")

_MAX_PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
_MAX_PARAM_LEN = 6000


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail early, naming the URI, when an HTTP tracking server does not answer (MLflow would retry for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the user's own server
            if resp.status >= 500:
                raise TrackingError(f"tracking.uri {uri}: server answered {resp.status} on /health")
    except urllib.error.HTTPError as err:
        if err.code >= 500:
            raise TrackingError(f"tracking.uri {uri}: server answered {err.code} on /health") from None
    except (urllib.error.URLError, OSError) as err:
        raise TrackingError(f"tracking.uri {uri}: MLflow server unreachable ({getattr(err, 'reason', err)}); "
                            "start it or fix tracking.uri / MLFLOW_TRACKING_URI") from None


class MLflowTracker:
    def __init__(self, tracking_uri: str, experiment: str, flush_every: int = 20) -> None:
        from mlflow import MlflowClient

        check_reachable(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id: str | None = None
        self._pending: list[Any] = []
        self._flush_every = flush_every

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment)
        except Exception:  # noqa: BLE001 - another process created it in between
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        """A new run, or the run `run_id` continued (after a preemption), reopened as RUNNING."""
        if run_id:
            try:
                run = self.client.get_run(run_id)
            except Exception as err:  # noqa: BLE001 - mlflow raises MlflowException subclasses
                raise TrackingError(f"tracking: run {run_id} from the training checkpoint is not in "
                                    f"{self.tracking_uri} ({err}); point tracking.uri at the store it was logged "
                                    "to, or start over with an empty checkpoint.uri") from None
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self._experiment_id(), run_name=run_name, tags=dict(tags or {}))
            self.run_id = run.info.run_id
        if tags and run_id:
            self.set_tags(tags)
        return self.run_id

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

        ts = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None)
        if len(self._pending) >= self._flush_every * max(1, len(metrics)):
            self.flush()

    def flush(self) -> None:
        if not self._pending or self.run_id is None:
            return
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), 1000):  # MLflow accepts at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=pending[i:i + 1000])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        run_id = self._require_run()
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in redact(tags).items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self._require_run(), text, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(local_path)
        if p.is_dir():
            self.client.log_artifacts(self._require_run(), str(p), artifact_path)
        else:
            self.client.log_artifact(self._require_run(), str(p), artifact_path)

    def end_run(self, status: str = "FINISHED") -> None:
        if self.run_id is None:
            return
        self.flush()
        self.client.set_terminated(self.run_id, status=status)

    def describe(self) -> str:
        return f"MLflow at {self.tracking_uri}, experiment {self.experiment!r}"


def run_url(tracking_uri: str, run_id: str) -> str | None:
    """The MLflow UI page of a run when the tracking URI is a server; None for local stores."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    exp_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    return f"{tracking_uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
