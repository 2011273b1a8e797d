"""GGUF for llama.cpp and Ollama: checks before training, tokenizer.json help for the converter, quantizing."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError, ExportError

log = logging.getLogger("memfit.release")

QUANTS = ("f16", "q8_0", "q4_k_m")
# Packages the export imports: llama-cpp-python quantizes and verifies; the converter (llama.cpp's, its own gguf-py)
# reads SentencePiece tokenizers with sentencepiece.
PACKAGES = (("llama_cpp", "llama-cpp-python"), ("sentencepiece", "sentencepiece"))


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def unsupported(cfg: dict[str, Any]) -> str | None:
    """Why llama.cpp would not compute this model as transformers does, though its converter writes it (one line),
    or None. Each is a config no released model of the family has, measured with the family matrix
    (tests/integration/test_gguf_families.py)."""
    model_type = cfg.get("model_type")
    scalar = cfg.get("query_pre_attn_scalar")
    if model_type in ("gemma2", "gemma3_text") and scalar is not None and int(scalar) != _head_dim(cfg):
        # llama.cpp scales Gemma 2/3 queries by 1/sqrt(head_dim) (27B: by its hidden size / heads), not by this key.
        return (f"this {model_type} scales queries by query_pre_attn_scalar {scalar}, llama.cpp by head_dim "
                f"{_head_dim(cfg)} (as the released models do)")
    if model_type == "qwen3_moe" and cfg.get("norm_topk_prob") is False:
        # llama.cpp's Qwen3-MoE graph always renormalizes the chosen experts' weights (build_moe_ffn norm_w=true).
        return ("this qwen3_moe has norm_topk_prob false; llama.cpp always renormalizes the chosen experts' weights "
                "(as the released models do: norm_topk_prob true)")
    return None


def check_gguf_export(cfg: dict[str, Any] | None, quants: list[str], converter: str | Path | None = None) -> None:
    """Fail in one line before any work: the converter missing, an architecture it does not know (config.json's
    `architectures`; None: the config is not known yet), a config llama.cpp would compute otherwise, a quant or a
    package that is missing."""
    unknown = [q for q in quants if q not in QUANTS]
    if unknown:
        raise ConfigError(f"export.gguf_quants: {', '.join(unknown)} not available (choose from {', '.join(QUANTS)})")
    missing = [pkg for mod, pkg in PACKAGES if importlib.util.find_spec(mod) is None]
    if missing:
        raise ConfigError(f"export.formats has gguf, which needs {' and '.join(missing)}: pip install "
                          "'memfit[gguf]' (llama-cpp-python builds llama.cpp from source: minutes, docs/export.md)")
    from memfit.release.gguf_converter import architectures, find

    conv = find(converter)
    if cfg is None:
        return
    archs = cfg.get("architectures") or []
    known = architectures(conv)
    if not archs:
        raise ConfigError(f"export.formats has gguf, but the model's config.json names no architectures (model_type "
                          f"{cfg.get('model_type')!r}); llama.cpp's converter picks the family by it")
    if not any(a in known for a in archs):
        raise ConfigError(f"export.formats has gguf, but llama.cpp's converter (llama.cpp {conv.llama_cpp_commit[:12]}"
                          f", {conv.dir}) does not know the architecture {archs[0]}; export SafeTensors only")
    if (why := unsupported(cfg)) is not None:
        raise ConfigError(f"export.formats has gguf, but {why}")


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


def quantize(f16: Path, out: Path, quant: str) -> None:
    """llama.cpp's own quantizer (llama_model_quantize, what llama-quantize runs) from the f16 file."""
    import ctypes

    import llama_cpp

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[quant]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 0
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        raise ExportError(f"gguf: llama.cpp's quantizer failed for {quant} (code {rc}) on {f16}")
