"""Helpers for the serving tests and bench/serve_bench.py: a tiny registered champion, more versions of it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def train_champion(root: Path, steps: int = 8, onnx: bool = True, **extra: Any) -> tuple[Any, Any]:
    """Train configs/tiny.yaml for `steps` steps through the phases (no Prefect), export, gate, register v1 as
    champion in a SQLite MLflow store under root; (config, export report)."""
    from tests_support import tiny_overrides

    from memfit import config, phases

    overrides = {"train.max_steps": steps, "checkpoint.every_steps": steps, "train.warmup_steps": 2,
                 "data.synthetic_docs": 300, "export.onnx": onnx, "run.name": "tiny",
                 "tracking.system_metrics": False, "serve.cache_dir": str(root / "serve-cache"), **extra}
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, **overrides))
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    trained = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    return cfg, phases.evaluate_and_release(cfg, trained)


def register_version(cfg: Any, export_hf: Path, alias: bool = True) -> str:
    """Log `export_hf` (a folder named hf, as exports are) as the model of a new MLflow run, register it as the
    next version, and (by default) move the alias to it, as a retrain that passes the gate does; the version."""
    from mlflow import MlflowClient

    from memfit.release.registry import log_model, promote, register

    uri = cfg.tracking.resolved_uri()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.create_run(exp.experiment_id, run_name="serve-test-version")
    model_uri, model_id = log_model(client, uri, run.info.run_id, export_hf)
    client.set_terminated(run.info.run_id)
    name = cfg.registry.model_name or cfg.run.name
    version = register(client, name, model_uri, run.info.run_id, model_id)
    if alias:
        promote(client, name, version, cfg.registry.alias)
    return version


def altered_export(src_hf: Path, dest: Path, scale: float) -> Path:
    """A verified SafeTensors export of src_hf's model with every weight scaled: other text, same shapes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.release.formats import export_safetensors

    dest.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src_hf, local_files_only=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    export_safetensors(model, AutoTokenizer.from_pretrained(src_hf, local_files_only=True), dest)
    return dest


def corrupted_export(src_hf: Path, dest: Path) -> Path:
    """A copy of src_hf whose weights no longer match the sha256 of its export record."""
    shutil.copytree(src_hf, dest)
    weights = next(dest.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return dest
