"""A tracker that records nothing (tracking.backend=null), for runs that must not touch a server."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any


class NullTracker:
    def __init__(self) -> None:
        self.run_id: str | None = None

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        self.run_id = run_id or f"null-{uuid.uuid4().hex[:12]}"
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

    def flush(self) -> None:
        pass

    def end_run(self, status: str = "FINISHED") -> None:
        pass

    def describe(self) -> str:
        return "null tracker"
