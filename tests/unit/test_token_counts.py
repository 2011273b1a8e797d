"""Honest token counts: real tokens per packed row (no padding), and the step metrics built from them."""

from __future__ import annotations

import random

import pytest
import torch

from memfit.data.packing import pack_blocks, pack_padded, pack_padding_free, row_real_tokens
from memfit.memory.techniques.optim import step_metrics

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


def test_a_flattened_micro_batch_has_no_padding_and_the_same_loss_as_its_rows():
    """data.flatten: the rows joined without their tails: one sequence, positions restarting per example, and the
    loss over the same trained tokens equal to the per-row batch's (attention still kept within each example)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.memory.techniques.loss import blocks_batch, make_loss

    encoded = _examples(30, seed=2)
    rows, _ = pack_padding_free(encoded, seq_len=32, pad_id=PAD)
    fields = {k: v for k, v in rows.items() if k != "input_ids"}
    lengths = row_real_tokens(rows["input_ids"], fields, PAD)[:4]
    per_row = blocks_batch(rows["input_ids"], slice(0, 4), None, fields, "sdpa")
    flat = blocks_batch(rows["input_ids"], slice(0, 4), None, fields, "sdpa", lengths=lengths)
    assert flat["input_ids"].shape == (1, sum(lengths)) < per_row["input_ids"].shape
    assert int((flat["labels"] != -100).sum()) == int((per_row["labels"] != -100).sum())
    assert int((flat["position_ids"] == 0).sum()) == int((per_row["position_ids"][:, :] == 0).sum()) - sum(
        1 for n in lengths if n < 32)  # the tails' own segments are gone
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                         attn_implementation="sdpa")).eval()
    loss = make_loss()
    with torch.no_grad():
        assert float(loss(model, flat)) == pytest.approx(float(loss(model, per_row)), rel=1e-5)


def test_flops_per_token_and_mfu_as_palm_and_torchtitan_count_them():
    from memfit.memory.techniques.optim import flops_per_token

    # Llama-3-8B at 2048 tokens: 6 x 8.03e9 for the weights + 12 x 32 layers x 4096 x 2048 for attention.
    per_token = flops_per_token(8_030_261_248, 32, 4096, 2048)
    assert per_token == 6 * 8_030_261_248 + 12 * 32 * 4096 * 2048 == pytest.approx(5.14e10, rel=1e-3)
    m = step_metrics(2.0, lr=1e-3, grad_norm=1.0, tokens=8192, seconds=1.0, memory=(1, 1), flops=per_token,
                     peak_flops=989e12)
    assert m["tflops"] == pytest.approx(per_token * 8192 / 1e12)
    assert m["mfu"] == pytest.approx(per_token * 8192 / 989e12)  # ≈ 0.43 on an H100's bf16 peak
    assert "mfu" not in step_metrics(2.0, lr=1e-3, grad_norm=1.0, tokens=1, seconds=1.0, memory=(1, 1))
