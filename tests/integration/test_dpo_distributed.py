"""DPO under torchrun: two CPU ranks (gloo) train as one process does, with DDP (a frozen copy as reference) and
FSDP2 (auto precomputes: a sharded model is not copied); the TRL-named metrics cover every rank's pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests_support import tiny_overrides

from memfit import config, phases

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 8
LOSS_TOL = 2e-4  # one process and two ranks sum the same numbers in another order


def _cfg(root: Path, work: Path, **extra: object):
    base = {"train.max_steps": STEPS, "checkpoint.every_steps": 4, "export.onnx": False, "run.work_dir": str(work),
            "tracking.experiment": "dpo-dist", "train.eval_batches": 4, **extra}
    return config.load(REPO / "configs" / "dpo-tiny.yaml",
                       tiny_overrides(root, f"sqlite:///{root / 'mlflow.db'}", **base))


def _history(cfg, run_id: str, name: str) -> dict[int, float]:
    from mlflow import MlflowClient

    return {m.step: m.value for m in MlflowClient(cfg.tracking.uri).get_metric_history(run_id, name)}


def _run(cfg):
    probe = phases.check_environment_and_probe(cfg)
    report = phases.train(cfg, phases.plan_stack(cfg, probe), phases.recover_training_checkpoint(cfg), probe)
    assert report.steps == STEPS
    return {name: _history(cfg, report.mlflow_run_id, name)
            for name in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "val_dpo_loss")}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    work = tmp_path_factory.mktemp("dpo-dist-work")  # one preset build shared by the runs
    return work, _run(_cfg(tmp_path_factory.mktemp("single"), work))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_dpo_on_two_ranks_trains_as_one_process(tmp_path, single, strategy):
    work, want = single
    cfg = _cfg(tmp_path, work, **{"distributed.nproc_per_node": 2, "distributed.strategy": strategy})
    got = _run(cfg)
    for name in ("loss", "rewards/margins", "logps/chosen"):
        diffs = {s: abs(got[name][s] - want[name][s]) for s in want[name]}
        assert sorted(got[name]) == sorted(want[name]) and max(diffs.values()) < LOSS_TOL * max(
            1.0, max(abs(v) for v in want[name].values())), (name, diffs)
    # A share of pairs, not one rank's half: the same fraction as one process over the whole batch.
    assert got["rewards/accuracies"] == pytest.approx(want["rewards/accuracies"], abs=1e-6)
    assert got["val_dpo_loss"] == pytest.approx(want["val_dpo_loss"], abs=1e-4)
    if strategy == "fsdp2":  # the reference was precomputed: the run kept it in the store
        assert list((tmp_path / "checkpoints" / "reference").glob("ref-logps-*.safetensors"))


def test_dpo_under_deepspeed_is_refused_in_one_line(tmp_path):
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match="train.objective: dpo runs under ddp and fsdp2, not deepspeed_zero2 yet"):
        _cfg(tmp_path, tmp_path, **{"distributed.nproc_per_node": 2, "distributed.strategy": "deepspeed_zero2"})


