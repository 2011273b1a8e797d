"""The tracker Protocol (MLflow, null) and the redaction every backend applies before logging."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

# Keys that look like credentials never reach a tracker, whatever the backend.
_SECRET_KEY = re.compile(r"(secret|password|passwd|token|api[_-]?key|access[_-]?key|credential|private)", re.I)
REDACTED = "***"


def redact(params: dict[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if _SECRET_KEY.search(k) and v not in (None, "") else v) for k, v in params.items()}


class Tracker(Protocol):
    """Experiment tracking for one run at a time; metrics may be buffered until `flush`."""

    run_id: str | None

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def end_run(self, status: str = "FINISHED") -> None: ...

    def describe(self) -> str: ...
