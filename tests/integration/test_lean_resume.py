"""Each optimizer option (and the chunked loss) resumes bitwise: killed after a training checkpoint, rerun."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit import phases
from memfit.reports import PlanReport
from memfit.tracking.null import NullTracker

pytestmark = pytest.mark.integration

OPTIONS = {
    "adamw-fused": {"memory.optimizer": "adamw-fused"},
    "adamw-8bit": {"memory.optimizer": "adamw-8bit"},
    "step-in-backward": {"memory.optimizer_in_backward": "true", "train.max_grad_norm": "null",
                         "train.grad_accum_steps": 1},
    "chunked-loss": {"memory.loss": "chunked", "memory.loss_chunk_tokens": 100},
}


class Killed(BaseException):
    """Stands in for SIGKILL: nothing of the run's own clean-up is asked to save anything."""


def _train(cfg):
    plan = PlanReport(policy="none", every_k=2, precision=cfg.train.precision,
                      micro_batch_size=cfg.train.micro_batch_size, grad_accum_steps=cfg.train.grad_accum_steps,
                      reason="test", description="none")
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)


def _final(root: Path) -> dict[str, torch.Tensor]:
    newest = sorted(p for p in root.iterdir() if p.name.startswith("step-"))[-1]
    return load_file(str(newest / "model.safetensors"))


# What each option's own code records when the run goes through it (not only that it was configured).
MARKER = {"adamw-fused": "fused", "adamw-8bit": "AdamW8bit", "step-in-backward": "hook", "chunked-loss": "chunked",
          "adamw-cpu-offload": "CPUOffloadOptimizer"}


def _spy(monkeypatch) -> list[str]:
    from memfit import optim
    from memfit.training import loss

    used: list[str] = []
    step, call, make = optim.StepInBackward._step, loss.ChunkedLoss.__call__, optim.make_adamw

    def spy_step(self, p):
        used.append("hook")
        step(self, p)

    def spy_call(self, model, batch):
        used.append("chunked")
        return call(self, model, batch)

    def spy_make(*args, **kwargs):
        opt = make(*args, **kwargs)
        used.append("fused" if any(g.get("fused") for g in opt.param_groups) else type(opt).__name__)
        return opt

    monkeypatch.setattr(optim.StepInBackward, "_step", spy_step)
    monkeypatch.setattr(loss.ChunkedLoss, "__call__", spy_call)
    monkeypatch.setattr(optim, "make_adamw", spy_make)
    return used


@pytest.mark.parametrize("option", list(OPTIONS))
def test_killed_after_a_training_checkpoint_and_rerun_ends_bitwise_equal(option, tiny_config, tmp_path, monkeypatch):
    if option == "adamw-8bit":
        pytest.importorskip("bitsandbytes")
    common = {"tracking.backend": "null", "train.max_steps": 6, "checkpoint.every_steps": 2,
              "train.num_threads": 1, **OPTIONS[option]}
    used = _spy(monkeypatch)
    straight = _train(tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "straight")}))
    assert straight.final_train_loss < straight.initial_val_loss  # it trains, as the default does
    assert MARKER[option] in used, f"{option} was not what the run used: {used[:3]}"

    root = tmp_path / "killed"
    cfg = tiny_config(**common, **{"checkpoint.uri": str(root)})
    original = NullTracker.log_metrics

    def kill_at_5(self, metrics, step):
        original(self, metrics, step)
        if step == 5 and "loss" in metrics:
            deadline = time.monotonic() + 60  # the step-4 training checkpoint is committed first
            while not (root / "step-00000004" / "manifest.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise Killed

    monkeypatch.setattr(NullTracker, "log_metrics", kill_at_5)
    with pytest.raises(Killed):
        _train(cfg)
    monkeypatch.setattr(NullTracker, "log_metrics", original)
    assert not (root / "step-00000005").exists()
    resumed = _train(cfg)
    assert resumed.resumed_from == 4 and resumed.steps == 6
    a, b = _final(tmp_path / "straight"), _final(root)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{option}: resume differs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offloaded_optimizer_resumes_bitwise_on_cuda(tiny_config, tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    OPTIONS["adamw-cpu-offload"] = {"memory.optimizer": "adamw-cpu-offload", "train.device": "cuda"}
    try:
        test_killed_after_a_training_checkpoint_and_rerun_ends_bitwise_equal("adamw-cpu-offload", tiny_config,
                                                                            tmp_path, monkeypatch)
    finally:
        OPTIONS.pop("adamw-cpu-offload")
