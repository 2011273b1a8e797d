"""`memfit estimate` on a DPO run says what was planned: the rows traced, the head's positions, the reference."""

from __future__ import annotations

import pytest

from memfit.memory.estimator.breakdown import estimate_text

pytestmark = pytest.mark.unit


def _out(dpo: dict | None) -> dict:
    return {"policy": "none", "device": "cpu", "precision": "fp32", "micro_batch_size": 8, "grad_accum_steps": 1,
            "seq_len": 17, "lora": False, "total_bytes": 8e6, "peak_at": "micro-batch 1, forward, the DPO "
            "reference's no-grad forward", "breakdown": {"params": 1e6}, "budget_bytes": None, "experts": None,
            "params_total": 200_000, "adapter_rows": [], "dpo": dpo}


def test_a_dpo_estimate_names_its_rows_head_and_reference():
    dpo = {"pairs_read": True, "pairs": 8, "rows": 16, "row_tokens": 17, "data_seq_len": 32, "logits_keep": 8,
           "coverage": 0.44, "reference": "copy", "reference_bytes": 787712, "reference_why": "copy: a frozen copy"}
    lines = estimate_text(_out(dpo)).splitlines()
    assert lines[0].startswith("none on cpu, fp32, micro-batch 8 x 1 x 17 tokens")
    assert ("  dpo: 8 pairs a micro-batch (16 rows of 17 tokens, the data's longest pair), the head on the last 8 "
            "positions; the steps go over the training pairs 0.44x") in lines
    assert "  reference: copy: a frozen copy" in lines


def test_unread_pairs_say_the_worst_case_was_planned():
    dpo = {"pairs_read": False, "pairs": 1, "rows": 2, "row_tokens": 1024, "data_seq_len": 1024, "logits_keep": None,
           "coverage": None, "reference": "adapter_off", "reference_bytes": 0, "reference_why": "adapter_off: ..."}
    text = estimate_text(_out(dpo))
    assert ("dpo: 1 pair a micro-batch (2 rows of 1024 tokens, data.seq_len: the pairs or their tokenizer unread), "
            "the head on every position\n") in text
    assert "dpo:" not in estimate_text(_out(None))  # an sft estimate: no such lines
