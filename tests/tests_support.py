"""Helpers tests import directly (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path


def tiny_overrides(root: Path, mlflow_uri: str | None = None, **extra: object) -> list[str]:
    """--set overrides that keep a run's files under `root` and its size tiny."""
    items = {
        "run.work_dir": str(root / "work"),
        "checkpoint.uri": str(root / "checkpoints"),
        "export.dir": str(root / "export"),
        "tracking.uri": mlflow_uri or f"sqlite:///{root / 'mlflow.db'}",
        "tracking.experiment": "tests",
    }
    items.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]
