"""The experts policy (which implementation runs where) and the routing metrics a run logs for MoE models."""

from __future__ import annotations

import pytest
import torch

from memfit.memory.techniques.loss import PlainLoss
from memfit.models import experts

pytestmark = pytest.mark.unit


def _tiny(family: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, intermediate_size=32, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_policy_trains_with_grouped_mm_on_cpu_and_exports_through_batched_mm():
    model = _tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16)
    assert experts.is_moe(model) and not experts.is_moe(_tiny("llama"))
    assert experts.apply(model, "train", "cpu") == "grouped_mm" and model.config.output_router_logits
    with experts.for_export(model):
        assert model.config._experts_implementation == "batched_mm"
    assert model.config._experts_implementation == "grouped_mm"
    assert experts.apply(_tiny("llama"), "train", "cpu") is None


def test_plain_loss_keeps_the_router_aux_loss_apart_and_utilisation_shares_sum_to_balance():
    model = _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2)
    experts.apply(model, "train", "cpu")
    loss_fn, ids = PlainLoss(), torch.randint(0, 64, (2, 12))
    loss = loss_fn(model, {"input_ids": ids, "labels": ids})
    aux, logits = loss_fn.last_routing
    lm_only = model(input_ids=ids, labels=ids, output_router_logits=False).loss
    # The loss trained is the LM loss plus the model's coefficient times the aux loss.
    assert torch.allclose(loss, lm_only + model.config.router_aux_loss_coef * aux, atol=1e-5)
    stats = experts.routing_stats(logits, top_k=2)
    assert 0 <= stats["experts_min_share"] <= 0.25 <= stats["experts_max_share"] <= 1
    dense = PlainLoss()
    dense(_tiny("llama"), {"input_ids": ids, "labels": ids})
    assert dense.last_routing is None and experts.routing_stats(None, 2) == {}
