"""The family matrix: dense and mixture-of-experts models users bring, each estimated, trained briefly, exported to
SafeTensors (transformers loads it) and ONNX (parity checked), through the same phases `memfit run` runs.
One dense and one MoE family run always; the rest under -m slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_support import FAMILIES, MOE, family_folder
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.memory.estimator.compose import Stack

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ALWAYS = {"llama", "qwen3_moe"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in ALWAYS else pytest.mark.slow) for f in FAMILIES])
def test_family_estimates_trains_exports_and_passes_parity(tmp_path_factory, tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.config.devices import PROFILES
    from memfit.memory.estimator.estimate import Estimator

    folder = family_folder(tmp_path_factory.getbasetemp() / "families", family)
    hf_config = AutoConfig.from_pretrained(folder)
    est = Estimator(hf_config, 64, PROFILES["cpu"]).estimate(Stack("fp32", 2, 1, False), ["none"] * 2)
    assert est.peak_bytes > est.breakdown["params"] > 0

    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, None, **{
        "model.name_or_path": str(folder), "train.max_steps": 10, "checkpoint.every_steps": 10, "train.lr": 3e-3,
        "train.num_threads": 1, "train.eval_batches": 2, "memory.policy": "none", "train.log_every_steps": 2,
        "export.onnx": True, "registry.enabled": False, "data.seq_len": 64, "tracking.system_metrics": False}))
    probe = phases.check_environment_and_probe(cfg)
    result = phases.train(cfg, phases.plan_stack(cfg, probe), phases.recover_training_checkpoint(cfg), probe)
    assert result.final_train_loss < result.initial_val_loss, family
    exported = phases.evaluate_and_release(cfg, result)
    assert exported.onnx_error is None and exported.onnx_max_abs_diff is not None  # parity passed at export
    reloaded = AutoModelForCausalLM.from_pretrained(exported.safetensors_dir).eval()
    assert type(reloaded).__name__ == AutoModelForCausalLM.from_config(hf_config).__class__.__name__
    with torch.no_grad():
        logits = reloaded(input_ids=torch.randint(0, 400, (1, 12))).logits
    assert torch.isfinite(logits).all()

    # In MLflow: the router's load-balancing loss apart from the loss, and expert utilisation (MoE families whose
    # router returns logits; DeepSeek-V3 balances with a bias and reports neither).
    from mlflow import MlflowClient

    metrics = MlflowClient(cfg.tracking.resolved_uri()).get_run(result.mlflow_run_id).data.metrics
    routed = family in MOE and family != "deepseek_v3"
    assert ("router_aux_loss" in metrics) == routed and ("experts_max_share" in metrics) == routed
    if routed:
        assert metrics["router_aux_loss"] > 0 and 0 <= metrics["experts_min_share"] <= 0.25 <= metrics[
            "experts_max_share"] <= 1  # 4 experts: balanced is 1/4
