"""Golden losses: the first optimizer steps of configs/tiny.yaml, pinned, for one process, 2-rank DDP and FSDP2."""

# How the literals were produced: `MEMFIT_PRINT_GOLDEN=1 pytest tests/integration/test_golden_losses.py -s` on
# the code before the single training loop (main at e4046e1: memfit/train.py Trainer, memfit/distributed/
# trainer.py DistTrainer), torch 2.13.0+cpu, transformers 5.24.0, Python 3.11.7, a 2-core x86-64 CPU, gloo.
# Each run is phase 3 as the flow calls it (phases.train with a fixed plan: no probe, no planner), so the
# numbers pin the loop, the strategies, the data order and the optimizer, not the planner's choice. The losses
# are read back from MLflow, as a user sees them. A refactor must leave them unchanged; a deliberate change of
# the numerics (a new optimizer default, another data order) regenerates them and says why in its commit.

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.reports import PlanReport, ResumePoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 5
REL_TOL = 1e-5  # thread counts are pinned; what is left is float noise well below this

# Measured separately for each strategy; with one thread per process the three agree to the last bit (the
# ranks' halves of a micro-batch sum to what one process computes), which is why they are written out thrice.
GOLDEN: dict[str, list[float]] = {
    "single": [5.973730564117432, 5.789912223815918, 5.551823616027832, 5.3582658767700195, 5.199176788330078],
    "ddp": [5.973730564117432, 5.789912223815918, 5.551823616027832, 5.3582658767700195, 5.199176788330078],
    "fsdp2": [5.973730564117432, 5.789912223815918, 5.551823616027832, 5.3582658767700195, 5.199176788330078],
}


def _run(root: Path, work: Path, strategy: str) -> list[float]:
    from mlflow import MlflowClient

    ranks = 1 if strategy == "single" else 2
    # tests/conftest.py's tiny_config, shorter; one torch thread per process so every rank count repeats.
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(
        root, f"sqlite:///{root / 'mlflow.db'}", **{
            "train.max_steps": STEPS, "checkpoint.every_steps": 4, "train.warmup_steps": 2,
            "data.synthetic_docs": 400, "export.onnx": False, "train.eval_batches": 1, "train.num_threads": 1,
            "run.work_dir": str(work), "distributed.nproc_per_node": ranks,
            "distributed.strategy": "auto" if strategy == "single" else strategy}))
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="golden", description="none",
                      strategy=strategy, world_size=ranks)
    report = phases.train(cfg, plan, ResumePoint(checkpoint_uri=cfg.checkpoint.uri), None)
    assert report.steps == STEPS and not report.preempted
    history = MlflowClient(cfg.tracking.uri).get_metric_history(report.mlflow_run_id, "loss")
    by_step = {m.step: m.value for m in history}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    return [by_step[s] for s in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("golden-work")  # one preset build shared by the three runs


@pytest.mark.parametrize("strategy", list(GOLDEN))
def test_first_steps_match_the_golden_losses(tmp_path, work, strategy):
    losses = _run(tmp_path, work, strategy)
    if os.environ.get("MEMFIT_PRINT_GOLDEN"):
        print(f"\nGOLDEN {strategy!r}: {losses!r}")
    assert losses == pytest.approx(GOLDEN[strategy], rel=REL_TOL), (strategy, losses)
