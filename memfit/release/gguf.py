"""GGUF for llama.cpp, Ollama and LM Studio: what is checked before training, and llama.cpp's own quantizer."""

from __future__ import annotations

import importlib.util
import logging
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
