"""Phase 3's tracker in a process of its own: what it logs lands in MLflow as the in-process tracker's does,
its errors and warnings reach the caller, and it never outlives memfit (nor loses metrics when memfit is
SIGKILLed)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from memfit.config import TrackingConfig
from memfit.errors import TrackingError
from memfit.tracking import make_tracker
from memfit.tracking.process import ProcessTracker, prestart, prestarted

pytestmark = pytest.mark.integration
# A module-level import of a missing package stops `pytest -m gpu` at collection (the GPU image has no mlflow).
MlflowClient = pytest.importorskip("mlflow").MlflowClient
REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, **kw) -> TrackingConfig:
    return TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="proc", system_metrics=False, **kw)


def test_metrics_params_tags_and_datasets_land_in_mlflow_and_errors_reach_the_caller(tmp_path, monkeypatch,
                                                                                      caplog):
    cfg = _cfg(tmp_path)
    prestart(cfg)
    assert prestarted(cfg)
    tracker = make_tracker(cfg, prestarted=True)
    assert isinstance(tracker, ProcessTracker) and not prestarted(cfg)  # taken once: phase 5 opens its own
    with pytest.raises(TrackingError, match="no run started"):
        tracker.log_params({"lr": 1e-3})
    run_id = tracker.start_run("proc-run", tags={"memfit.device": "cpu"})
    tracker.log_params({"lr": 1e-3, "api_token": "hf_" + "x" * 34})  # a secret key: masked in the child
    losses = [5.0 - 0.25 * i for i in range(30)]
    for step, loss in enumerate(losses, 1):
        tracker.log_metrics({"loss": loss, "step_time_s": 0.01}, step=step)
    tracker.flush_async().result(60)  # every metric sent before it is written once it is done
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.txt").write_text("hello\n")
    tracker.log_dataset("train", "a" * 64, "data.txt", "training")  # a relative path: this process's folder
    tracker.set_tags({"memfit.status": "completed"})
    assert tracker.metric_history("loss") == list(enumerate(losses, 1))
    overhead = tracker.overhead()
    assert overhead is not None and 0 <= overhead["tracking_overhead_fraction"] < 1

    client = MlflowClient(tracking_uri=cfg.resolved_uri())
    run = client.get_run(run_id)
    assert run.data.params["lr"] == "0.001" and run.data.params["api_token"] == "***"
    assert run.data.tags["memfit.status"] == "completed" and run.data.tags["memfit.device"] == "cpu"
    assert str(tmp_path / "data.txt") in run.inputs.dataset_inputs[0].dataset.source
    tracker.end_run("FINISHED")
    assert client.get_run(run_id).info.status == "FINISHED"

    # A warning logged in the child is logged here, by the caller, under its own logger name.
    tracker2_cfg = _cfg(tmp_path, missing_run="new_run")
    prestart(tracker2_cfg)
    with caplog.at_level(logging.WARNING, logger="memfit.tracking"):
        other = make_tracker(tracker2_cfg, prestarted=True)
        new_id = other.start_run("proc-run", run_id="0" * 32)
    assert new_id != "0" * 32 and not other.continued
    assert any("named by the training checkpoint is not in" in r.getMessage() and r.name == "memfit.tracking"
               for r in caplog.records), caplog.text


def test_an_unusable_store_is_one_tracking_error_naming_it(tmp_path):
    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}", fail_if_unreachable=True)
    prestart(cfg)
    with pytest.raises(TrackingError, match=r"tracking.uri sqlite:///.*missing.*does not exist"):
        make_tracker(cfg, prestarted=True)


PARENT = textwrap.dedent("""
    import sys, time
    from memfit.config import TrackingConfig
    from memfit.tracking import make_tracker
    from memfit.tracking.process import prestart
    cfg = TrackingConfig(uri=sys.argv[1], experiment="kill", system_metrics=False)
    prestart(cfg)
    tracker = make_tracker(cfg, prestarted=True)
    run_id = tracker.start_run("killed")
    for step in range(1, 11):
        tracker.log_metrics({"loss": float(step)}, step=step)
    time.sleep(0.5)  # the metrics are in the pipe (the sender thread wrote them), not yet flushed
    print(run_id, tracker.child.proc.pid, flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_parent_leaves_no_tracking_process_and_its_sent_metrics_are_written(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, uri], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2, f"the parent printed {line!r} (exit {parent.poll()})"
        run_id, child_pid = line[0], int(line[1])
        child = psutil.Process(child_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        child.wait(30)  # psutil.TimeoutExpired if it outlived memfit
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 10
    history: list = []
    while time.monotonic() < deadline and len(history) < 10:
        history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss")
        time.sleep(0.2)
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 11)]


def test_an_error_in_a_call_not_waited_for_is_raised_at_the_next_call(tmp_path):
    cfg = _cfg(tmp_path)
    prestart(cfg)
    tracker = make_tracker(cfg, prestarted=True)
    run_id = tracker.start_run("unwaited")
    tracker.log_params({"bad\x00name": 1})  # returns at once: phase 3 does not wait for MLflow's writes
    with pytest.raises(TrackingError, match="Names may only contain"):
        tracker.flush()
    tracker.log_params({"lr": 0.5})
    tracker.end_run("FINISHED")  # waits for every call before it, as any call that answers does
    run = MlflowClient(tracking_uri=cfg.resolved_uri()).get_run(run_id)
    assert run.data.params == {"lr": "0.5"} and run.info.status == "FINISHED"
