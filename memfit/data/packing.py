"""Rows of seq_len tokens: fixed blocks, padding-free packs of whole examples, or one padded example a row."""

from __future__ import annotations

from typing import Any

import torch

from memfit.data.masking import IGNORE, Encoded
from memfit.errors import DataError

Rows = dict[str, torch.Tensor]  # input_ids plus the fields the packing mode needs, all [n_rows, seq_len]


def tokenize_and_pack(texts: list[str], tokenizer: object, seq_len: int, chunk_docs: int = 1024) -> torch.Tensor:
    """Token ids of all docs, each followed by eos, concatenated and cut into [n_blocks, seq_len]."""
    from memfit.data.masking import _token_ids, eos_id

    eos = eos_id(tokenizer)
    flat: list[int] = []
    for doc in _token_ids(tokenizer, texts, chunk_docs):
        flat.extend(doc)
        flat.append(eos)
    return torch.tensor(_cut(flat, seq_len), dtype=torch.long).view(-1, seq_len)


def _cut(flat: list[int], seq_len: int) -> list[int]:
    n_blocks = len(flat) // seq_len
    if n_blocks < 2:
        raise DataError(f"data.seq_len: only {len(flat)} tokens, fewer than 2 blocks of {seq_len} "
                        "(one for training, one for validation): lower data.seq_len or add data")
    return flat[:n_blocks * seq_len]


def pack_blocks(encoded: list[Encoded], seq_len: int) -> Rows:
    """All examples concatenated and cut into blocks, labels alongside (attention crosses examples)."""
    ids = [t for e, _ in encoded for t in e]
    labels = [t for _, lab in encoded for t in lab]
    cut = len(_cut(ids, seq_len))
    return {"input_ids": torch.tensor(ids[:cut]).view(-1, seq_len),
            "labels": torch.tensor(labels[:cut]).view(-1, seq_len)}


def _bins(lengths: list[int], seq_len: int, window: int = 64) -> list[list[int]]:
    # First-fit decreasing over the last `window` open rows: dense rows in near-linear time, deterministic.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        start = max(0, len(rows) - window)
        for r in range(start, len(rows)):
            if room[r] >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(seq_len - lengths[i])
    return rows


def pack_padding_free(encoded: list[Encoded], seq_len: int, pad_id: int) -> tuple[Rows, list[list[int]]]:
    """Whole examples packed up to seq_len tokens a row; (rows, which examples each row holds).

    position_ids restart at 0 for every example (and for the tail padding); the first label of each example is
    -100, so no token is trained on a prediction made from another example.
    """
    bins = _bins([len(ids) for ids, _ in encoded], seq_len)
    ids_rows, label_rows, pos_rows = [], [], []
    for members in bins:
        ids, labels, pos = [], [], []
        for i in members:
            e_ids, e_labels = encoded[i]
            ids += e_ids
            labels += [IGNORE, *e_labels[1:]]
            pos += range(len(e_ids))
        pad = seq_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        label_rows.append(labels + [IGNORE] * pad)
        pos_rows.append(pos + list(range(pad)))
    return {"input_ids": torch.tensor(ids_rows), "labels": torch.tensor(label_rows),
            "position_ids": torch.tensor(pos_rows)}, bins


def pack_padded(encoded: list[Encoded], seq_len: int, pad_id: int) -> tuple[Rows, list[list[int]]]:
    """One example a row, right-padded; attention_mask 0 on padding (batches are cut to their longest row)."""
    n = len(encoded)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.long)
    for r, (e_ids, e_labels) in enumerate(encoded):
        ids[r, :len(e_ids)] = torch.tensor(e_ids)
        labels[r, :len(e_ids)] = torch.tensor(e_labels)
        mask[r, :len(e_ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}, [[i] for i in range(n)]


def val_count(n: int, val_fraction: float) -> int:
    """Pure: the rows (blocks, examples, pairs) of n held out for validation: at least one, and one left to train."""
    return min(max(1, round(n * val_fraction)), n - 1)


def split_rows(rows: Rows, val_fraction: float, seed: int) -> tuple[Rows, Rows, torch.Tensor]:
    """Seeded shuffle of the rows, then (train, val, the val rows' original indices); each side gets one or more."""
    n = rows["input_ids"].shape[0]
    if n < 2:
        raise DataError(f"data.seq_len: only {n} block(s); need 2 or more: lower data.seq_len or add data")
    n_val = val_count(n, val_fraction)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    train = {k: v[order[n_val:]].clone() for k, v in rows.items()}
    val = {k: v[order[:n_val]].clone() for k, v in rows.items()}
    return train, val, order[:n_val]


def split_blocks(blocks: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded shuffle of the blocks, then (train, val); each side gets at least one block."""
    train, val, _ = split_rows({"input_ids": blocks}, val_fraction, seed)
    return train["input_ids"], val["input_ids"]


def packed_attention_mask(position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype
                          ) -> torch.Tensor | None:
    """The 4-D [batch, 1, seq, seq] causal mask that keeps packed examples apart (a new one starts at position 0).

    None for flash attention, whose varlen path reads the boundaries from position_ids. transformers 5.24 also
    reads them from position_ids for SDPA/eager, but only without a KV cache (the presets enable use_cache), so
    the mask is explicit: bool for SDPA, additive for eager.
    """
    if attn_implementation.startswith("flash"):
        return None
    segment = (position_ids == 0).cumsum(-1)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    allowed = (same & causal)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                       torch.finfo(dtype).min)


def row_real_tokens(input_ids: torch.Tensor, fields: dict[str, torch.Tensor], pad_id: int | None) -> list[int]:
    """Pure: the tokens of each row that are data, not padding: the whole row for blocks; attention_mask's ones
    for one padded example a row; for padding-free packs the row less its tail padding, which is the last
    position-id segment when every token of it is `pad_id` with no label (an example never is: it has text)."""
    rows, width = input_ids.shape
    if "attention_mask" in fields:
        return fields["attention_mask"].sum(-1).tolist()
    if "position_ids" not in fields or pad_id is None:
        return [width] * rows
    out = []
    labels = fields.get("labels")
    for r in range(rows):
        starts = (fields["position_ids"][r] == 0).nonzero().flatten().tolist()
        tail = starts[-1] if starts else 0
        pad = bool((input_ids[r, tail:] == pad_id).all()) and (
            labels is None or bool((labels[r, tail:] == IGNORE).all()))
        out.append(tail if pad and tail > 0 else width)
    return out


def flattened(data_cfg: Any, packed: bool, attn_implementation: str) -> bool:
    """Pure: does a padding-free micro-batch run as one joined sequence (data.flatten)?"""
    if not packed or data_cfg.flatten is False:
        return False
    return data_cfg.flatten is True or attn_implementation.startswith("flash")
