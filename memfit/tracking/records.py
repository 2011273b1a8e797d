"""What is made from a run's own MLflow records (plots, the registry step), done in the process holding the store.

In `memfit run` that is the tracking process (child.py), which has MLflow imported and the store open since
start-up: phases 3 and 5 ask it by name (`on_tracker`), so the training process never imports MLflow or
matplotlib (≈ 12 s less CPU in memfit's process per tiny run, docs/mlflow.md). Everywhere else
(tests calling the phases, `memfit export`, retraining flows) the same functions run here, on the in-process
tracker. Arguments and results are plain JSON: the pipe carries data, never code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def log_loss_curve(tracker: Any, run_name: str) -> None:
    """plots/loss_curve.png from the run's own metric history (so it spans every resumed segment)."""
    from memfit.plots import loss_curve

    train, val = tracker.metric_history("loss"), tracker.metric_history("val_loss")
    if not train and not val:
        return
    with tempfile.TemporaryDirectory(prefix="memfit-plots-") as tmp:
        tracker.log_artifact(loss_curve(train, val, Path(tmp) / "loss_curve.png", title=f"{run_name}: loss"),
                             "plots")


def log_memory_figure(tracker: Any, baseline: dict[str, Any] | None, plan: dict[str, Any] | None) -> None:
    """plots/memory_breakdown.png: the baseline probe by kind, and the peak per step of the run so far."""
    from memfit.plots import memory_breakdown

    with tempfile.TemporaryDirectory(prefix="memfit-plots-") as tmp:
        png = memory_breakdown(baseline, tracker.metric_history("memory_peak_bytes"),
                               Path(tmp) / "memory_breakdown.png", plan=plan)
        tracker.log_artifact(png, "plots")


def publish(tracker: Any, export_dir: str, metrics: dict[str, float], model_name: str, gate: dict[str, Any],
            alias: str, version_tags: dict[str, str]) -> dict[str, Any]:
    """The export logged as a model in the tracker's run, gated, registered and promoted (registry.publish);
    `gate` is the eval.gate section as a dict. Returns the RegistryOutcome as a dict."""
    from memfit.release.registry import publish as publish_model

    tracker.flush()
    outcome = publish_model(tracker.client, tracker.tracking_uri, tracker.run_id, export_dir, metrics, model_name,
                            SimpleNamespace(**gate), alias, version_tags)
    return outcome.to_dict()


# The only calls a parent may make of the tracking process beyond the Tracker Protocol.
OPS = {"log_loss_curve": log_loss_curve, "log_memory_figure": log_memory_figure, "publish": publish}


def on_tracker(tracker: Any, op: str, *args: Any) -> Any:
    """Run `op` where `tracker` keeps its store: in the tracking process for its proxy, else here."""
    remote = getattr(tracker, "call_records", None)
    if remote is not None:
        return remote(op, *args)
    return OPS[op](tracker, *args)
