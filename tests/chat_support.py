"""Chat-data test helpers: small tokenizers with a template's special tokens, and conversation files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.data.synthetic import synthetic_conversations, synthetic_prompt_completions, write_jsonl, write_parquet

# The special tokens each built-in template writes (the tokenizer knows them as single tokens, as real ones do).
TEMPLATE_SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "llama-3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "memfit-preset": [],
}


def bpe_tokenizer(texts: list[str], specials: list[str] | None = None, vocab_size: int = 400) -> Any:
    """A byte-level BPE trained here on `texts`; eos <|endoftext|>, `specials` added as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = "<|begin_of_text|>" if "<|begin_of_text|>" in (specials or []) else "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    if specials:
        fast.add_special_tokens({"additional_special_tokens": specials})
    fast.bos_token = bos
    return fast


def conversation_texts(n: int = 200, seed: int = 0) -> list[str]:
    return [t["content"] for conv in synthetic_conversations(n, seed) for t in conv]


def messages_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    return write_jsonl([{"messages": m} for m in synthetic_conversations(n, seed)], path)


def prompt_completion_parquet(path: Path, n: int, seed: int = 0) -> Path:
    return write_parquet(synthetic_prompt_completions(n, seed), path)
