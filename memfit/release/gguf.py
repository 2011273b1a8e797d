"""GGUF for llama.cpp, Ollama and LM Studio from the merged SafeTensors folder: f16 written with the gguf package."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError, ExportError

log = logging.getLogger("memfit.release")

QUANTS = ("f16", "q8_0", "q4_k_m")
# HF model_type → (llama.cpp architecture, whether q/k rows are permuted). llama.cpp's LLAMA graph rotates
# interleaved pairs where HF rotates halves, so its converter (convert_hf_to_gguf.py, LlamaModel.permute) reorders
# the q/k rows; Qwen2/3, Phi-3 and Gemma use llama.cpp's NeoX rope, which is HF's layout.
FAMILIES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False),
            "qwen3": ("QWEN3", False), "phi3": ("PHI3", False), "gemma": ("GEMMA", False),
            "gemma2": ("GEMMA2", False), "gemma3_text": ("GEMMA3", False), "gpt2": ("GPT2", False)}
# GPT-2's Conv1D layers store [in, out]; llama.cpp (like nn.Linear) wants [out, in]: its converter transposes them.
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Gemma's RMSNorm scales by (1 + weight); llama.cpp's by weight: its converter adds 1 to every norm weight.
NORM_OFFSET = ("GEMMA", "GEMMA2", "GEMMA3")
_MOE = ("a mixture-of-experts model: llama.cpp's expert tensors (stacked per layer) are not mapped by memfit yet; "
        "export SafeTensors and use llama.cpp's convert_hf_to_gguf.py")
UNSUPPORTED = {family: _MOE for family in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3")}
_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def gguf_support(model_type: str) -> str | None:
    """Why a family cannot be written as GGUF (one line), or None when it can."""
    if model_type in FAMILIES:
        return None
    return UNSUPPORTED.get(model_type, f"model type {model_type!r} has no GGUF mapping in memfit (supported: "
                           f"{', '.join(sorted(FAMILIES))}); export SafeTensors and use llama.cpp's "
                           "convert_hf_to_gguf.py")


def check_gguf_export(model_type: str | None, quants: list[str]) -> None:
    """Fail in one line before any work: a family without a mapping, a quant or a package that is missing."""
    if model_type is not None and (why := gguf_support(model_type)) is not None:
        raise ConfigError(f"export.formats has gguf, but {why}")
    unknown = [q for q in quants if q not in QUANTS]
    if unknown:
        raise ConfigError(f"export.gguf_quants: {', '.join(unknown)} not available (choose from {', '.join(QUANTS)})")
    missing = [pkg for mod, pkg in (("gguf", "gguf"), ("llama_cpp", "llama-cpp-python"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise ConfigError(f"export.formats has gguf, which needs {' and '.join(missing)}: pip install "
                          "'memfit[gguf]' (llama-cpp-python builds llama.cpp from source: minutes, docs/export.md)")


def chat_template_for_gguf(template: str | None) -> str | None:
    """The tokenizer's template without transformers' {% generation %} tags (llama.cpp's Jinja does not know them;
    they mark trained tokens and change nothing in the rendering)."""
    return _GENERATION_TAG.sub("", template) if template else template


@dataclass(frozen=True)
class Hparams:
    model_type: str
    arch: str
    permute: bool
    layers: int
    heads: int
    kv_heads: int

    @staticmethod
    def read(hf_dir: Path) -> tuple[Hparams, dict[str, Any]]:
        cfg = json.loads((hf_dir / "config.json").read_text())
        model_type = cfg.get("model_type", "")
        if (why := gguf_support(model_type)) is not None:
            raise ConfigError(f"gguf: {why}")
        arch, permute = FAMILIES[model_type]
        heads = int(cfg.get("num_attention_heads") or cfg["n_head"])  # GPT-2's config.json keeps its own names
        return Hparams(model_type, arch, permute, int(cfg.get("num_hidden_layers") or cfg["n_layer"]), heads,
                       int(cfg.get("num_key_value_heads") or heads)), cfg


def _permute(w: Any, heads: int) -> Any:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rope rows → llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gpt2_hparams(writer: Any, hp: Hparams, cfg: dict[str, Any]) -> None:
    """GPT-2: learned positions (no rope), LayerNorm with bias, a 4 x n_embd MLP unless n_inner says otherwise."""
    import gguf

    hidden = int(cfg["n_embd"])
    writer.add_block_count(hp.layers)
    writer.add_context_length(int(cfg["n_positions"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(cfg.get("n_inner") or 4 * hidden))
    writer.add_head_count(hp.heads)
    writer.add_layer_norm_eps(float(cfg["layer_norm_epsilon"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _write_hparams(writer: Any, hp: Hparams, cfg: dict[str, Any]) -> None:
    import gguf

    if hp.arch == "GPT2":
        return _gpt2_hparams(writer, hp, cfg)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // hp.heads)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if hp.arch == "GEMMA3":  # one rope per layer type: the full layers' here, the sliding ones' in _gemma_hparams
        rope = rope.get("full_attention", rope)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise ConfigError(f"gguf: rope_type {rope_type!r} of this {hp.model_type} model is not written by memfit yet "
                          "(default and linear are)")
    writer.add_block_count(hp.layers)
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(hp.heads)
    writer.add_head_count_kv(hp.kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if hp.arch in ("GEMMA2", "GEMMA3"):
        _gemma_hparams(writer, cfg, head_dim)
    if cfg.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rotary = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    writer.add_rope_dimension_count(int(rotary * hidden) // hp.heads if hp.arch == "PHI3" else head_dim)
    if hp.arch == "LLAMA":
        writer.add_vocab_size(int(cfg["vocab_size"]))
    if hp.arch == "PHI3":
        writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                                 or cfg.get("original_max_position_embeddings")
                                                 or cfg["max_position_embeddings"]))
        writer.add_sliding_window(int(cfg.get("sliding_window") or 0))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _gemma_hparams(writer: Any, cfg: dict[str, Any], head_dim: int) -> None:
    """Gemma 2 and 3: soft-capping, the sliding window and which layers use it (transformers' layer_types), and
    Gemma 3's rope base of the sliding layers. llama.cpp scales queries by 1/sqrt(head_dim) (27B by its hidden
    size / heads); a model scaled otherwise is refused rather than exported wrong."""
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is not None and int(scalar) != head_dim:
        raise ConfigError(f"gguf: this {cfg['model_type']} scales queries by query_pre_attn_scalar {scalar}, "
                          f"llama.cpp by head_dim {head_dim}; not written by memfit (it would not be the trained "
                          "model)")
    if cfg.get("attn_logit_softcapping") is not None:
        writer.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    writer.add_sliding_window(int(cfg.get("sliding_window") or cfg["max_position_embeddings"]))
    if cfg.get("layer_types"):
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:
        if (local.get("rope_type") or "default") != "default":
            raise ConfigError(f"gguf: the sliding layers' rope_type {local.get('rope_type')!r} is not written by "
                              "memfit (default is)")
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))


def _write_vocab(writer: Any, hf_dir: Path, vocab_size: int, tokenizer: Any) -> None:
    """The tokenizer as llama.cpp's converter writes it: byte-level BPE ("gpt2" with its pre-tokenizer and merges)
    or SentencePiece-style BPE with byte fallback ("llama", through gguf.LlamaHfVocab); special ids, add_bos and
    the chat template through gguf.SpecialVocab."""
    import gguf

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"gguf: {hf_dir} has no tokenizer.json (a fast tokenizer); llama.cpp needs its vocabulary")
    doc = json.loads(path.read_text())
    byte_fallback = doc["model"].get("type") == "BPE" and doc["model"].get("byte_fallback")
    if byte_fallback:
        vocab = gguf.LlamaHfVocab(hf_dir)
        tokens, scores, types = (list(x) for x in zip(*vocab.all_tokens(), strict=True))
        scores = _merge_scores(doc, tokens, scores)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
    elif doc["model"].get("type") == "BPE":
        tokens, types, scores = *_bpe_tokens(tokenizer, vocab_size), None
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer(doc))
    else:
        raise ConfigError(f"gguf: tokenizer model {doc['model'].get('type')!r} is not written by memfit (BPE is)")
    pad = vocab_size - len(tokens)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(max(pad, 0))]
    types += [gguf.TokenType.UNUSED] * max(pad, 0)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores + [-1000.0] * max(pad, 0))
    special = gguf.SpecialVocab(hf_dir, load_merges=not byte_fallback, n_vocab=vocab_size)
    special.chat_template = chat_template_for_gguf(tokenizer.chat_template)
    # What the tokenizer itself adds, written out: llama.cpp's default differs by pre-tokenizer (Llama 3's adds <bos>).
    with_special, plain = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    special.add_special_token["bos"] = len(with_special) > len(plain) and with_special[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = len(with_special) > len(plain) and with_special[-1] == tokenizer.eos_token_id
    special.add_to_gguf(writer)


def _merge_scores(doc: dict[str, Any], tokens: list[str], scores: list[float]) -> list[float]:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose result scores highest; gguf.LlamaHfVocab
    gives every token -1000 (a tokenizer.json has no scores), so the merge order is lost. A token made by merge
    number r scores -r: the tokenizer's own merge order (the verification compares token ids on the prompts)."""
    rank = {}
    for r, merge in enumerate(doc["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, r)
    texts = [(t.decode("utf-8", "replace") if isinstance(t, bytes) else t).replace(" ", "\u2581") for t in tokens]
    return [-float(rank[t]) if t in rank else s for t, s in zip(texts, scores, strict=True)]


def _bpe_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf.py's get_vocab_base: every id's token, added special tokens as CONTROL."""
    import gguf

    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


# Pre-tokenizer regexes llama.cpp knows by name (llama-vocab.cpp): matched on tokenizer.json, where
# convert_hf_to_gguf.py hashes a sample's tokens against the hub tokenizers it lists (a tokenizer trained here is
# in no list). Verification then compares llama.cpp's token ids with the tokenizer's on the prompts.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_PRE_BY_REGEX = {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}


def _pre_tokenizer(doc: dict[str, Any]) -> str:
    pre = doc.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # GPT-2's own split, the ByteLevel default
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    for part in parts:
        regex = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
        if regex in _PRE_BY_REGEX:
            return _PRE_BY_REGEX[regex]
    raise ConfigError(f"gguf: the tokenizer's pre-tokenizer ({pre.get('type')}) is not one llama.cpp knows by name "
                      f"to memfit (GPT-2 byte-level, Llama 3, Qwen2); export SafeTensors and convert with llama.cpp")


def write_f16(hf_dir: Path, out: Path, tokenizer: Any, name: str) -> None:
    """The merged SafeTensors folder → one f16 GGUF (1-D tensors stay f32, as llama.cpp's converter keeps them)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    hp, cfg = Hparams.read(hf_dir)
    arch = getattr(gguf.MODEL_ARCH, hp.arch)
    names = gguf.get_tensor_name_map(arch, hp.layers)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    _write_hparams(writer, hp, cfg)
    _write_vocab(writer, hf_dir, int(cfg["vocab_size"]), tokenizer)
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key == "lm_head.weight" and cfg.get("tie_word_embeddings", hp.arch == "GPT2"):
                    continue  # tied to token_embd, as llama.cpp's converter leaves it out
                if key.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # old GPT-2 checkpoints' causal-mask buffers, not weights
                target = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if target is None:
                    raise ExportError(f"gguf: tensor {key} of {shard.name} has no llama.cpp name for {hp.arch}")
                data = f.get_tensor(key).float()
                if hp.arch in NORM_OFFSET and key.endswith("norm.weight"):
                    data = data + 1.0
                if hp.arch == "GPT2" and key.endswith(CONV1D):
                    data = data.T.contiguous()
                if hp.permute and key.endswith("q_proj.weight"):
                    data = _permute(data, hp.heads)
                elif hp.permute and key.endswith("k_proj.weight"):
                    data = _permute(data, hp.kv_heads)
                array = data.numpy()
                writer.add_tensor(target, array.astype(np.float16) if array.ndim > 1 else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
