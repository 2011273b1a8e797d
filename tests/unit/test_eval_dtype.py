"""eval.dtype: phase 5 leaves fp32 only where fp32 would not fit, and its 16-bit copy leaves the fp32 model whole."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit import config
from memfit.evaluation.dtype import device_twin
from memfit.memory.estimator.evaluation import evaluation_memory, plan_evaluation, resolve_eval_dtype

pytestmark = pytest.mark.unit
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)


def test_auto_keeps_fp32_on_cpu_without_a_limit_or_when_it_fits():
    assert resolve_eval_dtype("auto", "cpu", True, 10, 10**12) == "fp32"  # CPU: host memory, no limit applies
    assert resolve_eval_dtype("auto", "cuda", True, None, 10**12) == "fp32"
    assert resolve_eval_dtype("auto", "cuda", True, 80 * 10**9, 40 * 10**9) == "fp32"


def test_auto_takes_bf16_where_fp32_does_not_fit_and_fp16_without_bf16():
    assert resolve_eval_dtype("auto", "cuda", True, 24 * 10**9, 40 * 10**9) == "bf16"
    assert resolve_eval_dtype("auto", "cuda", False, 24 * 10**9, 40 * 10**9) == "fp16"
    assert resolve_eval_dtype("fp32", "cuda", True, 24 * 10**9, 40 * 10**9) == "fp32"  # asked for: kept


def test_the_8b_plan_on_24_gb_evaluates_in_bf16_and_says_fp32_would_not_fit():
    cfg = config.load(None, ["data.seq_len=1024", "train.batch_size=1"])
    n = 8_030_261_248
    out = plan_evaluation(LLAMA3_8B, n, cfg, 23_450_000_000, "rtx-4090", "cuda", True)
    fp32 = evaluation_memory(LLAMA3_8B, n, cfg)
    assert out["dtype"] == "bf16" and out["weights"] == 2 * n and out["fits"]  # 16.06 GB of weights
    assert out["line"].startswith("evaluation (phase 5, bf16 on rtx-4090):")
    assert f"(eval.dtype auto: fp32 would need {fp32.peak / 1e9:.4g} GB)" in out["line"]
    pinned = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"dtype": "fp32"})})
    assert not plan_evaluation(LLAMA3_8B, n, pinned, 23_450_000_000, "rtx-4090", "cuda", True)["fits"]


def test_device_twin_casts_a_copy_and_leaves_the_fp32_model_alone():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = device_twin(model, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters())
    assert twin.lm_head.weight is twin.model.embed_tokens.weight  # tied weights stay tied
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        want, got = model(ids).logits, twin(ids).logits.float()
    assert (want - got).abs().max() < 0.05 * want.abs().max()  # bf16's rounding, nothing else


def test_phase5_on_a_full_cuda_device_takes_bf16_and_says_why(monkeypatch, caplog):
    from memfit.evaluation.dtype import phase5_dtype

    # The device's free memory as CUDA would report it (no GPU here): far below the tiny model's fp32 peak.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 24 * 10**9))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    cfg = config.load(None, [])
    with caplog.at_level("WARNING", logger="memfit.evaluation"):
        assert phase5_dtype(cfg, torch.device("cuda", 0), model) == "bf16"
    assert "phase 5 evaluates in bf16 on cuda:0: in fp32 it would need" in caplog.text
    assert phase5_dtype(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"dtype": "fp32"})}),
                        torch.device("cuda", 0), model) == "fp32"
