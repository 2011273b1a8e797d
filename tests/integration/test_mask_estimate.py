"""The estimator and explicit attention masks: padding-free packs (and padded batches) on SDPA carry a 4-D boolean
mask that SDPA copies into the compute dtype in every layer and keeps for backward; the estimate counts it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from memory_support import VOCAB, tiny

from memfit.config.devices import PROFILES
from memfit.memory.compose import Stack
from memfit.memory.estimate import Estimator
from memfit.memory.policies import find_blocks
from memfit.memory.search import explicit_mask
from memfit.memory.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.tracker import StepTracker
from memfit.training.loss import PlainLoss, blocks_batch

pytestmark = pytest.mark.integration
SEQ, ROWS = 64, 4


class _Packed:
    """Rows of two packed examples each, as data.packing padding_free lays them out: position_ids restart at the
    second example, and blocks_batch builds the block-diagonal mask SDPA gets."""

    name = "plain"

    def __call__(self, model, batch):
        ids = batch["input_ids"]
        pos = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).expand(ids.shape[0], SEQ)
        return PlainLoss()(model, blocks_batch(ids, slice(None), None, {"position_ids": pos, "labels": ids}, "sdpa"))


def _measured() -> int:
    model = tiny("llama")
    tracker = StepTracker(find_blocks(model))
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker.track_external(model, optimizer)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    with tracker:
        run_step(model, optimizer, [ids], "fp32", tracker, loss_fn=_Packed())
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


def test_which_runs_carry_an_explicit_mask():
    sdpa = SimpleNamespace(_attn_implementation="sdpa")
    flash = SimpleNamespace(_attn_implementation="flash_attention_2")

    def cfg(packing: str, objective: str = "sft"):
        return SimpleNamespace(data=SimpleNamespace(packing=packing), train=SimpleNamespace(objective=objective))

    assert not explicit_mask(cfg("blocks"), sdpa)  # causal blocks: is_causal, no mask
    assert explicit_mask(cfg("padding_free"), sdpa) and explicit_mask(cfg("none"), sdpa)
    assert explicit_mask(cfg("auto"), sdpa)  # resolved only from the data: counted as masked
    assert explicit_mask(cfg("blocks", "dpo"), sdpa)  # pairs padded per batch
    assert not explicit_mask(cfg("padding_free"), flash)  # varlen flash attention reads position_ids
