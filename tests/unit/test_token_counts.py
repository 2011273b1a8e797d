"""Honest token counts: real tokens per packed row (no padding), and the step metrics built from them."""

from __future__ import annotations

import random

import pytest
import torch

from memfit.data.packing import pack_blocks, pack_padded, pack_padding_free, row_real_tokens
from memfit.training.optim import step_metrics

pytestmark = pytest.mark.unit
PAD = 0


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(2, 20)
        ids = [rng.randint(0, 50) for _ in range(length)]  # the pad id occurs inside examples too
        labels = [t if rng.random() < 0.5 else -100 for t in ids]
        out.append((ids, labels))
    return out


def test_padding_free_rows_count_their_examples_tokens_only():
    encoded = _examples(40)
    rows, bins = pack_padding_free(encoded, seq_len=32, pad_id=PAD)
    fields = {k: v for k, v in rows.items() if k != "input_ids"}
    want = [sum(len(encoded[i][0]) for i in members) for members in bins]
    assert row_real_tokens(rows["input_ids"], fields, PAD) == want
    assert min(want) < 32  # some rows are padded: the count is not the row width


def test_a_full_padding_free_row_and_an_example_ending_in_the_pad_id():
    encoded = [([5, 6, 7, PAD], [5, 6, 7, PAD]), ([8, 9, PAD, PAD], [-100, 9, PAD, -100])]
    rows, bins = pack_padding_free(encoded, seq_len=8, pad_id=PAD)
    assert bins == [[0, 1]]
    fields = {k: v for k, v in rows.items() if k != "input_ids"}
    assert row_real_tokens(rows["input_ids"], fields, PAD) == [8]  # no tail: the last segment is an example


def test_padded_rows_and_blocks():
    encoded = _examples(10, seed=1)
    rows, _ = pack_padded(encoded, seq_len=24, pad_id=PAD)
    fields = {k: v for k, v in rows.items() if k != "input_ids"}
    assert row_real_tokens(rows["input_ids"], fields, PAD) == [len(ids) for ids, _ in encoded]
    blocks = pack_blocks(encoded, 16)
    fields = {k: v for k, v in blocks.items() if k != "input_ids"}
    assert row_real_tokens(blocks["input_ids"], fields, PAD) == [16] * len(blocks["input_ids"])
    assert row_real_tokens(torch.zeros(3, 5, dtype=torch.long), {}, None) == [5, 5, 5]


def test_step_metrics_count_real_and_trained_tokens_and_the_padding():
    m = step_metrics(2.0, lr=1e-3, grad_norm=1.0, tokens=750, seconds=0.5, memory=(1, 1), trained=300, slots=1000)
    assert m["tokens_per_s"] == 1500 and m["trained_tokens_per_s"] == 600
    assert m["padding_fraction"] == pytest.approx(0.25)
    plain = step_metrics(2.0, lr=1e-3, grad_norm=1.0, tokens=100, seconds=1.0, memory=(1, 1))
    assert "padding_fraction" not in plain and plain["tokens_per_s"] == 100
