"""The training data of a run: records read, rendered, masked and packed into train and validation tensors."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.config import DataConfig, MemfitConfig
from memfit.data.formats import Corpus, data_digest, load_texts
from memfit.data.masking import IGNORE, encode_examples, eos_id, fit_overlong
from memfit.data.packing import (
    pack_blocks,
    pack_padded,
    pack_padding_free,
    split_blocks,
    split_rows,
    tokenize_and_pack,
)
from memfit.errors import DataError

log = logging.getLogger("memfit.data")


@dataclass
class DataBundle:
    train: torch.Tensor  # input_ids [rows, seq_len]
    val: torch.Tensor
    digest: str
    n_train_tokens: int
    n_val_tokens: int
    source: str
    # What the batch dict carries besides input_ids (labels, position_ids, attention_mask), per split; empty
    # for plain text blocks, where labels are the inputs.
    train_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    val_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    packing: str = "blocks"
    # Held-out examples (validation rows' prompt/completion or messages records) phase 5 generates answers for.
    heldout: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # data.streaming: the training blocks come from this BlockStream (streaming.py); `train` holds its first batch.
    stream: Any = None

    def trained_share(self) -> float:
        """Share of the training rows' tokens whose prediction is trained (labels shifted by one, as the loss)."""
        labels = self.train_fields.get("labels", self.train)
        trained = int((labels[:, 1:] != IGNORE).sum()) if "labels" in self.train_fields else labels[:, 1:].numel()
        return trained / max(1, self.train.numel())


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else eos_id(tokenizer)


def _heldout(corpus: Corpus, val_rows: torch.Tensor, members: list[list[int]], index: list[int], n: int
             ) -> list[dict[str, Any]]:
    if corpus.format == "text" or n == 0:
        return []
    out = []
    for row in val_rows.tolist():
        for i in members[row]:
            e = corpus.examples[index[i]]
            if "chosen" in e:  # a pair is held out as its prompt and the chosen answer
                e = ({"prompt": e["prompt"], "completion": e["chosen"]} if isinstance(e["prompt"], str)
                     else {"messages": [*e["prompt"], *e["chosen"]]})
            out.append(e)
            if len(out) == n:
                return out
    return out


def _pack(corpus: Corpus, tokenizer: Any, data: DataConfig) -> tuple[dict[str, torch.Tensor], list[list[int]],
                                                                        list[int], dict[str, Any]]:
    """(rows, examples in each row, encoded index -> corpus index, counts) for data.packing."""
    encoded = encode_examples(corpus, tokenizer, data)
    stats: dict[str, Any] = {"format": corpus.format, "examples": len(encoded)}
    if data.packing == "blocks":
        return pack_blocks(encoded, data.seq_len), [], list(range(len(encoded))), stats
    field_name = {"messages": data.messages_field, "prompt_completion": data.completion_field}.get(
        corpus.format, data.text_field)
    kept, index, counts = fit_overlong(encoded, corpus.origins, data.seq_len, data.overlong, field_name)
    stats.update(counts)
    if counts["truncated"] or counts["dropped"]:
        log.warning("data: %d example(s) longer than data.seq_len=%d truncated, %d dropped (data.overlong=%s)",
                    counts["truncated"], data.seq_len, counts["dropped"], data.overlong)
    pack = pack_padding_free if data.packing == "padding_free" else pack_padded
    rows, members = pack(kept, data.seq_len, _pad_id(tokenizer))
    return rows, members, index, stats


def prepare_data(cfg: MemfitConfig, tokenizer: Any, texts: list[str] | None = None) -> DataBundle:
    """Load (unless given), encode with data.train_on, pack with data.packing, split with data.val_fraction / seed."""
    data = cfg.data
    corpus = texts if isinstance(texts, Corpus) else load_texts(data) if texts is None else Corpus(list(texts))
    if (cfg.train.objective == "dpo") != (corpus.format == "preference"):
        where = data.path or "the synthetic corpus"
        raise DataError(f"train.objective: {cfg.train.objective}, and {where} holds {corpus.format} "
                        "records; dpo trains on preference pairs (records with chosen and rejected fields, or "
                        "data.format: preference without data.path for synthetic ones), sft on the others")
    if corpus.format == "preference":  # one pair a row, padded; no packing, loss on the completions
        from memfit.data.pairs import encode_pairs

        rows, index, stats = encode_pairs(corpus, tokenizer, data, _pad_id(tokenizer))
        rows_train, rows_val, val_index = split_rows(rows, data.val_fraction, data.seed)
        train, val = rows_train.pop("input_ids"), rows_val.pop("input_ids")
        fields_train, fields_val = rows_train, rows_val
        stats.update({"format": "preference", "examples": len(index), "pad_id": _pad_id(tokenizer)})
        heldout = _heldout(corpus, val_index, [[i] for i in range(len(index))], index, data.heldout_prompts)
    elif corpus.format == "text" and data.packing == "blocks" and data.train_on == "all":
        # Plain text blocks: labels are the inputs, so the batch is input_ids alone (the path golden losses pin).
        train, val = split_blocks(tokenize_and_pack(list(corpus), tokenizer, data.seq_len), data.val_fraction,
                                  data.seed)
        fields_train, fields_val, heldout, stats = {}, {}, [], {"format": "text", "examples": len(corpus)}
    else:
        rows, members, index, stats = _pack(corpus, tokenizer, data)
        rows_train, rows_val, val_index = split_rows(rows, data.val_fraction, data.seed)
        train, val = rows_train.pop("input_ids"), rows_val.pop("input_ids")
        fields_train, fields_val = rows_train, rows_val
        heldout = _heldout(corpus, val_index, members, index, data.heldout_prompts) if members else []
        stats["pad_id"] = _pad_id(tokenizer)  # tells padding from data when tokens are counted (row_real_tokens)
    source = data.path or f"synthetic({data.synthetic_docs}, {data.seed})"
    bundle = DataBundle(train=train, val=val, digest=data_digest(corpus), n_train_tokens=train.numel(),
                        n_val_tokens=val.numel(), source=source, train_fields=fields_train, val_fields=fields_val,
                        packing=data.packing, heldout=heldout, stats=stats)
    bundle.stats["trained_tokens_share"] = round(bundle.trained_share(), 4)
    log.info("data: %d %s example(s), packing %s into %d training + %d validation rows of %d tokens; trained "
             "tokens (train_on %s): %.1f%% of the training rows' tokens", stats["examples"], stats["format"],
             data.packing, len(train), len(val), data.seq_len, data.train_on, 100 * bundle.trained_share())
    return bundle
