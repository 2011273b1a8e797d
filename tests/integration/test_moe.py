"""Mixture-of-experts families end to end on CPU: train in fp32 and bf16-mixed, routing metrics, exports, estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chat_support import bpe_tokenizer, conversation_texts
from family_support import MOE, family_folder
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.reports import PlanReport

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
FAMILIES = MOE
ALWAYS = "qwen3_moe"  # one MoE family on every run; the rest under -m slow


def _params() -> list:
    return [pytest.param(family, marks=() if family == ALWAYS else pytest.mark.slow) for family in FAMILIES]


@pytest.mark.parametrize("family", _params())
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_moe_family_trains_and_exports(tmp_path_factory, tmp_path, family, precision):
    from transformers import AutoModelForCausalLM

    folder = family_folder(tmp_path_factory.getbasetemp() / "moe-families", family)
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, None, **{
        "model.name_or_path": str(folder), "train.max_steps": 12, "checkpoint.every_steps": 12,
        "train.log_every_steps": 4, "tracking.backend": "null", "train.precision": precision,
        "train.num_threads": 1, "train.eval_batches": 2}))
    plan = PlanReport(policy="none", every_k=2, precision=precision, micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="none")
    result = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)
    assert result.steps == 12
    assert result.final_train_loss < result.initial_val_loss - 0.3, (result.initial_val_loss, result.final_train_loss)

    # Exports of the family: a SafeTensors folder transformers loads, an ONNX file within parity.
    from memfit.release import formats

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = bpe_tokenizer(conversation_texts(), vocab_size=400)
    st = formats.export_safetensors(model, tok, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(st.dir)
    ids = torch.randint(0, 400, (2, 9))
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    onnx = formats.export_onnx(model, tmp_path / "model.onnx")
    assert onnx.max_abs_diff < 1e-4
    # The caller's model keeps the implementation it trains with.
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("target", ["attention-experts", "attention"])
def test_lora_presets_train_an_moe_and_leave_the_router_alone(tmp_path_factory, tmp_path, target):
    """LoRA on a tiny Qwen3-MoE through `memfit run`'s phases: the loss falls, the merged export differs from the
    base where the preset adapted it (the experts or not), and the router's weights are the base's, bit for bit."""
    from safetensors.torch import load_file

    folder = family_folder(tmp_path_factory.getbasetemp() / "moe-families", ALWAYS)
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, None, **{
        "model.name_or_path": str(folder), "train.max_steps": 16, "checkpoint.every_steps": 16, "train.lr": 1e-2,
        "tracking.backend": "null", "train.num_threads": 1, "train.eval_batches": 2, "lora.enabled": "true",
        "lora.r": 8, "lora.target_modules": target, "memory.policy": "none", "registry.enabled": False}))
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    result = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    assert plan.lora is True and result.final_train_loss < result.initial_val_loss - 0.2
    exported = phases.evaluate_and_release(cfg, result)
    merged = load_file(str(Path(exported.safetensors_dir) / "model.safetensors"))
    base = load_file(str(folder / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert any(".self_attn." in k for k in changed)
    assert any(".experts." in k for k in changed) == (target == "attention-experts")
    assert not any(k.endswith("mlp.gate.weight") for k in changed)  # the router
