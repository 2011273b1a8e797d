"""What is made from a run's own MLflow records (plots, the registry step), done in the process holding the store."""

# In `memfit run` that is the tracking process (child.py), which has MLflow imported and the store open since start-
# up: phases 3 and 5 ask it by name (`on_tracker`), so the training process never imports MLflow or matplotlib (≈ 12 s
# less CPU in memfit's process per tiny run, docs/mlflow.md). Everywhere else (tests calling the phases, `memfit
# export`, retraining flows) the same functions run here, on the in-process tracker. Arguments and results are plain
# JSON: the pipe carries data, never code.

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def log_loss_curve(tracker: Any, run_name: str) -> None:
    """plots/loss_curve.png from the run's own metric history (so it spans every resumed segment)."""
    from memfit.tracking.plots import loss_curve

    train, val = tracker.metric_history("loss"), tracker.metric_history("val_loss")
    if not train and not val:
        return
    with tempfile.TemporaryDirectory(prefix="memfit-plots-") as tmp:
        tracker.log_artifact(loss_curve(train, val, Path(tmp) / "loss_curve.png", title=f"{run_name}: loss"),
                             "plots")


def log_memory_figure(tracker: Any, baseline: dict[str, Any] | None, plan: dict[str, Any] | None) -> None:
    """plots/memory_breakdown.png: the baseline probe by kind, and the peak per step of the run so far."""
    from memfit.tracking.plots import memory_breakdown

    with tempfile.TemporaryDirectory(prefix="memfit-plots-") as tmp:
        png = memory_breakdown(baseline, tracker.metric_history("memory_peak_bytes"),
                               Path(tmp) / "memory_breakdown.png", plan=plan)
        tracker.log_artifact(png, "plots")


def on_tracker(tracker: Any, op: Callable[..., Any], *args: Any) -> Any:
    """`op(tracker, *args)` where `tracker` keeps its store: in the tracking process for its proxy (by name, from
    the calls that process allows: child.py's RECORDS), else here."""
    remote = getattr(tracker, "call_records", None)
    if remote is not None:
        return remote(op.__name__, *args)
    return op(tracker, *args)
