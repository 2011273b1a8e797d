"""What llama.cpp's converter cannot read from a tokenizer trained here: its pre-tokenizer's name, merge scores."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")
# Pre-tokenizer regexes llama.cpp knows by name (llama-vocab.cpp), matched on tokenizer.json: convert_hf_to_gguf.py
# hashes a sample's tokens against the hub tokenizers it lists, and a tokenizer trained here is in no list. The
# export's verification then compares llama.cpp's token ids with the tokenizer's on the prompts.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
PRE_BY_REGEX = {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}


def tokenizer_doc(hf_dir: str | Path) -> dict[str, Any] | None:
    """tokenizer.json of a folder (a fast tokenizer), or None when it has none."""
    path = Path(hf_dir) / "tokenizer.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def pre_tokenizer(doc: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for tokenizer.json's pre-tokenizer (GPT-2's byte-level split, Llama 3's, Qwen2's), or None
    when it is none of these (then the converter's own hash table must know the tokenizer)."""
    pre = (doc or {}).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # GPT-2's own split, the ByteLevel default
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    for part in parts:
        regex = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
        if regex in PRE_BY_REGEX:
            return PRE_BY_REGEX[regex]
    return None


def byte_fallback(doc: dict[str, Any] | None) -> bool:
    """A SentencePiece-style BPE (Llama 2's, Mistral's tokenizer.json): ▁-joined text, bytes for unknown pieces."""
    model = (doc or {}).get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def merge_scores(doc: dict[str, Any], tokens: list[bytes | str], scores: list[float]) -> list[float]:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose result scores highest; a tokenizer.json
    has no scores (gguf's LlamaHfVocab gives every token -1000), so the merge order would be lost. A token made by
    merge number r scores -r: the tokenizer's own merge order."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(doc["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, r)
    texts = [(t.decode("utf-8", "replace") if isinstance(t, bytes) else t).replace(" ", "\u2581") for t in tokens]
    return [-float(rank[t]) if t in rank else s for t, s in zip(texts, scores, strict=True)]


def chat_template_for_gguf(template: Any) -> Any:
    """The tokenizer's template without transformers' {% generation %} tags (llama.cpp's Jinja does not know them;
    they mark trained tokens and change nothing in the rendering)."""
    return _GENERATION_TAG.sub("", template) if isinstance(template, str) else template
