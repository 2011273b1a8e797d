"""Padded rows run causal without their mask: right padding is never attended to by a real token, so the loss and
the DPO log-probs are those of the masked forward (bitwise), the gradients too (to fp32 rounding: another kernel's
order of sums); an MoE keeps the mask its load-balancing loss reads."""

from __future__ import annotations

import pytest
import torch
from memory_support import VOCAB, tiny

from memfit.data.packing import pack_padded
from memfit.memory.techniques.loss import PlainLoss, blocks_batch
from memfit.models import experts
from memfit.training.objective import policy_logps
from memfit.training.readout import reads_padding

pytestmark = pytest.mark.unit
SEQ = 24


def _rows(lengths: list[int], pairs: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Right-padded rows as data.packing none (or preference pairs) lays them out: labels on the second half."""
    g = torch.Generator().manual_seed(3)
    encoded = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        encoded.append((ids, [-100] * (n // 2) + ids[n // 2:]))
    rows, _ = pack_padded(encoded, SEQ, pad_id=0)
    fields = {k: v for k, v in rows.items() if k != "input_ids"}
    if pairs:  # the rejected side: the same rows reversed, so each pair's sides differ in length
        fields.update({"rejected_" + k: v.flip(0) for k, v in rows.items()})
    return rows["input_ids"], fields


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_a_padded_batch_runs_without_its_mask_and_trains_the_same():
    model = tiny("llama")
    ids, fields = _rows([20, 9, 14, 5])
    batch = blocks_batch(ids, slice(None), None, fields)
    masked = blocks_batch(ids, slice(None), None, fields, padding_mask=True)
    assert "attention_mask" not in batch and masked["attention_mask"].shape == (4, 20)  # cut to the longest row
    assert batch["input_ids"].shape == (4, 20)
    loss = PlainLoss()(model, batch)
    loss.backward()
    without = _grads(model)
    reference = PlainLoss()(model, masked)
    reference.backward()
    assert torch.equal(loss, reference)  # the forward: bitwise
    # The backward: SDPA's causal kernel against its masked one, the same sums in another order (fp32 rounding).
    for a, b in zip(without, _grads(model), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6 * float(b.abs().max())), float((a - b).abs().max())


def test_dpo_log_probs_of_padded_pairs_are_those_of_the_masked_forward():
    model = tiny("llama")
    ids, fields = _rows([22, 7, 16, 11], pairs=True)
    summed, counts = policy_logps(model, blocks_batch(ids, slice(None), None, fields))
    want, want_counts = policy_logps(model, blocks_batch(ids, slice(None), None, fields, padding_mask=True))
    assert torch.equal(summed, want) and torch.equal(counts, want_counts)
    assert counts.tolist() == [11, 4, 8, 6, 6, 8, 4, 11]  # chosen rows, then rejected: each side's own completion


def test_an_moe_keeps_the_mask_its_load_balancing_loss_counts_real_tokens_by():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mixtral", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                               num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(cfg)
    experts.apply(moe, "train", "cpu")
    assert reads_padding(moe) and not reads_padding(tiny("llama"))
    ids, fields = _rows([20, 6, 9, 5])
    kept = blocks_batch(ids, slice(None), None, fields, padding_mask=reads_padding(moe))
    dropped = blocks_batch(ids, slice(None), None, fields)
    # Without the mask the padding's routing would join the load-balancing statistics: another aux loss.
    with_mask, without = PlainLoss(), PlainLoss()
    with_mask(moe, kept)
    without(moe, dropped)
    assert abs(float(with_mask.last_routing[0]) - float(without.last_routing[0])) > 1e-3
