"""DPO's planned rows and reference: the data's longest pair, shortest prompt and pair count where readable."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# A DPO micro-batch is one padded pair a row, cut to its longest side (data/pairs.py), so a step's activations
# follow the longest pair in the batch, not data.seq_len: 1B LoRA DPO at seq_len 1024 on the synthetic pairs was
# estimated at 11.8 GiB against 2.75 GiB real (FACTS, "GPU, measured 2026-12-04"). The worst batch holds the
# data's longest pair: that is the length planned. Without the data or its tokenizer (a config.json alone, a hub
# model) the worst case, data.seq_len, stays.
# The head runs from the first position that predicts a completion token in the batch (techniques/logps.py): in
# the worst batch the longest pair sits beside the shortest prompt, so the positions kept are at most
# longest - shortest prompt + 1.
_CACHE: dict[tuple[str, str], tuple[int, int, int] | None] = {}


def pair_lengths(cfg: Any) -> tuple[int, int, int] | None:
    """(tokens of the data's longest pair side, prompt included, at most data.seq_len, as encoded for training;
    tokens of its shortest prompt; the pairs kept); None where the data or the tokenizer cannot be read here."""
    key = (cfg.data.model_dump_json(), cfg.model.model_dump_json())
    if key not in _CACHE:
        _CACHE[key] = _lengths(cfg)
    return _CACHE[key]


def longest_pair_tokens(cfg: Any) -> int | None:
    lengths = pair_lengths(cfg)
    return None if lengths is None else lengths[0]


def _lengths(cfg: Any) -> tuple[int, int, int] | None:
    from memfit.data.formats import data_digest, load_texts
    from memfit.data.pairs import REJECTED, encode_pairs
    from memfit.errors import MemfitError
    from memfit.models.loading import configured_tokenizer, model_source

    try:
        if cfg.model.name_or_path:
            from memfit.data.arrow_examples import longest_pair
            from memfit.data.source import DataSource

            tokenizer = configured_tokenizer(cfg, cfg.model.name_or_path)
            # data.path's pairs a slice at a time (a large preference set is never all held)
            lengths = longest_pair(cfg.data, tokenizer, DataSource(cfg.data, cfg.run.work_dir).arrow_dir)
            if lengths is not None:
                return lengths
        corpus = load_texts(cfg.data)
        if not cfg.model.name_or_path:  # a preset: built on first use (small), as a run builds it; its tokenizer
            tokenizer = configured_tokenizer(cfg, model_source(cfg, corpus, data_digest(corpus)))
        rows, _, _ = encode_pairs(corpus, tokenizer, cfg.data, 0)  # the pad id changes no length
    except (MemfitError, OSError, ValueError) as err:
        log.info("dpo estimate: planned for data.seq_len=%d pairs (the data's own lengths unread: %s)",
                 cfg.data.seq_len, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    longest = max(int(rows[name].sum(-1).max()) for name in ("attention_mask", REJECTED + "attention_mask"))
    trained = [rows[name] != -100 for name in ("labels", REJECTED + "labels")]
    prompts = [t.int().argmax(dim=1)[t.any(dim=1)] for t in trained]
    shortest = min((int(p.min()) for p in prompts if len(p)), default=0)
    return longest, shortest, int(rows["input_ids"].shape[0])


def planned_seq_len(cfg: Any) -> int:
    """The row length a DPO step is estimated at: the longest pair of the data when known, else data.seq_len."""
    longest = longest_pair_tokens(cfg)
    return cfg.data.seq_len if longest is None else min(longest, cfg.data.seq_len)


def planned_logits_keep(cfg: Any) -> int | None:
    """The positions whose logits a DPO step's head keeps in the data's worst batch; None (every position) where
    the data is unread or a prompt is empty."""
    lengths = pair_lengths(cfg)
    if lengths is None:
        return None
    keep = min(lengths[0], cfg.data.seq_len) - lengths[1] + 1
    return keep if 0 < keep < planned_seq_len(cfg) else None


def planned_coverage(cfg: Any) -> float | None:
    """How many times the run's steps go over its training pairs (train.max_steps x train.batch_size / the pairs
    left after the validation split), which decides dpo.reference auto (estimator/preference.py); None where the
    pairs are unread: the plan then counts the per-step reference auto takes below one pass."""
    from memfit.data.packing import val_count
    from memfit.memory.estimator.preference import coverage

    lengths = pair_lengths(cfg)
    if lengths is None or lengths[2] < 2:
        return None
    pairs = lengths[2] - val_count(lengths[2], cfg.data.val_fraction)
    return coverage(cfg.train.max_steps, cfg.train.batch_size, pairs)
