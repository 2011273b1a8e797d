"""Mixed-precision LoRA without peft's fp32 copy of each adapter's input: same numbers, less memory."""

from __future__ import annotations

import pytest
import torch
from memory_support import tiny

from memfit import config
from memfit.memory.estimator.step import autocast_context
from memfit.memory.estimator.tracker import StepTracker
from memfit.models.lora import prepare_lora_model

pytestmark = pytest.mark.unit


def _step(upcast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    model = prepare_lora_model(tiny("llama", layers=2), config.LoraConfig(enabled=True, r=4), "bf16-mixed")
    if upcast:  # peft's own behaviour: every adapter input cast to the adapter's fp32
        for m in model.modules():
            if hasattr(m, "cast_input_dtype_enabled"):
                m.cast_input_dtype_enabled = True
    ids = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(4))
    tracker = StepTracker()
    tracker.track_external(model)
    with tracker:
        with autocast_context(torch.device("cpu"), "bf16-mixed"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, tracker.result().peak_bytes


def test_adapters_under_autocast_skip_the_fp32_input_copy_with_identical_results():
    loss, grads, peak = _step(upcast=False)
    loss_up, grads_up, peak_up = _step(upcast=True)
    assert torch.equal(loss, loss_up)  # autocast cast the fp32 copy straight back: the same bf16 values
    assert grads.keys() == grads_up.keys() and grads
    assert all(torch.equal(grads[n], grads_up[n]) for n in grads)
    assert peak < peak_up


def test_adapters_outside_autocast_still_cast_their_input():
    model = prepare_lora_model(tiny("llama", layers=1), config.LoraConfig(enabled=True, r=4), "bf16-mixed")
    layer = model.get_base_model().model.layers[0].self_attn.q_proj  # bf16 base, fp32 adapters
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16  # no autocast: peft casts the input for its fp32 adapters, as before
