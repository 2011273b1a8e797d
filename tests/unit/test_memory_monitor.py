"""The training memory monitor on a small model: readings every N steps, one warning, a stop request."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch
from torch import nn

from memfit.config import MonitorConfig
from memfit.memory.planner.monitor import (
    LIMIT_EVENT,
    WARNING_EVENT,
    Budget,
    MemoryMonitor,
    event_sink,
    resolve_budget,
)

pytestmark = pytest.mark.unit


class Recorder:
    """A tracker that keeps what it is given (the Tracker protocol's calls the monitor makes)."""

    run_id = "run-1"

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict]] = []
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.append((step, metrics))

    def set_tags(self, tags: dict) -> None:
        self.tags.update(tags)


def _run(budget_bytes: int | None, steps: int = 9, **monitor: object) -> tuple[MemoryMonitor, Recorder, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    rec = Recorder()
    cfg = MonitorConfig(**{"every_steps": 3, **monitor})
    mon = MemoryMonitor(cfg, Budget(budget_bytes, "memory.budget_gb", "tensor_peak"), torch.device("cpu"), rec,
                        model, opt, "unit")
    x = torch.randn(128, 64)
    for step in range(1, steps + 1):
        with mon.watch(step):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if mon.stop_requested:
            return mon, rec, step
    return mon, rec, steps


def test_readings_every_n_steps_without_warning_when_the_budget_has_room(caplog):
    events = []
    with caplog.at_level(logging.INFO, logger="memfit.memory"), event_sink(events.append):
        mon, rec, _ = _run(budget_bytes=None)
        peak = max(r.peak_bytes for r in mon.readings)
        mon2, rec2, _ = _run(budget_bytes=int(peak / 0.9 * 1.02))
    assert [s for s, _ in rec.metrics] == [1, 3, 6, 9]
    m = rec2.metrics[-1][1]
    assert m["memory/peak_bytes"] == peak and 0 < m["memory/allocated_bytes"] < peak
    assert m["memory/reserved_bytes"] == m["memory/rss_bytes"] > peak  # RSS: the whole Python process
    assert 0.85 < m["memory/budget_fraction"] < 0.9
    assert not mon2.warned and "memfit.memory.warning" not in rec2.tags and events == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("memory at step 9" in r.getMessage() for r in caplog.records)


def test_a_budget_below_the_peak_warns_once_with_the_figures(caplog):
    _, probe_rec, _ = _run(budget_bytes=None, steps=3)
    peak = probe_rec.metrics[-1][1]["memory/peak_bytes"]
    events = []
    with caplog.at_level(logging.WARNING, logger="memfit.memory"), event_sink(events.append):
        mon, rec, steps = _run(budget_bytes=int(peak * 0.95))
    assert steps == 9 and not mon.stop_requested  # warning only: training goes on
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "above monitor.warn_fraction=0.9" in warnings[0].getMessage()
    assert len(events) == 1 and events[0]["event"] == WARNING_EVENT
    assert events[0]["peak_bytes"] == peak and events[0]["budget_bytes"] == int(peak * 0.95)
    assert events[0]["mlflow_run_id"] == "run-1" and events[0]["fraction"] > 1.0
    assert rec.tags["memfit.memory.warning_step"] in ("1", "3")


def test_stop_at_fraction_requests_a_stop_and_emits_a_limit_event():
    _, probe_rec, _ = _run(budget_bytes=None, steps=3)
    peak = probe_rec.metrics[-1][1]["memory/peak_bytes"]
    events = []
    with event_sink(events.append):
        mon, rec, stopped_at = _run(budget_bytes=int(peak * 0.9), stop_at_fraction=1.0)
    assert mon.stop_requested and stopped_at in (1, 3)
    assert [e["event"] for e in events] == [WARNING_EVENT, LIMIT_EVENT]
    assert "monitor.stop_at_fraction=1.0" in mon.stop_message and rec.tags["memfit.status"] == "memory_limit"


def test_a_failing_event_sink_does_not_stop_training(caplog):
    def broken(event: dict) -> None:
        raise RuntimeError("no server")

    with event_sink(broken):
        mon, _, steps = _run(budget_bytes=1)
    assert mon.warned and steps == 9
    assert any("event sink" in r.getMessage() for r in caplog.records)


def test_budget_resolution_says_what_it_limits():
    cpu = torch.device("cpu")
    assert resolve_budget(0.5, cpu) == Budget(500_000_000, "memory.budget_gb", "tensor_peak")
    assert resolve_budget(0.5, cpu, track_tensors=False).measure == "rss_delta"
    host = resolve_budget(None, cpu)
    assert host.measure == "rss" and 0 < host.bytes <= psutil.virtual_memory().total


def test_a_container_memory_limit_is_found(tmp_path):
    from memfit.memory.planner.monitor import _cgroup_limit

    assert _cgroup_limit(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_limit(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("2147483648\n")
    assert _cgroup_limit(str(tmp_path)) == 2 * 1024**3


def test_monitor_config_limits():
    from memfit.config import ConfigError, load

    with pytest.raises(ConfigError, match="monitor.warn_fraction"):
        load(None, ["monitor.warn_fraction=1.5"])
    with pytest.raises(ConfigError, match="monitor.every_steps"):
        load(None, ["monitor.every_steps=0"])


def test_a_run_planned_for_another_device_is_watched_against_that_device():
    from memfit.config import load
    from memfit.memory.planner.search import target_profile

    cfg = load(None, ["memory.device=t4"])
    model = nn.Linear(4, 4)
    mon = MemoryMonitor.for_run(cfg, torch.device("cpu"), Recorder(), model, torch.optim.AdamW(model.parameters()))
    assert mon.budget.bytes == target_profile(cfg.memory).usable_bytes and "t4" in mon.budget.source.lower()
    assert mon.budget.measure == "tensor_peak"


def test_a_resumed_run_counts_its_own_first_steps_and_stops_on_them():
    """A restart resumes at a later step and may run another stack: its first two steps are counted (the
    steady peak), not only the global steps 1 and 2 it never runs, so a stack over the limit stops again."""
    _, probe_rec, _ = _run(budget_bytes=None, steps=3)
    peak = probe_rec.metrics[-1][1]["memory/peak_bytes"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    rec = Recorder()
    mon = MemoryMonitor(MonitorConfig(every_steps=10, stop_at_fraction=1.0),
                        Budget(int(peak * 0.9), "memory.budget_gb", "tensor_peak"), torch.device("cpu"), rec,
                        model, opt, "unit")
    x = torch.randn(128, 64)
    model(x).square().mean().backward()  # the optimizer state a resume restores
    opt.step()
    opt.zero_grad(set_to_none=True)
    for step in (11, 12):  # resumed after the training checkpoint of step 10
        with mon.watch(step):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert mon.counted(11) and mon.counted(12) and not mon.counted(13)
    assert [s for s, _ in rec.metrics] == [11]  # the first step of this process is read
    assert mon.stop_requested and mon.stop_reading is not None and mon.stop_reading.step == 11
    assert mon.stop_reading.peak_bytes > mon.budget.bytes


class EngineOptimizer:
    """An engine's optimizer as DeepSpeed's ZeRO one is: it wraps a torch optimizer and keeps buffers of its own
    (a flat fp32 partition, reduce buckets) in attributes, written in the backward or the step, not in `state`."""

    def __init__(self, inner: torch.optim.Optimizer, held: int) -> None:
        self.optimizer, self.param_groups = inner, inner.param_groups
        self.fp32_partition = torch.zeros(held // 4)
        self.buckets = [torch.zeros(16), torch.zeros(16)]

    @property
    def state(self):
        return self.optimizer.state

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def test_an_engines_own_buffers_count_from_the_steps_start_not_from_their_first_write():
    def peak(wrap: bool) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        inner = torch.optim.AdamW(model.parameters())
        opt = EngineOptimizer(inner, 400_000) if wrap else inner
        mon = MemoryMonitor(MonitorConfig(every_steps=1), Budget(None, "memory.budget_gb", "tensor_peak"),
                            torch.device("cpu"), Recorder(), model, opt, "unit")
        x = torch.randn(128, 64)
        for step in (1, 2):
            with mon.watch(step):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return mon.readings[-1].peak_bytes

    # Neither buffer is written during the step: a count that adopted only parameters, gradients and `state` never
    # saw them, though the rank held them throughout (a ZeRO-2 rank peaking in its forward read 5 % low).
    assert peak(True) - peak(False) == 400_000 + 2 * 16 * 4
