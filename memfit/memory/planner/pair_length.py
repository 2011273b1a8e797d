"""DPO's planned row length: the data's longest preference pair where the estimate can read it, else data.seq_len."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# A DPO micro-batch is one padded pair a row, cut to its longest side (data/pairs.py), so a step's activations
# follow the longest pair in the batch, not data.seq_len: 1B LoRA DPO at seq_len 1024 on the synthetic pairs was
# estimated at 11.8 GiB against 2.75 GiB real (FACTS, "GPU, measured 2026-12-04"). The worst batch holds the
# data's longest pair: that is the length planned. Without the data or its tokenizer (a config.json alone, a hub
# model) the worst case, data.seq_len, stays.
_CACHE: dict[tuple[str, str], int | None] = {}


def longest_pair_tokens(cfg: Any) -> int | None:
    """Tokens of the data's longest pair side (prompt included, at most data.seq_len, as encoded for training);
    None where the data or the tokenizer cannot be read here."""
    key = (cfg.data.model_dump_json(), cfg.model.model_dump_json())
    if key not in _CACHE:
        _CACHE[key] = _longest(cfg)
    return _CACHE[key]


def _longest(cfg: Any) -> int | None:
    from memfit.data.formats import data_digest, load_texts
    from memfit.data.pairs import REJECTED, encode_pairs
    from memfit.errors import MemfitError
    from memfit.models.loading import configured_tokenizer, load_model_and_tokenizer

    try:
        if cfg.model.name_or_path:
            from memfit.data.arrow_examples import longest_pair
            from memfit.data.source import DataSource

            tokenizer = configured_tokenizer(cfg, cfg.model.name_or_path)
            # data.path's pairs a slice at a time (a large preference set is never all held)
            longest = longest_pair(cfg.data, tokenizer, DataSource(cfg.data, cfg.run.work_dir).arrow_dir)
            if longest is not None:
                return longest
        corpus = load_texts(cfg.data)
        if not cfg.model.name_or_path:  # a preset: built on first use (small), as a run builds it
            _, tokenizer, _ = load_model_and_tokenizer(cfg, corpus, data_digest(corpus))
        rows, _, _ = encode_pairs(corpus, tokenizer, cfg.data, 0)  # the pad id changes no length
    except (MemfitError, OSError, ValueError) as err:
        log.info("dpo estimate: planned for data.seq_len=%d pairs (the data's own lengths unread: %s)",
                 cfg.data.seq_len, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    return max(int(rows[name].sum(-1).max()) for name in ("attention_mask", REJECTED + "attention_mask"))


def planned_seq_len(cfg: Any) -> int:
    """The row length a DPO step is estimated at: the longest pair of the data when known, else data.seq_len."""
    longest = longest_pair_tokens(cfg)
    return cfg.data.seq_len if longest is None else min(longest, cfg.data.seq_len)
