"""data.streaming trained for real: a run killed mid-epoch resumes at the exact block, bitwise, losses and weights
(a file, and hf:NAME)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit import phases
from memfit.reports import PlanReport
from memfit.tracking.null import NullTracker

pytestmark = pytest.mark.integration


def _corpus(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"note {i}: " + " ".join(f"w{(i * 5 + k) % 31}" for k in range(4 + i % 9))})
                    + "\n")
    return path


def _train(cfg):
    # A fixed plan (no probe, no planner): the test pins the data path, not the memory plan.
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="none")
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(str(sorted(p for p in root.iterdir() if p.name.startswith("step-"))[-1] / "model.safetensors"))


@pytest.mark.parametrize("source", ["file", "hf"])
def test_streamed_run_killed_mid_epoch_resumes_bitwise(source, tiny_config, tmp_path, monkeypatch, caplog):
    (tmp_path / "hub").mkdir()
    data = _corpus(tmp_path / "hub" / "notes.jsonl", 1500)  # ~200 blocks of 64: 9 steps of 16 stay in epoch 1
    # hf:NAME is datasets.load_dataset(NAME, streaming=True), offline here on a local folder given as the name; the
    # resume finds the checkpoint's data by that name (the fingerprint: name and split).
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = str(data) if source == "file" else f"hf:{tmp_path / 'hub'}"
    common = {"data.path": path, "data.streaming": True, "data.shuffle_buffer": 24, "tracking.backend": "null",
              "train.max_steps": 9, "checkpoint.every_steps": 3, "train.num_threads": 1, "train.eval_batches": 2}
    losses: dict[str, dict[int, float]] = {"straight": {}, "killed": {}}
    original = NullTracker.log_metrics
    run = ["straight"]

    def record(self, metrics, step):
        original(self, metrics, step)
        if "loss" in metrics:
            losses[run[0]][step] = metrics["loss"]

    monkeypatch.setattr(NullTracker, "log_metrics", record)
    with caplog.at_level(logging.INFO, logger="memfit.data"):
        straight = _train(tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "straight")}))
    assert straight.steps == 9 and straight.final_train_loss < straight.initial_val_loss
    assert "no global shuffle: windows of 24 blocks permuted" in caplog.text
    assert not list((tmp_path / "work" / "data-cache").glob("*/train.npy"))  # nothing prepared on disk

    run[0] = "killed"
    cfg = tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "killed")})
    monkeypatch.setenv("MEMFIT_TEST_RANK_FAULT", "crash:0:7")  # dies after step 7: the step-6 checkpoint survives
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(cfg)
    monkeypatch.delenv("MEMFIT_TEST_RANK_FAULT")
    state = json.loads((tmp_path / "killed" / "step-00000006" / "state.json").read_text())
    position = state["data_order"]["stream"]
    assert position["epoch"] == 0 and position["window"] >= 1  # mid-epoch, past the first shuffle window
    resumed = _train(cfg)
    assert resumed.resumed_from == 6 and resumed.steps == 9
    assert losses["killed"] == losses["straight"], "resumed losses differ from the uninterrupted run"
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
