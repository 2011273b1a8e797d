"""Phase 5 in bf16 (eval.dtype): the evaluation runs on a 16-bit copy, the exports stay the fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from tests_support import tiny_overrides

from memfit import config, phases

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_phase5_in_bf16_scores_close_to_fp32_and_exports_the_same_weights(tmp_path):
    from mlflow import MlflowClient

    base = {"train.max_steps": 8, "checkpoint.every_steps": 8, "export.onnx": False, "registry.enabled": False,
            "train.num_threads": 1, "tracking.system_metrics": False}
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, **base))
    trained = phases.train(cfg, phases.plan_stack(cfg, phases.check_environment_and_probe(cfg)),
                           phases.recover_training_checkpoint(cfg), None)
    reports = {}
    for dtype in ("fp32", "bf16"):
        run_cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"dtype": dtype}),
                                         "export": cfg.export.model_copy(update={"dir": str(tmp_path / dtype)})})
        reports[dtype] = phases.evaluate_and_release(run_cfg, trained)
    fp32, bf16 = reports["fp32"], reports["bf16"]
    # bf16 rounds the weights and activations: the loss moves a little, not more.
    assert fp32.final_val_loss != bf16.final_val_loss
    assert abs(fp32.final_val_loss - bf16.final_val_loss) < 0.02 * fp32.final_val_loss
    # The exports come from the fp32 weights in host memory either way: the same tensors, bit for bit.
    a = load_file(str(Path(fp32.safetensors_dir) / "model.safetensors"))
    b = load_file(str(Path(bf16.safetensors_dir) / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) and str(a[k].dtype) == "torch.float32" for k in a)
    run = MlflowClient(cfg.tracking.resolved_uri()).get_run(trained.mlflow_run_id)
    assert run.data.tags["memfit.eval_dtype"] == "bf16"  # the last phase 5 on this run


def test_auto_on_cpu_evaluates_in_fp32():
    from memfit.evaluation.dtype import phase5_dtype

    cfg = config.load(REPO / "configs" / "tiny.yaml", [])
    assert cfg.eval.dtype == "auto"
    import torch

    assert phase5_dtype(cfg, torch.device("cpu"), torch.nn.Linear(2, 2)) == "fp32"
