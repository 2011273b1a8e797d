"""The five-phase Prefect flow end to end on a tiny model: MLflow run, checkpoints, verified exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


# Planted secrets: one in the environment (the environment report lists MEMFIT_* variables), one in a
# free-text config field (an eval prompt lands in params, the resolved config and the generations table).
PLANTED_ENV = ("MEMFIT_PLANTED_API_TOKEN", "planted-env-secret-5b2c9e71")
PLANTED_PROMPT_TOKEN = "hf_" + "PlantedConfigSecretXy0123456789abcd"


@pytest.fixture(scope="module")
def flow_run(prefect_harness, tmp_path_factory):
    """One full flow run (ONNX on), shared by the assertions below."""
    import os

    from tests_support import tiny_overrides

    from flows.finetune import finetune
    from memfit import config

    root = tmp_path_factory.mktemp("flow")
    repo = Path(__file__).resolve().parents[2]
    uri = f"sqlite:///{root / 'mlflow.db'}"
    prompts = f'["one two three", "the red fox", "my key is {PLANTED_PROMPT_TOKEN}"]'
    cfg = config.load(repo / "configs" / "tiny.yaml", tiny_overrides(root, uri, **{
        "train.max_steps": 24, "checkpoint.every_steps": 8, "data.synthetic_docs": 600, "eval.prompts": prompts,
        # 24 steps train in about a second on a fast machine: at tiny.yaml's 1 s interval the run could end with
        # a single system-metrics sample (seen once, 2026-12-02), and the history below needs two.
        "tracking.system_metrics_interval_s": 0.25}))
    os.environ[PLANTED_ENV[0]] = PLANTED_ENV[1]
    try:
        summary = finetune(config=cfg)
    finally:
        os.environ.pop(PLANTED_ENV[0], None)
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
    from mlflow import MlflowClient

    from flows.finetune import finetune

    cfg, s, root = flow_run
    again = finetune(config=cfg)
    assert again.steps == s.steps and again.mlflow_run_id == s.mlflow_run_id
    history = MlflowClient(cfg.tracking.uri).get_metric_history(s.mlflow_run_id, "loss")
    assert len(history) == 24  # no new training steps were logged
    assert abs(again.final_val_loss - s.final_val_loss) < 1e-6


def _artifact_files(client, run_id, path=None):
    for item in client.list_artifacts(run_id, path):
        if item.is_dir:
            yield from _artifact_files(client, run_id, item.path)
        else:
            yield item.path


def test_run_tells_the_whole_story(flow_run):
    """System metrics, PNGs, the plan table, the dataset with its digest, generations, tags."""
    import json

    from mlflow import MlflowClient

    cfg, s, root = flow_run
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(s.mlflow_run_id)
    system = [k for k in run.data.metrics if k.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system and "system/system_memory_usage_megabytes" in system
    assert len(client.get_metric_history(s.mlflow_run_id, "system/cpu_utilization_percentage")) >= 2
    # The cost of metric logging is measured and logged (its target lives in bench/tracking_overhead.py).
    assert 0 < run.data.metrics["tracking_overhead_fraction"] < 1 and run.data.metrics["tracking_writer_fraction"] > 0
    files = set(_artifact_files(client, s.mlflow_run_id))
    assert {"plots/loss_curve.png", "plots/memory_breakdown.png", "memory/plan.md", "config/resolved.yaml",
            "environment/report.json", "eval/generations.json", "export/onnx/model.onnx",
            "export/onnx/model.onnx.memfit.json", "export/hf/memfit-export.json"} <= files
    for png in ("plots/loss_curve.png", "plots/memory_breakdown.png"):
        local = Path(client.download_artifacts(s.mlflow_run_id, png, str(root)))
        assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 10_000
    plan_md = Path(client.download_artifacts(s.mlflow_run_id, "memory/plan.md", str(root))).read_text()
    assert "| policy | none |" in plan_md and "Baseline probe" in plan_md
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    train_ds = inputs["synthetic(600, 1234) [training]"]
    assert run.data.params["data.digest"].startswith(train_ds.dataset.digest) and len(train_ds.dataset.digest) == 32
    assert json.loads(train_ds.dataset.profile)["sha256"] == run.data.params["data.digest"]
    assert [t.value for t in train_ds.tags] == ["training"]
    table = json.loads(Path(client.download_artifacts(s.mlflow_run_id, "eval/generations.json", str(root)))
                       .read_text())
    # log_table appends: a re-evaluation of the finished run (test above) adds its rows, at the same step.
    assert table["columns"] == ["prompt", "completion", "new_tokens", "step"]
    rows = table["data"]
    assert len(rows) % 3 == 0 and {r[0] for r in rows} == {"one two three", "the red fox", "my key is ***"}
    assert all(0 < r[2] <= cfg.eval.max_new_tokens and r[3] == 24 for r in rows)
    counting = next(r[1] for r in rows if r[0] == "one two three")
    assert "one two three" in counting  # the tiny model learned the corpus: greedy text continues the pattern
    assert run.data.tags["mlflow.source.git.commit"] and run.data.tags["memfit.device"] == "cpu"
    assert run.data.tags["memfit.gate"] == "passed"


def test_registered_version_is_champion_and_serves(flow_run):
    import mlflow
    from mlflow import MlflowClient

    cfg, s, _ = flow_run
    client = MlflowClient(cfg.tracking.uri)
    assert s.registered_model == "tiny@champion" and s.gate_passed is True
    mv = client.get_model_version_by_alias("tiny", "champion")
    assert mv.run_id == s.mlflow_run_id and str(mv.version) == s.model_version
    assert float(mv.tags["memfit.metric.val_perplexity"]) == pytest.approx(s.final_val_perplexity)
    # mlflow.pyfunc.load_model resolves models:/ through the global tracking URI: set it for the call only.
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(cfg.tracking.uri):
        model = mlflow.pyfunc.load_model("models:/tiny@champion")
    import pandas as pd

    out = model.predict(pd.DataFrame({"prompt": ["one two three", "the red fox"]}), params={"max_new_tokens": 4})
    assert len(out) == 2 and all(isinstance(o, str) for o in out)
    assert "four" in out[0] or "one" in out[0]  # the trained weights, not a random model, answer


def test_secrets_absent_from_everything_mlflow_stored(flow_run):
    """The planted env and config secrets appear nowhere: database rows, artifacts, logged models."""
    from mlflow import MlflowClient

    cfg, s, root = flow_run
    planted = [PLANTED_ENV[1].encode(), PLANTED_PROMPT_TOKEN.encode()]
    stored = [root / "mlflow.db", *sorted((root / "mlruns").rglob("*"))]
    assert len(stored) > 20  # the run's artifacts and the logged model really are there to scan
    for path in stored:
        if path.is_file():
            data = path.read_bytes()
            assert not any(p in data for p in planted), path
    run = MlflowClient(cfg.tracking.uri).get_run(s.mlflow_run_id)
    assert "***" in run.data.params["eval.prompts"] and "one two three" in run.data.params["eval.prompts"]
    report = (next((root / "mlruns").rglob("environment/report.json"))).read_text()
    assert f'"{PLANTED_ENV[0]}": "***"' in report  # listed, masked


def test_gate_failure_blocks_registration(flow_run, tmp_path):
    from mlflow import MlflowClient

    from memfit import phases
    from memfit.reports import TrainReport

    cfg, s, _ = flow_run
    strict = cfg.model_copy(update={
        "eval": cfg.eval.model_copy(update={"gate": cfg.eval.gate.model_copy(update={"max_perplexity": 1.001})}),
        "registry": cfg.registry.model_copy(update={"model_name": "tiny-strict"}),
        "export": cfg.export.model_copy(update={"dir": str(tmp_path / "export"), "onnx": False})})
    trained = TrainReport(mlflow_run_id=s.mlflow_run_id, start_step=24, steps=24, resumed_from=24, preempted=False,
                          initial_val_loss=None, final_train_loss=None, tokens_per_s=None, peak_memory_bytes=0,
                          last_checkpoint_uri=None)
    report = phases.evaluate_and_release(strict, trained)
    assert report.registry["gate_passed"] is False and report.registry["version"] is None
    assert "> eval.gate.max_perplexity 1.001" in report.registry["gate_reason"]
    client = MlflowClient(cfg.tracking.uri)
    assert client.search_model_versions("name = 'tiny-strict'") == []
    assert str(client.get_model_version_by_alias("tiny", "champion").version) == s.model_version  # untouched
    tags = client.get_run(s.mlflow_run_id).data.tags
    assert tags["memfit.gate"] == "failed" and "max_perplexity" in tags["memfit.gate.reason"]
    assert (tmp_path / "export" / "hf" / "model.safetensors").is_file()  # the export itself is kept
