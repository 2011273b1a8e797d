"""DPO under torchrun: two CPU ranks (gloo) train as one process does, with DDP and DeepSpeed ZeRO-2 (a frozen copy
as reference) and FSDP2 and ZeRO-3 (auto precomputes: a sharded model is not copied); the TRL-named metrics cover
every rank's pairs."""

from __future__ import annotations

import importlib.util
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


def _run(cfg, seen: dict | None = None):
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    if seen is not None:
        seen.update(probe=probe, plan=plan)
    report = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    assert report.steps == STEPS
    return {name: _history(cfg, report.mlflow_run_id, name)
            for name in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "val_dpo_loss")}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("dpo-dist-work")  # one preset build shared by the runs


@pytest.fixture(scope="module")
def single(tmp_path_factory, work):
    return work, _run(_cfg(tmp_path_factory.mktemp("single"), work))


LORA = {"lora.enabled": True, "lora.r": 4, "dpo.reference": "adapter_off", "train.lr": 1e-2}


NO_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                  reason="DeepSpeed is an optional extra: pip install 'memfit[deepspeed]'")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", pytest.param("deepspeed_zero2", marks=NO_DEEPSPEED),
                                      pytest.param("deepspeed_zero3", marks=NO_DEEPSPEED)])
def test_dpo_on_two_ranks_trains_as_one_process(tmp_path, single, strategy):
    work, want = single
    cfg = _cfg(tmp_path, work, **{"distributed.nproc_per_node": 2, "distributed.strategy": strategy})
    seen: dict = {}
    _assert_same_run(_run(cfg, seen), want)
    # Phase 1 probed one rank's DPO micro-batch: each pair's chosen and rejected rows, cut to the longest pair.
    from memfit.memory.planner.pair_length import planned_seq_len

    probed = seen["probe"].baseline
    assert probed["batch_size"] == 2 * (cfg.train.micro_batch_size // 2) and probed["seq_len"] == planned_seq_len(cfg)
    assert probed["seq_len"] < cfg.data.seq_len and "pairs a rank" in probed["message"]
    # Phase 2 counted the frozen copy on ranks that hold whole weights (8 steps are under one pass: auto copies),
    # and none where the weights are split (precompute).
    sharding = seen["plan"].sharding
    whole = strategy in ("ddp", "deepspeed_zero2")
    assert sharding["reference"] == (seen["plan"].weight_bytes if whole else 0) and seen["plan"].weight_bytes > 0
    kept = list((tmp_path / "checkpoints" / "reference").glob("ref-logps-*.safetensors"))
    # Sharded (FSDP2, ZeRO-3): the reference was precomputed and kept in the store; whole weights: a copy, nothing kept.
    assert bool(kept) == (strategy in ("fsdp2", "deepspeed_zero3")), kept
    if kept:  # the same weights and pairs: the same key, ZeRO-3's partitions read whole (not their empty placeholders)
        KEPT[strategy] = kept[0].name
        assert len(set(KEPT.values())) == 1, KEPT


KEPT: dict[str, str] = {}  # the precomputed reference's object name per sharded strategy




@NO_DEEPSPEED
def test_lora_dpo_with_the_adapters_off_as_reference_under_zero3_trains_as_one_process(tmp_path_factory, work):
    """ZeRO-3 partitions the base and the adapters alike; disabling the adapters for the reference's forward (through
    the engine, which gathers each block's parameters) gives the base's log-probs as in one process."""
    want = _run(_cfg(tmp_path_factory.mktemp("single-lora"), work, **LORA))
    got = _run(_cfg(tmp_path_factory.mktemp("zero3-lora"), work, **LORA, **{
        "distributed.nproc_per_node": 2, "distributed.strategy": "deepspeed_zero3"}))
    _assert_same_run(got, want)
    assert max(want["rewards/margins"].values()) > 0  # the adapters moved the policy away from its reference


def _assert_same_run(got: dict, want: dict) -> None:
    for name in ("loss", "rewards/margins", "logps/chosen"):
        diffs = {s: abs(got[name][s] - want[name][s]) for s in want[name]}
        assert sorted(got[name]) == sorted(want[name]) and max(diffs.values()) < LOSS_TOL * max(
            1.0, max(abs(v) for v in want[name].values())), (name, diffs)
    # A share of pairs, not one rank's half: the same fraction as one process over the whole batch.
    assert got["rewards/accuracies"] == pytest.approx(want["rewards/accuracies"], abs=1e-6)
    assert got["val_dpo_loss"] == pytest.approx(want["val_dpo_loss"], abs=1e-4)
