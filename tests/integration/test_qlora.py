"""QLoRA on CPU: a 4-bit NF4 base (bitsandbytes) trains, resumes bitwise and exports a plain verified model."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit import phases
from memfit.errors import Preempted
from memfit.tracking.null import NullTracker

pytest.importorskip("bitsandbytes")
pytestmark = [pytest.mark.integration, pytest.mark.slow]
QLORA = {"lora.enabled": "true", "lora.quantize": "nf4", "lora.r": 8, "train.precision": "bf16-mixed",
         "memory.policy": "full", "tracking.backend": "null", "train.eval_batches": 2}


def _train(cfg):
    report = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, report)
    return plan, phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), report)


def _newest(root: Path) -> dict[str, torch.Tensor]:
    newest = sorted(p for p in root.iterdir() if p.name.startswith("step-"))[-1]
    return load_file(str(newest / "model.safetensors"))


def test_qlora_trains_and_exports_a_plain_model_that_passes_parity(tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(**QLORA, **{"train.max_steps": 12, "train.lr": 3e-3, "export.onnx": True, "export.adapter": True,
                                  "export.uri": str(tmp_path / "exports")})
    plan, result = _train(cfg)
    assert plan.lora is True and plan.quantize == "nf4"
    # The training checkpoint holds the adapters only: the 4-bit base is rebuilt from the model source.
    saved = _newest(tmp_path / "checkpoints")
    assert saved and all(".lora_" in k for k in saved) and all(v.dtype == torch.float32 for v in saved.values())
    exported = phases.evaluate_and_release(cfg, result)
    assert exported.final_val_loss < result.initial_val_loss - 0.1
    assert exported.onnx_path and exported.onnx_max_abs_diff is not None
    model = AutoModelForCausalLM.from_pretrained(exported.safetensors_dir)
    keys = model.state_dict().keys()
    assert not any("lora" in k or "absmax" in k or "quant" in k for k in keys)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The adapter alone states its 4-bit base; on that base (NF4 round trip) it equals the merged export.
    assert exported.adapter["base_quantization"] == "nf4" and exported.adapter["top1_agree"] == 1.0
    assert exported.adapter["max_abs_diff"] < 1e-3
    doc = json.loads((Path(exported.adapter["dir"]) / "memfit-adapter.json").read_text())
    assert doc["base_quantization"] == "nf4"
    # ... and so does the export.uri upload that carries it, for whoever fetches the adapter alone.
    from memfit.release.uploads import download_export, read_manifest

    uploaded = read_manifest(exported.export_uri)
    assert uploaded["formats"]["adapter"]["base_quantization"] == "nf4"
    assert uploaded["formats"]["adapter"]["base"] == "4-bit NF4 base (bitsandbytes)"
    fetched = download_export(exported.export_uri, tmp_path / "fetched", formats=["adapter"])
    assert json.loads((fetched / "adapter" / "memfit-adapter.json").read_text()) == doc


def test_qlora_resume_from_a_training_checkpoint_is_bitwise(tiny_config, tmp_path, monkeypatch):
    common = {**QLORA, "train.max_steps": 6, "checkpoint.every_steps": 2}
    _train(tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "straight")}))
    cfg = tiny_config(**common, **{"checkpoint.uri": str(tmp_path / "interrupted")})
    original = NullTracker.log_metrics

    def preempt_at_3(self, metrics, step):
        original(self, metrics, step)
        if step == 3 and "loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(NullTracker, "log_metrics", preempt_at_3)
    with pytest.raises(Preempted, match="step 3"):
        _train(cfg)
    monkeypatch.setattr(NullTracker, "log_metrics", original)
    _, result = _train(cfg)
    assert result.resumed_from == 3 and result.steps == 6
    a, b = _newest(tmp_path / "straight"), _newest(tmp_path / "interrupted")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
