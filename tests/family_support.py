"""Tiny models of the families users bring, built from transformers' own config classes with a tokenizer trained
here: a from_pretrained folder each, for the MoE and the family-matrix tests."""

from __future__ import annotations

from pathlib import Path

import torch
from chat_support import bpe_tokenizer, conversation_texts

COMMON = {"vocab_size": 400, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}
DENSE = {
    "llama": {},
    "qwen3": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
}
MOE = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4, "kv_lora_rank": 32,
                    "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "n_group": 1, "topk_group": 1},
}
FAMILIES = {**DENSE, **MOE}
# The GGUF family matrix (tests/integration/test_gguf_families.py): name → (model_type, config beyond COMMON).
# Gemma's query_pre_attn_scalar and Qwen3-MoE's norm_topk_prob as the released models set them (llama.cpp assumes
# them; memfit.release.gguf.unsupported refuses other values before training).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 5e5}
GGUF_FAMILIES = {
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {}),  # grouped-query attention: 2 kv heads for 4 query heads
    "granite": ("granite", {}), "olmo2": ("olmo2", {}), "starcoder2": ("starcoder2", {}), "smollm3": ("smollm3", {}),
    "gpt2": ("gpt2", {}),
    "qwen3_moe": ("qwen3_moe", {**MOE["qwen3_moe"], "norm_topk_prob": True}), "mixtral": ("mixtral", MOE["mixtral"]),
}


def family_folder(root: Path, family: str, **config: object) -> Path:
    """A random-weight from_pretrained folder of `family` (seeded) with a BPE tokenizer trained here; `config`
    sets the family's config fields beyond the tiny defaults (a family not in FAMILIES needs its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / family
    if not (out / "config.json").exists():
        tok = bpe_tokenizer(conversation_texts(), vocab_size=400)
        cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES.get(family, {}), **config},
                                   bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        tok.save_pretrained(out)
    return out
