"""The five-phase Prefect flow end to end on a tiny model: MLflow run, checkpoints, verified exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def flow_run(prefect_harness, tmp_path_factory):
    """One full flow run (ONNX on), shared by the assertions below."""
    from memfit import config
    from flows.finetune import finetune
    from tests_support import tiny_overrides

    root = tmp_path_factory.mktemp("flow")
    repo = Path(__file__).resolve().parents[2]
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = config.load(repo / "configs" / "tiny.yaml", tiny_overrides(root, uri, **{
        "train.max_steps": 24, "checkpoint.every_steps": 8, "data.synthetic_docs": 600}))
    summary = finetune(config=cfg)
    return cfg, summary, root


def test_flow_summary_and_loss(flow_run):
    cfg, s, _ = flow_run
    assert s.status == "completed" and s.steps == 24
    assert s.final_val_loss < s.initial_val_loss - 0.5
    assert s.tracking_uri == cfg.tracking.uri and s.mlflow_run_id
    assert s.baseline["peak_bytes"] > 0 and s.plan.policy == "none"


def test_mlflow_run_has_metrics_params_and_artifacts(flow_run):
    from mlflow import MlflowClient

    cfg, s, _ = flow_run
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(s.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.run.name
    for metric in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_peak_bytes", "val_loss", "val_perplexity",
                   "onnx_max_abs_diff", "baseline_peak_bytes"):
        assert metric in run.data.metrics, metric
    losses = [m.value for m in client.get_metric_history(s.mlflow_run_id, "loss")]
    assert len(losses) == 24 and np.mean(losses[-4:]) < np.mean(losses[:4])
    assert run.data.params["train.max_steps"] == "24" and run.data.params["plan.policy"] == "none"
    assert run.data.tags["memfit.version"]
    paths = {a.path for a in client.list_artifacts(s.mlflow_run_id)}
    assert {"config", "memory", "environment", "export"} <= paths


def test_exports_load_and_match(flow_run):
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, s, _ = flow_run
    model = AutoModelForCausalLM.from_pretrained(s.safetensors_dir).eval()
    tok = AutoTokenizer.from_pretrained(s.safetensors_dir)
    assert model.config.use_cache is True
    ids = torch.tensor([tok.encode("one two three four five six")])
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    sess = ort.InferenceSession(s.onnx_path, providers=["CPUExecutionProvider"])
    out = sess.run(["logits"], {"input_ids": ids.numpy()})[0]
    assert out.shape == ref.shape and np.abs(out - ref).max() <= 1e-4


def test_rerun_of_a_finished_run_does_not_retrain(flow_run):
    from flows.finetune import finetune
    from mlflow import MlflowClient

    cfg, s, root = flow_run
    again = finetune(config=cfg)
    assert again.steps == s.steps and again.mlflow_run_id == s.mlflow_run_id
    history = MlflowClient(cfg.tracking.uri).get_metric_history(s.mlflow_run_id, "loss")
    assert len(history) == 24  # no new training steps were logged
    assert abs(again.final_val_loss - s.final_val_loss) < 1e-6
