"""Phase 5 in bf16 (eval.dtype): the evaluation runs on a 16-bit copy, the exports stay the fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests_support import tiny_overrides

from memfit import config, phases

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _trained(tmp_path: Path, device: str):
    base = {"train.max_steps": 8, "checkpoint.every_steps": 8, "export.onnx": False, "registry.enabled": False,
            "train.num_threads": 1, "tracking.system_metrics": False, "train.device": device}
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, **base))
    return cfg, phases.train(cfg, phases.plan_stack(cfg, phases.check_environment_and_probe(cfg)),
                             phases.recover_training_checkpoint(cfg), None)


def _phase5(cfg, trained, dtype: str, out: Path):
    run_cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"dtype": dtype}),
                                     "export": cfg.export.model_copy(update={"dir": str(out)})})
    return phases.evaluate_and_release(run_cfg, trained)


def _same_export(a, b) -> bool:
    x = load_file(str(Path(a.safetensors_dir) / "model.safetensors"))
    y = load_file(str(Path(b.safetensors_dir) / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].equal(y[k]) and x[k].dtype == torch.float32 for k in x)


def _eval_dtype_tag(cfg, trained) -> str:
    from mlflow import MlflowClient

    return MlflowClient(cfg.tracking.resolved_uri()).get_run(trained.mlflow_run_id).data.tags["memfit.eval_dtype"]


def test_phase5_in_bf16_scores_close_to_fp32_and_exports_the_same_weights(tmp_path):
    cfg, trained = _trained(tmp_path, "cpu")
    fp32 = _phase5(cfg, trained, "fp32", tmp_path / "fp32")
    bf16 = _phase5(cfg, trained, "bf16", tmp_path / "bf16")
    # bf16 rounds the weights and activations: the loss moves a little, not more.
    assert fp32.final_val_loss != bf16.final_val_loss
    assert abs(fp32.final_val_loss - bf16.final_val_loss) < 0.02 * fp32.final_val_loss
    # The exports come from the fp32 weights in host memory either way: the same tensors, bit for bit.
    assert _same_export(fp32, bf16)
    assert _eval_dtype_tag(cfg, trained) == "bf16"  # the last phase 5 on this run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_auto_evaluates_in_bf16_where_fp32_would_not_fit(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # the run's eval dtype is read back from its MLflow tags
    cfg, trained = _trained(tmp_path, "cuda")
    fp32 = _phase5(cfg, trained, "fp32", tmp_path / "fp32")
    # The device as if nearly full: phase 5's fp32 peak (a few MB for the tiny model) would not fit in 1 MB free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    auto = _phase5(cfg, trained, "auto", tmp_path / "auto")
    assert _eval_dtype_tag(cfg, trained) == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert _same_export(fp32, auto)
    assert abs(fp32.final_val_loss - auto.final_val_loss) < 0.02 * fp32.final_val_loss


def test_auto_on_cpu_evaluates_in_fp32():
    from memfit.evaluation.dtype import phase5_dtype

    cfg = config.load(REPO / "configs" / "tiny.yaml", [])
    assert cfg.eval.dtype == "auto"
    assert phase5_dtype(cfg, torch.device("cpu"), torch.nn.Linear(2, 2)) == "fp32"
