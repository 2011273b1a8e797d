"""Phases 1-4 without Prefect: the probe, loss falling, preemption and bitwise-exact resume."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit import phases
from memfit.errors import ConfigError, Preempted
from memfit.reports import PlanReport
from memfit.tracking.null import NullTracker

pytestmark = pytest.mark.integration


def _final_weights(ckpt_root: Path) -> dict[str, torch.Tensor]:
    newest = sorted(p for p in ckpt_root.iterdir() if p.name.startswith("step-"))[-1]
    return load_file(str(newest / "model.safetensors"))


def test_probe_measures_a_real_step(tiny_config):
    cfg = tiny_config()
    report = phases.check_environment_and_probe(cfg)
    b = report.baseline
    assert b["peak_bytes"] > 0 and b["fits"] is True and b["budget_bytes"] is None
    assert b["breakdown"]["activations"] > 0 and b["breakdown"]["params"] > 0
    assert b["breakdown"]["optimizer"] > 0  # steady state: AdamW's moments exist during the step
    assert report.environment["device"]["type"] == "cpu"
    assert report.environment["libraries"]["torch"].startswith("2.13")
    # A simulated budget below the measured peak is a would-OOM verdict, with numbers, and the estimator's
    # breakdown of what does not fit.
    budget_gb = b["peak_bytes"] * 0.7 / 1e9
    tight = phases.check_environment_and_probe(tiny_config(**{"memory.budget_gb": budget_gb}))
    assert tight.baseline["fits"] is False and tight.baseline["headroom_bytes"] < 0
    assert "would OOM" in tight.baseline["message"] and "estimator" in tight.baseline["message"]
    assert tight.baseline["estimate"]["breakdown"]["activations"] > 0
    plan = phases.plan_stack(tiny_config(**{"memory.budget_gb": budget_gb}), tight)
    assert plan.policy != "none" and plan.fits is True
    assert plan.predicted_peak_bytes <= budget_gb * 1e9
    assert phases.plan_stack(cfg, report).policy == "none"


def test_probe_measures_bf16_true_with_bf16_weights_and_reports_weights_that_do_not_fit(tiny_config, monkeypatch):
    fp32 = phases.check_environment_and_probe(tiny_config()).baseline["breakdown"]
    bf16 = phases.check_environment_and_probe(tiny_config(**{"train.precision": "bf16-true"})).baseline["breakdown"]
    assert bf16["params"] * 2 == fp32["params"]  # the step the trainer runs: pure bf16 weights
    # Weights too big for the device: an OOM verdict naming them (and the estimator's breakdown), no step run.
    from memfit.memory.estimator.probe import StepMemory

    oom = StepMemory(peak_bytes=0, oom=True, method="cuda.max_memory_allocated",
                     error="the weights alone do not fit on cuda: CUDA out of memory. Tried to allocate 16.00 GiB")
    monkeypatch.setattr(phases, "weights_to_device", lambda model, device: oom)
    b = phases.check_environment_and_probe(tiny_config()).baseline
    assert b["oom"] is True and b["fits"] is False
    assert "the weights alone do not fit on cuda" in b["message"] and "estimator" in b["message"]


def test_offload_on_cpu_is_a_clear_error(tiny_config):
    cfg = tiny_config(**{"memory.policy": "offload"})
    report = phases.check_environment_and_probe(tiny_config())
    with pytest.raises(ConfigError, match="memory.policy"):
        phases.plan_stack(cfg, report)


def _train(cfg):
    report = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, report)
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), report)


def test_loss_falls_and_checkpoints_are_kept(tiny_config, tmp_path):
    cfg = tiny_config(**{"tracking.backend": "null", "train.max_steps": 30, "checkpoint.every_steps": 10,
                         "checkpoint.keep_last": 2})
    result = _train(cfg)
    assert result.steps == 30 and result.preempted is False
    assert result.final_train_loss < result.initial_val_loss - 1.0
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000020", "step-00000030"]


def test_sigterm_saves_and_resume_is_bitwise_identical(tiny_config, tmp_path, monkeypatch):
    common = {"tracking.backend": "null", "train.max_steps": 8, "checkpoint.every_steps": 3}
    straight = tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "straight")})
    _train(straight)

    cfg = tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "interrupted")})
    original = NullTracker.log_metrics

    def preempt_at_5(self, metrics, step):
        original(self, metrics, step)
        if step == 5 and "loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)  # what a spot reclaim or `kubectl delete pod` sends

    monkeypatch.setattr(NullTracker, "log_metrics", preempt_at_5)
    with pytest.raises(Preempted, match="step 5"):
        _train(cfg)
    assert (tmp_path / "interrupted" / "step-00000005" / "manifest.json").exists()
    monkeypatch.setattr(NullTracker, "log_metrics", original)

    resume = phases.recover_training_checkpoint(cfg)
    assert resume.step == 5 and not resume.finished
    result = _train(cfg)
    assert result.resumed_from == 5 and result.steps == 8
    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "interrupted")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"

    # A finished run is not retrained.
    again = phases.recover_training_checkpoint(cfg)
    assert again.finished
    report = _train(cfg)
    assert report.steps == 8 and report.start_step == 8


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones_and_report_compile_time(tiny_config, tmp_path):
    """train.compile under full gradient checkpointing: the same losses as eager within float noise, the same
    checkpoint keys, and the compile time logged apart (compile_s, from torch.compile's own callbacks)."""
    from mlflow import MlflowClient

    plan = PlanReport(policy="full", every_k=2, precision="fp32", micro_batch_size=4, grad_accum_steps=1,
                      reason="test", description="full")
    reports = {}
    for compiled in (False, True):
        cfg = tiny_config(**{"train.max_steps": 3, "checkpoint.every_steps": 3, "train.batch_size": 4,
                             "train.compile": compiled, "checkpoint.uri": str(tmp_path / f"ck-{compiled}"),
                             "run.name": f"compile-{compiled}"})
        reports[compiled] = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)
    eager, compiled = reports[False], reports[True]
    assert compiled.final_train_loss == pytest.approx(eager.final_train_loss, rel=1e-4)
    a, b = _final_weights(tmp_path / "ck-False"), _final_weights(tmp_path / "ck-True")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(compiled.mlflow_run_id, "compile_s")
    # The first step compiles (the validation pass before it too): logged at step 1, nothing after.
    assert [m.step for m in history] == [1] and history[0].value > 0.5
    assert not client.get_metric_history(eager.mlflow_run_id, "compile_s")
