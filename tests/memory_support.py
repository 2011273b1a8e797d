"""Helpers the memory tests share: tiny GPT-2 and Llama models built in memory (no files, no tokenizer)."""

from __future__ import annotations

import torch

from memfit.config import MemoryConfig

SAVE_OPS = tuple(MemoryConfig().selective_save_ops)
VOCAB = 128


def tiny(arch: str, layers: int = 4):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model
