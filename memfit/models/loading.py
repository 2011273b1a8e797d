"""Models and tokenizers: tiny seeded presets built on disk, or any HF causal LM, all via from_pretrained."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from memfit.config import MemfitConfig, ModelConfig
from memfit.data.formats import data_digest as _data_digest
from memfit.data.templates import PRESET_CHAT_TEMPLATE, use_configured_template
from memfit.errors import ConfigError, MemfitError, ModelLoadError
from memfit.models.source import resolve_model_source

SPECIAL_TOKEN = "<|endoftext|>"
PRESET_MARKER = "memfit-preset.json"
# Bump when the way presets are built changes, so cached preset folders are rebuilt (2: a default chat template).
PRESET_FORMAT = 2


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> Any:
    """Byte-level BPE trained on `texts`, saved to out_dir (AutoTokenizer.from_pretrained reloads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet means any text encodes without an unk token (so the vocabulary
    # is at least 257 entries whatever vocab_size asks for).
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN,
                                   pad_token=SPECIAL_TOKEN)
    fast.chat_template = PRESET_CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def preset_spec(model_cfg: ModelConfig, seed: int, digest: str, max_seq_len: int) -> dict[str, Any]:
    """What a preset build depends on (its cache key): shape, seed and the digest of the tokenizer's texts."""
    if model_cfg.preset is None:
        raise ConfigError("model.preset is unset and so is model.name_or_path; set one of them")
    return {"format": PRESET_FORMAT, "preset": model_cfg.preset, "vocab_size": model_cfg.vocab_size,
            "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
            "num_heads": model_cfg.num_heads,
            "max_positions": max(model_cfg.max_position_embeddings, max_seq_len),
            "seed": seed, "data_digest": digest}


def _spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _cached(out_dir: Path, spec_hash: str) -> bool:
    try:
        marker = json.loads((out_dir / PRESET_MARKER).read_text())
    except (OSError, ValueError):
        return False
    # The marker is written last inside the build folder, so its presence means a complete build.
    return marker.get("spec_hash") == spec_hash and (out_dir / "config.json").is_file()


def preset_config(spec: dict[str, Any], vocab: int, special_id: int) -> Any:
    """The transformers config of a preset spec (the estimator builds it on fake tensors, without a tokenizer)."""
    h, layers, heads = spec["hidden_size"], spec["num_layers"], spec["num_heads"]
    positions = spec["max_positions"]
    # bos/eos/pad all point at <|endoftext|>, inside the small vocab (GPT2Config defaults to 50256).
    ids = {"bos_token_id": special_id, "eos_token_id": special_id, "pad_token_id": special_id}
    if spec["preset"] == "tiny-llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads,
                           max_position_embeddings=positions, use_cache=True, **ids)
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=positions,
                      use_cache=True, **ids)


def build_preset(model_cfg: ModelConfig, texts: Any, out_dir: Path, seed: int,
                 max_seq_len: int, digest: str | None = None) -> Path:
    """Build (or reuse, when the spec hash matches) a tiny random-weight model + tokenizer in out_dir. `texts`
    may be a callable giving them, called only for a build (with `digest`, their data_digest, given)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    spec = preset_spec(model_cfg, seed, digest or _data_digest(texts), max_seq_len)
    spec_hash = _spec_hash(spec)
    if _cached(out_dir, spec_hash):
        return out_dir
    texts = texts() if callable(texts) else texts
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling folder and rename it into place: a crash mid-build never leaves a
    # half-written preset where a later run would take it for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        tokenizer = train_tokenizer(texts, model_cfg.vocab_size, tmp)
        tokenizer.model_max_length = spec["max_positions"]
        tokenizer.chat_template = PRESET_CHAT_TEMPLATE  # messages data works with a preset; it travels with exports
        tokenizer.save_pretrained(str(tmp))
        config = preset_config(spec, len(tokenizer), tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN))
        # fork_rng: seeding the init must not move the caller's global RNG (devices=[]: init is on CPU).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        _quiet_save(model, tmp)
        marker = {"spec_hash": spec_hash, "spec": spec, "vocab": len(tokenizer)}
        (tmp / PRESET_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a preset folder is ordinary output
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process renamed its own build into place first: use it if it is the same spec.
            if _cached(out_dir, spec_hash):
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _quiet_save(model: Any, folder: Path) -> None:
    # A "Writing model shards" bar for a few-hundred-KB preset is noise in the run log.
    from transformers.utils import logging as hf_logging

    from memfit.runtime.importing import skip_deepspeed_probe

    skip_deepspeed_probe()
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder))
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def preset_dir(cfg: MemfitConfig, data_digest: str) -> Path:
    """Where the preset for this config and data lives: work_dir/presets/<preset>-<spec hash[:12]>."""
    spec = preset_spec(cfg.model, cfg.train.seed, data_digest, cfg.data.seq_len)
    return Path(cfg.run.work_dir) / "presets" / f"{spec['preset']}-{_spec_hash(spec)[:12]}"


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def forward_error(err: BaseException, hf_config: Any) -> ModelLoadError | None:
    """The model's own forward (transformers' modeling code, or a remote-code model's) raised `err`: one line
    naming the model folder, where in the library and its message (None when the error came from elsewhere)."""
    import traceback

    if isinstance(err, MemfitError):
        return None
    marks = (f"{os.sep}transformers{os.sep}models{os.sep}", f"{os.sep}transformers_modules{os.sep}")
    frames = [f for f in traceback.extract_tb(err.__traceback__) if any(m in f.filename for m in marks)]
    if not frames:
        return None
    where = frames[-1].filename.split(f"{os.sep}transformers{os.sep}")[-1]
    folder = getattr(hf_config, "_name_or_path", "") or type(hf_config).__name__
    return ModelLoadError(f"model.name_or_path: the model in {folder} fails in its own forward ({where}, line "
                          f"{frames[-1].lineno}: {_first_line(err)[:300]}); memfit traces that forward to estimate, "
                          "so its config.json must run in transformers first")


def _load_error(name_or_path: str, local: bool, what: str, err: BaseException) -> ModelLoadError:
    if local:
        return ModelLoadError(f"model.name_or_path: could not load the {what} from folder {name_or_path} "
                              f"({_first_line(err)}); check that the folder is a complete "
                              "save_pretrained output")
    also = "; no local folder of that name exists either" if "/" in name_or_path else ""
    # huggingface_hub >= 1 ships the `hf` CLI (the old huggingface-cli is gone from this install).
    return ModelLoadError(
        f"model.name_or_path: could not load '{name_or_path}' from the Hugging Face hub "
        f"({_first_line(err)}){also}; download it first (hf download {name_or_path} --local-dir "
        f"models/{name_or_path.replace('/', '--')}) and point model.name_or_path at that folder, "
        "or check the id")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """AutoTokenizer.from_pretrained, with pad = eos when the tokenizer has no pad token."""
    from transformers import AutoTokenizer

    target, local = resolve_model_source(name_or_path, need_config=False)
    try:
        # local_files_only for folders: a local load never reaches for the network.
        tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code,
                                            local_files_only=local)
    except MemfitError:
        raise
    except Exception as err:  # OSError, ValueError, hub HTTP errors, ... all mean "could not load"
        raise _load_error(target, local, "tokenizer", err) from err
    # Batched evaluation and generation pad; causal-LM tokenizers often ship without a pad token.
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False) -> Any:
    """AutoModelForCausalLM.from_pretrained with errors that say what to do."""
    from transformers import AutoModelForCausalLM

    target, local = resolve_model_source(name_or_path, need_config=True)
    try:
        # transformers 5 takes `dtype=` (torch_dtype= is the deprecated spelling).
        return AutoModelForCausalLM.from_pretrained(target, dtype=dtype, trust_remote_code=trust_remote_code,
                                                    local_files_only=local)
    except MemfitError:
        raise
    except Exception as err:
        raise _load_error(target, local, "model", err) from err


def model_source(cfg: MemfitConfig, texts: Any, data_digest: str) -> str:
    """model.name_or_path, or the preset's folder, built first if needed (`texts`: as build_preset takes them)."""
    if cfg.model.name_or_path:
        return cfg.model.name_or_path
    return str(build_preset(cfg.model, texts, preset_dir(cfg, data_digest), seed=cfg.train.seed,
                            max_seq_len=cfg.data.seq_len, digest=data_digest))


def configured_tokenizer(cfg: MemfitConfig, source: str) -> Any:
    """The tokenizer of `source` with data.chat_template applied, as a run encodes with it."""
    return use_configured_template(load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code), cfg.data)


def load_model_and_tokenizer(cfg: MemfitConfig, texts: list[str], data_digest: str) -> tuple[Any, Any, str]:
    """(model, tokenizer, the name_or_path they were loaded from); presets are built first if needed."""
    source = model_source(cfg, texts, data_digest)
    tokenizer = configured_tokenizer(cfg, source)
    # Always fp32 here: the trainer casts for bf16-true once the plan has settled the precision.
    model = load_model(source, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
    return model, tokenizer, source


def model_max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings allow, or None when it has no such limit."""
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(cfg: MemfitConfig, model_config: Any) -> None:
    limit = model_max_positions(model_config)
    if limit is not None and cfg.data.seq_len > limit:
        name = cfg.model.name_or_path or f"unset, preset {cfg.model.preset}"
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's maximum of {limit} "
                          "positions "
                          f"(model.name_or_path={name}); lower data.seq_len")


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The list of decoder blocks (what gradient checkpointing wraps one by one)."""
    # PEFT wrappers expose the underlying transformers model.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for dotted in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
                   "transformer.layers", "model.language_model.layers"):
        found = _get_path(base, dotted)
        if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
            return found
    # Generic fallback: the longest ModuleList whose entries all share one class (first one wins ties).
    best: torch.nn.ModuleList | None = None
    for module in base.modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1
                and (best is None or len(module) > len(best))):
            best = module
    if best is None:
        raise ModelLoadError(f"model.name_or_path: found no decoder block list in {type(base).__name__}; "
                             "memory planning needs a ModuleList of identical blocks; set memory.block_class to "
                             "the decoder block's class name")
    return best
