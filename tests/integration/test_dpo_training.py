"""DPO trained for real on generated pairs: held-out preference accuracy rises, TRL-named metrics in MLflow, resume."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.reports import PlanReport

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
DPO_TINY = REPO / "configs" / "dpo-tiny.yaml"
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


def _config(root: Path, mlflow_uri: str | None = None, **extra: object):
    base = {"export.onnx": False, "train.num_threads": 1, "train.eval_batches": 8,
            **({} if mlflow_uri else {"tracking.backend": "null"})}
    return config.load(DPO_TINY, tiny_overrides(root, mlflow_uri, **{**base, **extra}))


def _train(cfg):
    # A fixed plan (no probe, no planner): these tests pin the objective, not the memory plan.
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="none",
                      lora=cfg.lora.enabled is True)
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)


def _newest(ckpt_root: Path) -> Path:
    return sorted(p for p in ckpt_root.iterdir() if p.name.startswith("step-"))[-1]


def _accuracy(client, run_id: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, "val_preference_accuracy")]


def test_dpo_with_a_frozen_copy_learns_the_rule_and_logs_trl_metrics(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    cfg = _config(tmp_path, mlflow_uri)
    assert cfg.train.objective == "dpo" and cfg.data.format == "preference" and cfg.lora.enabled is False
    result = _train(cfg)
    assert result.steps == 40
    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.mlflow_run_id)
    accuracy = _accuracy(client, result.mlflow_run_id)
    # Held-out pairs, ranked by the policy's own per-token log-prob: about chance before, well above after.
    assert accuracy[0][0] == 0 and 0.3 <= accuracy[0][1] <= 0.7, accuracy
    assert accuracy[-1][0] == 40 and accuracy[-1][1] >= 0.9, accuracy
    assert run.data.metrics["val_rewards/accuracies"] >= 0.9
    for name in TRL_METRICS:  # training metrics, TRL's names, every logged step
        assert len(client.get_metric_history(result.mlflow_run_id, name)) == 40, name
    assert run.data.metrics["rewards/margins"] > 0
    assert run.data.params["train.objective"] == "dpo" and run.data.params["dpo.reference"] == "auto"
    # The frozen reference is not trainable state: the checkpoint holds the policy's weights once.
    saved = load_file(str(_newest(tmp_path / "checkpoints") / "model.safetensors"))
    from transformers import AutoConfig, AutoModelForCausalLM

    model_cfg = AutoConfig.from_pretrained(next((tmp_path / "work").rglob("config.json")).parent)
    with torch.device("meta"):
        n_model = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_cfg).parameters())
    assert sum(t.numel() for t in saved.values()) == n_model


def test_dpo_lora_reference_is_the_model_with_adapters_off(tmp_path, caplog):
    cfg = _config(tmp_path, **{"lora.enabled": True, "train.max_steps": 30})
    with caplog.at_level(logging.INFO, logger="memfit.train"):
        result = _train(cfg)
    # Adapters start at zero, so with them off the reference is the policy: the first DPO loss is exactly log 2.
    first = next(r.getMessage() for r in caplog.records if "validation pairs at step 0" in r.getMessage())
    assert "dpo loss 0.6931," in first, first
    assert result.final_train_loss < 0.6
    saved = load_file(str(_newest(tmp_path / "checkpoints") / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]  # adapters only, no second model


def test_precomputed_reference_trains_like_the_copy_and_auto_takes_it_over_a_full_pass(tmp_path, caplog):
    """80 generated pairs, 12 steps of 8: the run goes over its training pairs more than once, so auto precomputes
    the reference (each pair's log-probs once, no copy while training) and trains as the frozen copy does."""
    weights = {}
    for mode in ("copy", "auto"):
        cfg = _config(tmp_path / mode, **{"dpo.reference": mode, "train.max_steps": 12, "data.synthetic_docs": 80,
                                          "checkpoint.every_steps": 12})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="memfit.train"):
            assert _train(cfg).steps == 12
        if mode == "auto":
            said = next(r.getMessage() for r in caplog.records if "dpo.reference auto" in r.getMessage())
            assert said.startswith("dpo.reference auto: precompute (") and " times;" in said, said
            assert any("reference log-probs of" in r.getMessage() for r in caplog.records)
        weights[mode] = load_file(str(_newest(tmp_path / mode / "checkpoints") / "model.safetensors"))
    for k, v in weights["copy"].items():
        torch.testing.assert_close(weights["auto"][k], v, atol=1e-5, rtol=1e-4)


def test_a_restarted_precompute_run_reads_the_kept_reference_and_ends_bitwise_equal(tmp_path, caplog):
    """The precomputed reference log-probs are kept in the training-checkpoint store: a run restarted from step 6
    (its step-12 checkpoint removed, as if the machine had vanished) reads them instead of a second pass, and
    its step-12 weights equal the first attempt's; a damaged object is computed again."""
    import shutil

    cfg = _config(tmp_path, **{"dpo.reference": "precompute", "train.max_steps": 12, "checkpoint.every_steps": 6,
                               "checkpoint.keep_last": 3})
    assert _train(cfg).steps == 12
    (kept,) = (tmp_path / "checkpoints" / "reference").iterdir()
    assert kept.name.startswith("ref-logps-") and kept.suffix == ".safetensors"
    first = load_file(str(tmp_path / "checkpoints" / "step-00000012" / "model.safetensors"))
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000012")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit.train"):
        assert _train(cfg).steps == 12
    said = [r.getMessage() for r in caplog.records if "dpo.reference precompute" in r.getMessage()]
    assert len(said) == 1 and "read from" in said[0] and kept.name in said[0], said
    again = load_file(str(tmp_path / "checkpoints" / "step-00000012" / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    kept.write_bytes(kept.read_bytes()[:100])  # a damaged object: warned about, computed again
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000012")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit.train"):
        assert _train(cfg).steps == 12
    said = [r.getMessage() for r in caplog.records if "dpo.reference precompute" in r.getMessage()]
    assert "is unusable" in said[0] and "validation pairs in" in said[1], said
    third = load_file(str(tmp_path / "checkpoints" / "step-00000012" / "model.safetensors"))
    assert all(torch.equal(first[k], third[k]) for k in first)


def test_dpo_run_killed_after_a_checkpoint_resumes_to_the_same_weights(tmp_path):
    """SIGKILL (no handler runs, a background save may be cut short) after step 7, then a rerun: bitwise equal."""
    import os
    import subprocess
    import sys

    common = {"train.max_steps": 8, "checkpoint.every_steps": 3}
    _train(_config(tmp_path, **common, **{"checkpoint.uri": str(tmp_path / "straight")}))
    overrides = {**common, "checkpoint.uri": str(tmp_path / "killed")}
    script = (f"import sys; sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO / 'tests' / 'integration')!r}]\n"
              "from pathlib import Path\nimport test_dpo_training as t\n"
              f"t._train(t._config(Path({str(tmp_path)!r}), **{overrides!r}))\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MEMFIT_TEST_RANK_FAULT": "kill:0:7"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    cfg = _config(tmp_path, **overrides)
    result = _train(cfg)
    assert result.resumed_from in (3, 6) and result.steps == 8  # step 6's save may not have finished
    a = load_file(str(_newest(tmp_path / "straight") / "model.safetensors"))
    b = load_file(str(_newest(tmp_path / "killed") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
