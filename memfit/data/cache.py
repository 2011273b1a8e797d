"""Packed rows prepared once per data version and settings (.npy files, memory-mapped), reused by every phase."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.config import MemfitConfig
from memfit.data import shared
from memfit.data.arrow_examples import prepare_examples
from memfit.data.arrow_text import prepare_text_blocks
from memfit.data.prepare import DataBundle, prepare_data
from memfit.data.source import DataSource
from memfit.data.workers import num_proc
from memfit.files import write_json_atomic

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


def _corpus(cfg: MemfitConfig, texts: Any) -> Any:
    """The records as a Corpus, from a DataSource (read once per process), a Corpus, texts, or data.path."""
    from memfit.data.formats import Corpus, load_texts

    if isinstance(texts, DataSource):
        return texts.corpus()
    return texts if isinstance(texts, Corpus) else load_texts(cfg.data) if texts is None else Corpus(list(texts))


def _tensors(bundle: DataBundle) -> dict[str, torch.Tensor]:
    return {"train": bundle.train, "val": bundle.val, **{f"train.{k}": v for k, v in bundle.train_fields.items()},
            **{f"val.{k}": v for k, v in bundle.val_fields.items()}}


def _meta(bundle: DataBundle) -> dict[str, Any]:
    return {"digest": bundle.digest, "source": bundle.source, "packing": bundle.packing, "heldout": bundle.heldout,
            "stats": bundle.stats}


def _load(folder: Path) -> DataBundle:
    """A prepared folder as a DataBundle whose rows are memory-mapped (copy-on-write: the trainer reads pages
    as batches need them, and nothing it does can change the files)."""
    meta = json.loads((folder / "meta.json").read_text())
    tensors = {p.name.removesuffix(".npy"): torch.from_numpy(np.load(p, mmap_mode="c"))
               for p in folder.glob("*.npy")}
    fields = {split: {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{split}.")}
              for split in ("train", "val")}
    return DataBundle(train=tensors["train"], val=tensors["val"], digest=meta["digest"],
                      n_train_tokens=tensors["train"].numel(), n_val_tokens=tensors["val"].numel(),
                      source=meta["source"], train_fields=fields["train"], val_fields=fields["val"],
                      packing=meta.get("packing", "blocks"), heldout=meta.get("heldout", []),
                      stats=meta.get("stats", {}))


def _plain_blocks(cfg: MemfitConfig, texts: Any) -> bool:
    d = cfg.data
    return (isinstance(texts, DataSource) and d.path is not None and cfg.train.objective != "dpo"
            and d.packing == "blocks" and d.train_on == "all")


def _prepare_into(tmp: Path, cfg: MemfitConfig, texts: Any, digest: str, tokenizer: Any) -> None:
    """The packed rows as .npy files and meta.json in `tmp`: records of data.path out of core (plain text blocks by
    arrow_text, every other format and packing by arrow_examples); the synthetic corpus or given texts in memory."""
    if _plain_blocks(cfg, texts):
        rows = prepare_text_blocks(cfg.data, tokenizer, tmp, num_proc(cfg.data), texts.arrow_dir)
        if rows is not None:
            known = texts.known() or {}
            seq_len = cfg.data.seq_len
            stats = {"format": "text", "examples": known.get("examples", 0),
                     "trained_tokens_share": round((seq_len - 1) / seq_len, 4)}
            write_json_atomic(tmp / "meta.json", {"digest": digest, "source": cfg.data.path, "packing": "blocks",
                                                  "heldout": [], "stats": stats})
            log.info("data: %d text example(s), packing blocks into %d training + %d validation rows of %d "
                     "tokens (out of core, %d process(es))", stats["examples"], rows[0], rows[1], seq_len,
                     num_proc(cfg.data))
            return
    if isinstance(texts, DataSource) and prepare_examples(cfg, tokenizer, tmp, num_proc(cfg.data), texts.arrow_dir,
                                                          digest):
        return
    bundle = prepare_data(cfg, tokenizer, _corpus(cfg, texts))
    for name, t in _tensors(bundle).items():
        np.save(tmp / f"{name}.npy", t.contiguous().numpy())
    write_json_atomic(tmp / "meta.json", _meta(bundle))


def cached_data(cfg: MemfitConfig, texts: Any, digest: str | None, tokenizer: Any, model_config: Any = None
                ) -> DataBundle:
    """The packed rows, prepared once per data version and settings, reused by every phase and run after; data
    .packing auto is resolved first (it needs the model's config), so the key and the bundle name the layout
    chosen. `texts`: a DataSource (its digest used when `digest` is None), a Corpus or plain texts. data.streaming:
    nothing is prepared; the blocks are read as training needs them (streaming.py)."""
    if cfg.data.streaming:
        from memfit.data.streaming import streamed_data

        return streamed_data(cfg, texts, tokenizer)
    if digest is None:
        digest = texts.digest()
    if cfg.data.packing == "auto" and cfg.train.objective != "dpo":  # preference pairs: one pair a row, padded
        packing = resolve_auto_packing(cfg, texts, digest, tokenizer, model_config)[0]
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": packing})})
    key = cache_key(cfg, digest, tokenizer)
    folder = Path(cfg.run.work_dir) / "data-cache" / key
    if (folder / "meta.json").is_file():
        try:
            bundle = _load(folder)
            log.info("data: prepared rows reused (%s, key %s)", folder, key)
            return bundle
        except (OSError, ValueError, KeyError) as err:
            log.warning("ignoring unreadable data cache %s (%s)", folder, err)
            shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
    store = shared.shared_store(cfg)
    try:
        fetched = shared.fetch(store, key, tmp)
        if not fetched:
            _prepare_into(tmp, cfg, texts, digest, tokenizer)
        try:
            tmp.rename(folder)  # the whole folder at once: a reader never sees part of it
        except OSError:  # another process (a rank, a phase) prepared the same rows first: theirs are the same
            if not (folder / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if fetched:
        log.info("data: prepared rows reused from the checkpoint store in %.1f s (%s, key %s)",
                 time.perf_counter() - t0, folder, key)
    else:
        log.info("data: prepared in %.1f s (%s, key %s)", time.perf_counter() - t0, folder, key)
        shared.share(store, key, folder)
    return _load(folder)


def resolve_auto_packing(cfg: MemfitConfig, texts: Any, digest: str, tokenizer: Any, model_config: Any
                         ) -> tuple[str, list[dict[str, Any]]]:
    """data.packing auto: (the layout predicted fastest per trained token on memory.device, else the device this
    run is on; every candidate's prediction as rows). Kept beside the data cache, keyed on what the prediction
    reads, so every phase and rank of a run picks the same layout without encoding the data again."""
    from memfit.data.arrow_examples import example_lengths
    from memfit.data.layout import choose_packing, resolve_packing
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
    read = (example_lengths(cfg.data, tokenizer, num_proc(cfg.data), texts.arrow_dir)
            if isinstance(texts, DataSource) else None)
    if read is not None:  # data.path's records encoded a slice at a time, never all held
        packing, costs = choose_packing(cfg, *read, model_config, profile, attn)
    else:
        packing, costs = resolve_packing(cfg, _corpus(cfg, texts), tokenizer, model_config, profile, attn)
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
