"""lora.target_modules presets on dense and mixture-of-experts models: what gets adapters, and the router never."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfit.errors import ConfigError
from memfit.models.lora import apply_lora

pytestmark = pytest.mark.unit
COMMON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128}
FAMILIES = {
    "llama": {"num_key_value_heads": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16,
                  "num_key_value_heads": 2},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4, "kv_lora_rank": 32,
                    "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "n_group": 1, "topk_group": 1},
}


def adapted(family: str, target) -> set[str]:
    """Layer-relative names of what got adapters (layer 1: the MoE layer of DeepSeek's dense-then-MoE stack)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **FAMILIES[family]))
    wrapped = apply_lora(model, SimpleNamespace(target_modules=target, r=4, alpha=8.0, dropout=0.0))
    names = {n.split(".layers.1.")[1] for n, p in wrapped.named_parameters() if p.requires_grad and ".layers.1." in n}
    return {n.split(".lora_")[0].removesuffix(".base_layer") for n in names}


ATTN = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
DS_ATTN = {"self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"}
SHARED = {"mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}


@pytest.mark.parametrize("family, target, want", [
    ("llama", "all-linear", ATTN | {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
    ("llama", "attention", ATTN),
    ("qwen3_moe", "all-linear", ATTN | {"mlp.experts"}),
    ("qwen3_moe", "attention", ATTN),
    ("qwen3_moe", "attention-experts", ATTN | {"mlp.experts"}),
    ("deepseek_v3", "all-linear", DS_ATTN | SHARED | {"mlp.experts"}),
    ("deepseek_v3", "attention-mlp", DS_ATTN | SHARED),
    ("deepseek_v3", "attention-experts", DS_ATTN | {"mlp.experts"}),
    ("qwen3_moe", ["q_proj", "v_proj"], {"self_attn.q_proj", "self_attn.v_proj"}),
])
def test_presets_adapt_what_they_name_and_never_the_router(family, target, want):
    got = adapted(family, target)
    assert got == want
    assert not any(n.startswith("mlp.gate") and "proj" not in n for n in got)  # the router (mlp.gate)


def test_attention_experts_on_a_dense_model_is_one_line():
    with pytest.raises(ConfigError, match="attention-experts, but LlamaForCausalLM has no fused expert weights"):
        adapted("llama", "attention-experts")
