"""Experiment tracking backends behind one Protocol; MLflow is imported only when chosen."""

from __future__ import annotations

from memfit.tracking.base import Tracker, redact
from memfit.tracking.null import NullTracker


def make_tracker(tracking_cfg) -> Tracker:
    if tracking_cfg.backend == "null":
        return NullTracker()
    from memfit.tracking.mlflow_tracker import MLflowTracker

    return MLflowTracker(tracking_cfg.resolved_uri(), tracking_cfg.experiment)


__all__ = ["NullTracker", "Tracker", "make_tracker", "redact"]
