"""data.streaming under torchrun: two CPU ranks (gloo, DDP) read the same stream, each trains its slice of every
micro-batch (the step's tokens counted once), and the run trains as one process does, saving the same stream
position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_streaming_training import _corpus
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.reports import PlanReport

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6
LOSS_TOL = 2e-4  # one process and two ranks sum the same numbers in another order


def _run(root: Path, corpus: Path, work: Path, ranks: int = 1, **extra: object) -> tuple[dict[int, float], dict]:
    from mlflow import MlflowClient

    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, f"sqlite:///{root / 'mlflow.db'}", **{
        "data.path": str(corpus), "data.streaming": True, "data.shuffle_buffer": 24, "train.max_steps": STEPS,
        "checkpoint.every_steps": 3, "train.eval_batches": 2, "export.onnx": False, "run.work_dir": str(work),
        "tracking.experiment": "stream-dist", **extra}))
    # A fixed plan (no probe, no planner): the test pins the data path, not the memory plan.
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="none",
                      strategy="ddp" if ranks > 1 else "single", world_size=ranks)
    report = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)
    assert report.steps == STEPS
    client = MlflowClient(cfg.tracking.uri)
    losses = {m.step: m.value for m in client.get_metric_history(report.mlflow_run_id, "loss")}
    speed, seconds = ({m.step: m.value for m in client.get_metric_history(report.mlflow_run_id, name)}
                      for name in ("tokens_per_s", "step_time_s"))
    # The tokens a step trained, over every rank: each rank counts its slice, times the ranks.
    want = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
    assert all(speed[s] * seconds[s] == pytest.approx(want, rel=1e-6) for s in losses), (speed, seconds, want)
    state = json.loads((root / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    return losses, state["data_order"]


def test_a_stream_on_two_ranks_trains_as_one_process_and_saves_the_same_position(tmp_path):
    corpus, work = _corpus(tmp_path / "notes.jsonl", 1500), tmp_path / "work"
    want, want_order = _run(tmp_path / "single", corpus, work)
    got, got_order = _run(tmp_path / "ranks", corpus, work, 2, **{"distributed.nproc_per_node": 2,
                                                                   "distributed.strategy": "ddp"})
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    diffs = {s: abs(got[s] - want[s]) for s in want}
    assert max(diffs.values()) < LOSS_TOL * max(1.0, max(want.values())), diffs
    assert got_order == want_order  # each rank read the whole stream: a resume on any rank count continues there
