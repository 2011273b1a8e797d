"""LR schedule and RNG capture: pure functions the loop and resume depend on."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from memfit.memory.techniques.schedule import capture_rng, lr_factor, restore_rng

pytestmark = pytest.mark.unit


def test_warmup_then_cosine_to_floor():
    f = [lr_factor(s, warmup_steps=4, max_steps=20, min_ratio=0.1) for s in range(21)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False))  # non-increasing after warm-up
    assert f[20] == pytest.approx(0.1)
    assert lr_factor(100, warmup_steps=4, max_steps=20, min_ratio=0.1) == pytest.approx(0.1)


def test_no_warmup():
    assert lr_factor(0, warmup_steps=0, max_steps=10, min_ratio=0.0) == pytest.approx(1.0)


def test_rng_round_trip_is_exact_and_json_able():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    js, tensors = capture_rng()
    json.dumps(js)  # python/numpy state travels as JSON, never pickle
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(json.loads(json.dumps(js)), tensors)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_cuda_rng_is_saved_for_this_device_and_old_per_gpu_lists_still_load(monkeypatch):
    """A resume may see another number of GPUs: the state is this device's; an old list is indexed safely."""
    from memfit.checkpoints.format import rng_from_payload, rng_payload

    one = torch.arange(16, dtype=torch.uint8)
    json_state, tensors = capture_rng()
    payload = rng_payload(json_state, {**tensors, "cuda": one})
    assert "cuda_device" in payload and "cuda" not in payload
    assert torch.equal(rng_from_payload(payload)[1]["cuda"], one)
    legacy = rng_payload(json_state, {**tensors, "cuda": [one, one + 1]})  # what earlier versions wrote
    assert [t.tolist() for t in rng_from_payload(legacy)[1]["cuda"]] == [one.tolist(), (one + 1).tolist()]

    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    restore_rng(json_state, {**tensors, "cuda": one})
    restore_rng(json_state, {**tensors, "cuda": [one, one]})  # 2 GPUs saved, this is the 4th: nothing to set
    assert len(restored) == 1 and torch.equal(restored[0], one)


def test_a_skipped_fp16_step_does_not_advance_the_schedule():
    """GradScaler skips a step whose gradients overflowed; the LR schedule must not move on without it."""
    from memfit.config import TrainConfig
    from memfit.memory.techniques.optim import apply_gradients, make_adamw, make_scheduler

    model = torch.nn.Linear(4, 1)
    t = TrainConfig(max_steps=10, warmup_steps=5, lr=1e-2)
    optimizer = make_adamw(model, t.lr, t.weight_decay)
    scheduler = make_scheduler(optimizer, t)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]
    lr0 = scheduler.get_last_lr()[0]

    scaler.scale(model(torch.ones(2, 4)).sum() * 1e36).backward()  # overflows once scaled: inf gradients
    norm = apply_gradients(model, optimizer, scheduler, scaler, max_grad_norm=1.0)
    assert not torch.isfinite(norm) and scaler.get_scale() < 2.0**16
    assert scheduler.get_last_lr()[0] == lr0 and scheduler.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    scaler.scale(model(torch.ones(2, 4)).sum()).backward()  # a normal step moves both
    apply_gradients(model, optimizer, scheduler, scaler, max_grad_norm=1.0)
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr()[0] > lr0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
