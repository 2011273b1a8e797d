"""Packed training data cached on disk, keyed on the data digest, the tokenizer, the template, masking and packing."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from memfit.config import MemfitConfig
from memfit.data.prepare import DataBundle, prepare_data
from memfit.files import atomic_path, write_json_atomic

log = logging.getLogger("memfit.data")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides token ids: the vocabulary, merges and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps({"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id}, sort_keys=True)
    return hashlib.sha256((state + extra).encode()).hexdigest()


def cache_key(cfg: MemfitConfig, digest: str, tokenizer: Any) -> str:
    # Only what changes the packed tensors: the examples (their digest covers the format), the tokenizer and the
    # chat template it renders with, which tokens are trained, and how rows are packed and split.
    d = cfg.data
    template = getattr(tokenizer, "chat_template", None)
    parts = {"digest": digest, "tokenizer": tokenizer_fingerprint(tokenizer), "seq_len": d.seq_len,
             "val_fraction": d.val_fraction, "seed": d.seed, "layout": 3, "data_format": d.format,
             "fields": [d.text_field, d.prompt_field, d.completion_field, d.messages_field, d.chosen_field,
                        d.rejected_field],
             "template": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
             "train_on": d.train_on, "packing": d.packing, "overlong": d.overlong, "heldout": d.heldout_prompts}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached_data(cfg: MemfitConfig, texts: list[str], digest: str, tokenizer: Any, model_config: Any = None
                ) -> DataBundle:
    """prepare_data, reused across phases and runs when nothing that shapes the blocks changed. data.packing auto
    is resolved first (it needs the model's config), so the key and the bundle name the layout chosen."""
    if cfg.data.packing == "auto" and cfg.train.objective != "dpo":  # preference pairs: one pair a row, padded
        packing = resolve_auto_packing(cfg, texts, digest, tokenizer, model_config)[0]
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": packing})})
    path = Path(cfg.run.work_dir) / "data-cache" / f"{cache_key(cfg, digest, tokenizer)}.safetensors"
    if path.is_file():
        try:
            tensors = load_file(str(path))
            meta = json.loads(path.with_suffix(".json").read_text())
            log.info("packed data from cache %s", path)
            fields = {split: {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{split}.")}
                      for split in ("train", "val")}
            return DataBundle(train=tensors["train"], val=tensors["val"], digest=meta["digest"],
                              n_train_tokens=tensors["train"].numel(), n_val_tokens=tensors["val"].numel(),
                              source=meta["source"], train_fields=fields["train"], val_fields=fields["val"],
                              packing=meta.get("packing", "blocks"), heldout=meta.get("heldout", []),
                              stats=meta.get("stats", {}))
        except (OSError, ValueError, KeyError) as err:
            log.warning("ignoring unreadable data cache %s (%s)", path, err)
    bundle = prepare_data(cfg, tokenizer, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Metadata first, tensors last under their final name: a reader never sees tensors without metadata.
    write_json_atomic(path.with_suffix(".json"), {"digest": bundle.digest, "source": bundle.source,
                                                  "packing": bundle.packing, "heldout": bundle.heldout,
                                                  "stats": bundle.stats})
    tensors = {"train": bundle.train, "val": bundle.val,
               **{f"train.{k}": v for k, v in bundle.train_fields.items()},
               **{f"val.{k}": v for k, v in bundle.val_fields.items()}}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    return bundle


def resolve_auto_packing(cfg: MemfitConfig, texts: Any, digest: str, tokenizer: Any, model_config: Any
                         ) -> tuple[str, list[dict[str, Any]]]:
    """data.packing auto: (the layout predicted fastest per trained token on memory.device, else the device this
    run is on; every candidate's prediction as rows). Kept beside the data cache, keyed on what the prediction
    reads, so every phase and rank of a run picks the same layout without encoding the data again."""
    from memfit.data.layout import resolve_packing
    from memfit.errors import ConfigError

    if model_config is None:
        raise ConfigError("data.packing: auto needs the model's config to predict step times; set data.packing "
                          "to blocks, padding_free or none")
    profile = _target_profile(cfg)
    attn = str(getattr(model_config, "_attn_implementation", None) or "sdpa")
    what = {"data": cache_key(cfg, digest, tokenizer), "device": profile.name, "attn": attn,
            "micro_batch": cfg.train.micro_batch_size, "precision": cfg.train.precision, "seed": cfg.train.seed,
            "flatten": cfg.data.flatten, "group_by_length": cfg.data.group_by_length, "version": 1,
            "model": {k: getattr(model_config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                                  "intermediate_size", "vocab_size")}}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = Path(cfg.run.work_dir) / "data-cache" / f"layout-{key}.json"
    try:
        saved = json.loads(path.read_text())
        return saved["packing"], saved["candidates"]
    except (OSError, ValueError, KeyError):
        pass
    from memfit.data.formats import Corpus, load_texts

    corpus = texts if isinstance(texts, Corpus) else load_texts(cfg.data) if texts is None else Corpus(list(texts))
    packing, costs = resolve_packing(cfg, corpus, tokenizer, model_config, profile, attn)
    rows = [c.row() for c in costs]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"packing": packing, "device": profile.name, "candidates": rows})
    return packing, rows


def _target_profile(cfg: MemfitConfig) -> Any:
    import torch

    from memfit.config.devices import cpu_profile, get_profile, profile_for_report

    if cfg.memory.device:
        return get_profile(cfg.memory.device, "memory.device")
    if cfg.train.device != "cpu" and torch.cuda.is_available():
        return profile_for_report({"type": "cuda", "name": torch.cuda.get_device_name()})
    return cpu_profile()
