"""configs/tiny-ddp.yaml through the Prefect flow: 2 CPU ranks, one MLflow run, a verified export."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


class Said(logging.Handler):
    """(logger, message) of every record memfit's loggers emit during the flow."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.getMessage()))


def test_tiny_ddp_flow_one_mlflow_run_and_verified_export(prefect_harness, tmp_path):
    from mlflow import MlflowClient
    from safetensors.torch import load_file
    from tests_support import tiny_overrides
    from transformers import AutoModelForCausalLM

    from flows.finetune import finetune
    from memfit import config
    from memfit.checkpoints import CheckpointManager
    from memfit.checkpoints.reader import consolidate
    from memfit.storage import open_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config.load(REPO / "configs" / "tiny-ddp.yaml", tiny_overrides(tmp_path, uri, **{
        "train.max_steps": 12, "checkpoint.every_steps": 6, "data.synthetic_docs": 600,
        "export.onnx": False}))
    assert cfg.distributed.nproc_per_node == 2 and cfg.distributed.strategy == "ddp"
    said = Said()
    memfit_log = logging.getLogger("memfit")
    level = memfit_log.level
    memfit_log.setLevel(logging.INFO)
    memfit_log.addHandler(said)
    try:
        s = finetune(config=cfg)
    finally:
        memfit_log.removeHandler(said)
        memfit_log.setLevel(level)
    assert s.status == "completed" and s.steps == 12
    # The rows are prepared once, before the ranks start (the launcher's own line); each rank finds them cached
    # (the ranks' lines come through the launcher's memfit.distributed logger).
    here = [m for name, m in said.records if name == "memfit.data"]
    ranks = [m for name, m in said.records if name == "memfit.distributed"]
    assert len([m for m in here if m.startswith("data: prepared in")]) == 1, here
    assert len([m for m in ranks if "data: prepared rows reused" in m]) == 2, ranks
    assert not [m for m in ranks if "data: prepared in" in m], ranks
    assert s.plan.strategy == "ddp" and s.plan.world_size == 2 and s.plan.sharding["world_size"] == 2
    assert s.final_val_loss < s.initial_val_loss

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 1  # rank 0 alone tracks; the flow's phases share its run
    run = runs[0]
    assert run.info.run_id == s.mlflow_run_id and run.info.status == "FINISHED"
    assert run.data.tags["memfit.world_size"] == "2" and run.data.params["plan.strategy"] == "ddp"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 12
    assert "val_perplexity" in run.data.metrics

    infos = CheckpointManager(open_store(cfg.checkpoint.uri)).list()
    assert [i.step for i in infos] == [6, 12]
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000012" / "manifest.json").read_text())
    assert manifest["format"] == "memfit-sharded-training-checkpoint/1"
    # The export holds exactly the weights the 2 ranks trained (consolidated from the final shards).
    trained = consolidate(tmp_path / "checkpoints" / "step-00000012", {"model"})["model"]
    exported = load_file(str(Path(s.safetensors_dir) / "model.safetensors"))
    assert exported and set(exported) <= set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in exported)
    AutoModelForCausalLM.from_pretrained(s.safetensors_dir)  # and it is a loadable HF folder
