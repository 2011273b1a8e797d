"""The estimator and explicit attention masks: padding-free packs (and padded batches) on SDPA carry a 4-D boolean
mask that SDPA copies into the compute dtype in every layer and keeps for backward; the estimate counts it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from memory_support import VOCAB, tiny

from memfit.config.devices import PROFILES
from memfit.memory.estimator.compose import Stack
from memfit.memory.estimator.estimate import Estimator
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.planner.search import explicit_mask
from memfit.memory.techniques.loss import PlainLoss, blocks_batch
from memfit.memory.techniques.policies import find_blocks

pytestmark = pytest.mark.integration
SEQ, ROWS = 64, 4


class _Packed:
    """Rows of two packed examples each, as data.packing padding_free lays them out: position_ids restart at the
    second example, and blocks_batch builds the block-diagonal mask SDPA gets; `flatten`: the rows joined into
    one sequence (data.flatten true), its mask over the whole micro-batch."""

    name = "plain"

    def __init__(self, flatten: bool = False) -> None:
        self.flatten = flatten

    def __call__(self, model, batch):
        ids = batch["input_ids"]
        pos = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).expand(ids.shape[0], SEQ)
        lengths = [SEQ] * ids.shape[0] if self.flatten else None
        return PlainLoss()(model, blocks_batch(ids, slice(None), None, {"position_ids": pos, "labels": ids}, "sdpa",
                                               lengths))


def _measured(flatten: bool = False) -> int:
    model = tiny("llama")
    tracker = StepTracker(find_blocks(model))
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker.track_external(model, optimizer)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    with tracker:
        run_step(model, optimizer, [ids], "fp32", tracker, loss_fn=_Packed(flatten))
    return tracker.result().peak_bytes


def test_a_padding_free_step_on_sdpa_is_estimated_with_its_masks():
    hf = copy.deepcopy(tiny("llama").config)
    stack = Stack("fp32", ROWS, 1, False)
    measured = _measured()
    masked = Estimator(hf, SEQ, PROFILES["cpu"], attention_mask=True).estimate(stack, ["none"] * 4).peak_bytes
    causal = Estimator(hf, SEQ, PROFILES["cpu"]).estimate(stack, ["none"] * 4).peak_bytes
    assert masked == pytest.approx(measured, rel=0.02), (masked, measured)
    # Without the masks the estimate misses a fp32 copy of the mask per layer: 4 layers x 4 x 64 x 64 x 4 bytes.
    assert measured - causal >= 4 * ROWS * SEQ * SEQ * 4, (causal, measured)


def test_a_flattened_micro_batch_on_sdpa_is_estimated_with_its_joined_mask():
    """data.flatten true on SDPA: one row of 4 x 64 tokens, a 256 x 256 mask copied in every layer (4 times the
    per-row masks' bytes)."""
    hf = copy.deepcopy(tiny("llama").config)
    stack = Stack("fp32", ROWS, 1, False)
    measured = _measured(flatten=True)
    joined = Estimator(hf, SEQ, PROFILES["cpu"], attention_mask=True, flattened=True).estimate(stack, ["none"] * 4)
    per_row = Estimator(hf, SEQ, PROFILES["cpu"], attention_mask=True).estimate(stack, ["none"] * 4)
    assert joined.peak_bytes == pytest.approx(measured, rel=0.02), (joined.peak_bytes, measured)
    # Per-row masks would miss most of it: 4 layers x (256^2 - 4 x 64^2) x 4 bytes, less where the peaks differ.
    assert measured - per_row.peak_bytes >= 0.8 * 4 * ((ROWS * SEQ) ** 2 - ROWS * SEQ ** 2) * 4, (per_row, measured)


def test_which_runs_carry_an_explicit_mask():
    sdpa = SimpleNamespace(_attn_implementation="sdpa")
    flash = SimpleNamespace(_attn_implementation="flash_attention_2")

    def cfg(packing: str, objective: str = "sft"):
        return SimpleNamespace(data=SimpleNamespace(packing=packing), train=SimpleNamespace(objective=objective))

    assert not explicit_mask(cfg("blocks"), sdpa)  # causal blocks: is_causal, no mask
    assert explicit_mask(cfg("padding_free"), sdpa)  # packed examples kept apart
    assert explicit_mask(cfg("auto"), sdpa)  # resolved only from the data: counted as masked
    # One padded example or pair a row: the padding is on the right, the batch runs causal without its mask...
    assert not explicit_mask(cfg("none"), sdpa) and not explicit_mask(cfg("blocks", "dpo"), sdpa)
    # ...but for an MoE, whose load-balancing loss counts the real tokens by it.
    moe = SimpleNamespace(_attn_implementation="sdpa", output_router_logits=False)
    assert explicit_mask(cfg("none"), moe) and explicit_mask(cfg("blocks", "dpo"), moe)
    assert not explicit_mask(cfg("padding_free"), flash)  # varlen flash attention reads position_ids
