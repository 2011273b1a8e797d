"""Experiment tracking backends behind one Protocol; MLflow is imported only when chosen."""

from __future__ import annotations

import logging

from memfit.errors import TrackingError
from memfit.tracking.base import Tracker, redact, scrub
from memfit.tracking.null import NullTracker

log = logging.getLogger("memfit.tracking")


def make_tracker(tracking_cfg, prestarted: bool = False) -> Tracker:
    """The configured tracker; an unreachable store fails (tracking.fail_if_unreachable) or warns and goes null.

    `prestarted`: use the tracking process `memfit run` started for this config, if there is one
    (tracking/process.py); phases 3 and 5 do, so that MLflow never loads into the training process.
    """
    if tracking_cfg.backend == "null":
        return NullTracker()
    from memfit.tracking.process import take, tracker_kwargs

    try:
        tracker = take(tracking_cfg) if prestarted else None
        if tracker is not None:
            return tracker
        from memfit.tracking.mlflow_tracker import MLflowTracker

        return MLflowTracker(**tracker_kwargs(tracking_cfg))
    except TrackingError as err:
        if tracking_cfg.fail_if_unreachable:
            raise
        log.warning("%s; continuing WITHOUT tracking (tracking.fail_if_unreachable=false)", err)
        return NullTracker()


def check_tracking(tracking_cfg) -> None:
    """Preflight: the tracking store answers (or, when optional, a warning that it does not)."""
    if tracking_cfg.backend == "null":
        return
    from memfit.tracking.mlflow_tracker import check_reachable

    try:
        check_reachable(tracking_cfg.resolved_uri())
    except TrackingError as err:
        if tracking_cfg.fail_if_unreachable:
            raise
        log.warning("%s; the run goes on WITHOUT tracking (tracking.fail_if_unreachable=false)", err)


__all__ = ["NullTracker", "Tracker", "check_tracking", "make_tracker", "redact", "scrub"]
