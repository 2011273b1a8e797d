"""Scheduled retraining: newest data, from the champion, promoted only when the eval gate passes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _write_data(folder: Path, name: str, seed: int) -> None:
    from memfit.data.synthetic import synthetic_corpus

    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("\n\n".join(synthetic_corpus(300, seed)) + "\n")


def test_retrain_promotes_then_a_failed_gate_keeps_the_champion(prefect_harness, tmp_path):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from tests_support import tiny_overrides

    from flows.retrain import retrain
    from memfit import config

    data = tmp_path / "incoming"
    _write_data(data, "2026-11-01.txt", 1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, uri, **{
        "train.max_steps": 8, "checkpoint.every_steps": 4, "export.onnx": False,
        "deploy.retrain_data_uri": str(data), "run.name": "nightly"}))

    first = retrain(config=base)
    assert first.gate_passed is True and first.model_version == "1"
    client = MlflowClient(uri)
    assert str(client.get_model_version_by_alias("nightly", "champion").version) == "1"

    # New data arrives; this time the gate is set so that nothing can pass it.
    _write_data(data, "2026-11-02.txt", 2)
    strict = base.model_copy(update={"eval": base.eval.model_copy(update={
        "gate": base.eval.gate.model_copy(update={"max_perplexity": 1.0001})})})
    second = retrain(config=strict)
    assert second.gate_passed is False and second.model_version is None
    assert str(client.get_model_version_by_alias("nightly", "champion").version) == "1"  # untouched
    run = client.get_run(second.mlflow_run_id)
    assert run.data.tags["memfit.gate"] == "failed"
    assert "champion/v1" in run.data.params["model.name_or_path"]  # fine-tuned from the champion
    assert run.data.params["data.path"].endswith("2026-11-02.txt")  # the newest file
    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["retrain-gate"])))
    assert any("gate failed" in (a.data or "") for a in arts)


def test_retrain_without_data_is_a_clear_error(tmp_path):
    from memfit import config
    from memfit.errors import ConfigError, DataError
    from memfit.release.retraining import gather

    cfg = config.load(None, [f"run.work_dir={tmp_path}", "tracking.backend=null"])
    with pytest.raises(ConfigError, match="deploy.retrain_data_uri"):
        gather(cfg, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        gather(cfg, str(tmp_path / "empty"))
