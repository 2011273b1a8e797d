"""ONNX parity verdicts on synthetic logits: rounding-sized differences pass, a different computation fails."""

from __future__ import annotations

import re

import numpy as np
import pytest

from memfit.release.parity import NOISE_RELATIVE, ParityCriteria, parity_failure, shape_parity


def _logits(batch=2, seq=16, vocab=500, scale=20.0, seed=0):
    x = np.random.default_rng(seed).standard_normal((batch, seq, vocab)).astype(np.float32)
    return x * (scale / np.abs(x).max())


def _noisy(ref, relative, seed=1):
    noise = np.random.default_rng(seed).uniform(-1, 1, ref.shape).astype(np.float32)
    return ref + noise * relative * np.abs(ref).max()


def test_figures_of_identical_and_shifted_logits():
    ref = _logits()
    same = shape_parity(ref, ref.copy())
    assert same.max_abs_diff == 0 and same.max_kl == 0 and same.top1_agree == same.positions == 32
    assert same.max_abs_logit == pytest.approx(20.0)
    # A constant shift of every logit leaves the softmax (KL) and the arg-max unchanged.
    shifted = shape_parity(ref, ref + 3.0)
    assert shifted.max_abs_diff == pytest.approx(3.0, rel=1e-5) and shifted.relative == pytest.approx(0.15, rel=1e-4)
    assert shifted.max_kl < 1e-9 and shifted.top1_agree == 32


def test_the_fp32_rounding_of_a_pretrained_135m_model_passes():
    """Issue 12: 1.87e-4 at |logits| ~ 20 failed the old absolute 1e-4 limit; it is rounding and must pass."""
    ref = _logits()
    got = _noisy(ref, 1.87e-4 / 20.0)
    fig = shape_parity(ref, got)
    assert fig.max_abs_diff > 1e-4  # what the old atol rejected
    assert parity_failure("m.onnx", [fig], ParityCriteria()) is None


def test_a_different_computation_fails_with_figures_and_meaning():
    ref = _logits(seed=0)
    shapes = [shape_parity(ref, _noisy(ref, 1e-6)), shape_parity(ref, _noisy(ref, 0.02, seed=3))]
    msg = parity_failure("out/model.onnx", shapes, ParityCriteria())
    assert msg is not None and "\n" not in msg
    assert msg.startswith("ONNX parity failed for out/model.onnx: ")
    assert "export.onnx_rtol = 0.0005" in msg and "at shape (batch=2, seq=16)" in msg
    rel = float(re.search(r", ([0-9.e+-]+) of max \|logit\|", msg).group(1))
    assert rel == pytest.approx(shapes[1].relative, rel=0.05) and rel > 100 * NOISE_RELATIVE
    assert "the ONNX graph computes something else, not float rounding" in msg
    assert "per shape: 2x16: rel" in msg


def test_kl_and_top1_are_criteria_of_their_own():
    ref = _logits(seed=4)
    got = ref.copy()
    got[..., 0] = ref.max() + 1.0  # token 0 wins everywhere: a wrong output, though only one logit column moved
    fig = shape_parity(ref, got)
    msg = parity_failure("m.onnx", [fig], ParityCriteria(rtol=10.0))  # max-diff switched off
    assert "top-1 agreement" in msg and "below export.onnx_min_top1 = 95%" in msg
    assert "max KL(PyTorch || ONNX)" in msg and "export.onnx_max_kl" in msg
    assert "max |onnxruntime - PyTorch|" not in msg


def test_near_ties_may_flip_within_the_top1_fraction():
    ref = _logits(batch=4, seq=25, seed=5)
    got = ref.copy()
    # One position of 100 with its top two logits tied to 1e-6: rounding picks either.
    b, s = 1, 7
    top2 = np.argsort(ref[b, s])[-2:]
    got[b, s, top2[0]], got[b, s, top2[1]] = ref[b, s, top2[1]], ref[b, s, top2[1]] - 1e-6
    ref[b, s, top2[0]] = ref[b, s, top2[1]] - 1e-6
    fig = shape_parity(ref, got)
    assert fig.top1_agree == 99
    assert parity_failure("m.onnx", [fig], ParityCriteria()) is None


def test_nan_logits_fail():
    ref = _logits()
    got = ref.copy()
    got[0, 0, 0] = np.nan
    msg = parity_failure("m.onnx", [shape_parity(ref, got)], ParityCriteria())
    assert msg is not None and "nan" in msg.lower() and "computes something else" in msg


def test_limits_below_rounding_are_called_that():
    ref = _logits()
    fig = shape_parity(ref, _noisy(ref, 2e-6))
    msg = parity_failure("m.onnx", [fig], ParityCriteria(rtol=1e-7, atol=0.0))
    assert "within float rounding" in msg and "raise the export.onnx_* field named" in msg
