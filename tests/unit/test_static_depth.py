"""The full-depth weights/optimizer trace extrapolated from depths 1-3 of a model whose blocks are alike."""

from __future__ import annotations

import pytest

from memfit.memory.estimator.compose import StaticTrace, extrapolate_static

pytestmark = pytest.mark.unit


def _trace(depth: int, per_block: int, fixed: int = 1000, opt_other: int = 64) -> StaticTrace:
    vec = {"params": fixed + depth * per_block, "grads": depth * per_block, "optimizer": 2 * depth * per_block,
           "activations": 0, "other": 0}
    after = dict(vec, grads=0)
    peak = dict(vec, other=opt_other)
    return StaticTrace(n_blocks=depth, before_opt=vec, after_opt=after, opt_peak=peak, opt_seconds=0.1 * depth,
                       n_params=fixed // 4 + depth * per_block // 4, n_trainable=depth * per_block // 4,
                       weight_bytes=fixed + depth * per_block, host_bytes=0)


def test_linear_growth_extrapolates_to_the_same_trace_a_full_depth_build_gives():
    shallow = [_trace(d, per_block=400) for d in (1, 2, 3)]
    full = extrapolate_static(shallow, 48)
    expected = _trace(48, per_block=400)
    assert full is not None
    assert (full.before_opt, full.after_opt, full.opt_peak) == (expected.before_opt, expected.after_opt,
                                                                expected.opt_peak)
    assert (full.n_blocks, full.n_params, full.n_trainable, full.weight_bytes) == (48, expected.n_params,
                                                                                  expected.n_trainable,
                                                                                  expected.weight_bytes)
    assert full.opt_seconds == pytest.approx(4.8)


def test_growth_that_is_not_per_block_refuses_to_extrapolate():
    """A one-byte difference between the growth 1->2 and 2->3 (a buffer that appears with depth): None, so the
    estimator traces at full depth instead of guessing."""
    a, b, c = (_trace(d, per_block=400) for d in (1, 2, 3))
    c.before_opt = dict(c.before_opt, params=c.before_opt["params"] + 1)
    assert extrapolate_static([a, b, c], 48) is None
    a, b, c = (_trace(d, per_block=400) for d in (1, 2, 3))
    c.opt_peak = dict(c.opt_peak, other=65)  # the optimizer's scratch grows, but not as the blocks do
    assert extrapolate_static([a, b, c], 48) is None
