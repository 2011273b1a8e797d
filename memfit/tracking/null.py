"""A tracker that records nothing (tracking.backend=null, or an unreachable optional server)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any


class NullTracker:
    def __init__(self) -> None:
        self.run_id: str | None = None
        self.continued = False

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        self.run_id = run_id or f"null-{uuid.uuid4().hex[:12]}"
        self.continued = run_id is not None
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        pass

    def log_dataset(self, name: str, digest: str, source: str, context: str,
                    profile: dict[str, Any] | None = None) -> None:
        pass

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return []

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def end_run(self, status: str = "FINISHED") -> None:
        pass

    def describe(self) -> str:
        return "null tracker"
