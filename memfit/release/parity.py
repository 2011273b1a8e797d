"""ONNX-vs-PyTorch logits parity: figures per shape and a verdict that tells float rounding from a wrong graph."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

# The largest fp32 rounding seen: relative 9.4e-6 is issue 12's pretrained 135 M Llama (1.87e-4 at
# |logits| ~ 20); random-init models with logits at that scale stay below 1.3e-6 and KL 4e-11
# (bench/onnx_parity.py). KL grows with the square of the rounding, so 1e-8 covers the pretrained model.
# A failing figure this many times above them is not rounding.
NOISE_RELATIVE = 1e-5
NOISE_KL = 1e-8
_NOT_NOISE = 10.0


@dataclass(frozen=True)
class ParityCriteria:
    """The limits an ONNX export must meet at every verification shape (ExportConfig's onnx_* fields)."""

    rtol: float = 5e-4
    atol: float = 1e-4
    min_top1: float = 0.95
    max_kl: float = 1e-5

    def tolerance(self, max_abs_logit: float) -> float:
        """The absolute bound on max |diff| for logits of this magnitude."""
        return self.atol + self.rtol * max_abs_logit


@dataclass(frozen=True)
class ShapeParity:
    """How onnxruntime's logits compare with PyTorch's at one (batch, seq)."""

    batch: int
    seq: int
    max_abs_diff: float
    max_abs_logit: float
    relative: float  # max_abs_diff / max_abs_logit
    top1_agree: int  # positions whose arg-max token is the same
    positions: int
    max_kl: float  # max over positions of KL(softmax PyTorch || softmax ONNX), in nats

    def to_dict(self) -> dict:
        return asdict(self)


def shape_parity(ref: np.ndarray, got: np.ndarray) -> ShapeParity:
    """Figures for PyTorch logits `ref` and onnxruntime logits `got`, both (batch, seq, vocab)."""
    batch, seq = int(ref.shape[0]), int(ref.shape[1])
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    diff = float(np.abs(got64 - ref64).max())
    scale = float(np.abs(ref64).max())
    # float64 log-softmax: at fp32 the KL of two near-equal distributions is itself rounding noise.
    log_p, log_q = _log_softmax(ref64), _log_softmax(got64)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).max())
    agree = int((ref64.argmax(-1) == got64.argmax(-1)).sum())
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return ShapeParity(batch, seq, diff, scale, rel, agree, batch * seq, max(kl, 0.0))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _bad(value: float, limit: float, above: bool = True) -> bool:
    # NaN in the logits must fail: `not value <= limit` is true for NaN.
    return not value <= limit if above else not value >= limit


def parity_failure(label: str, shapes: list[ShapeParity], c: ParityCriteria) -> str | None:
    """None when every shape meets `c`; else one line: the criteria broken, their figures, what it means."""
    worst_diff = max(shapes, key=lambda p: _nan_high(p.max_abs_diff - c.tolerance(p.max_abs_logit)))
    worst_kl = max(shapes, key=lambda p: _nan_high(p.max_kl))
    agree, positions = sum(p.top1_agree for p in shapes), sum(p.positions for p in shapes)
    top1 = agree / positions
    broken, noise = [], []  # the criteria not met; each one's figure as a multiple of fp32 rounding
    tol = c.tolerance(worst_diff.max_abs_logit)
    if _bad(worst_diff.max_abs_diff, tol):
        broken.append(f"max |onnxruntime - PyTorch| = {worst_diff.max_abs_diff:.3g} at shape "
                      f"{_shape(worst_diff)}, {worst_diff.relative:.2g} of max |logit| "
                      f"{worst_diff.max_abs_logit:.3g}, exceeds export.onnx_rtol = {c.rtol:g} "
                      f"(+ onnx_atol {c.atol:g}: {tol:.3g})")
        noise.append(worst_diff.relative / NOISE_RELATIVE)
    if _bad(worst_kl.max_kl, c.max_kl):
        broken.append(f"max KL(PyTorch || ONNX) = {worst_kl.max_kl:.3g} nats at shape {_shape(worst_kl)} "
                      f"exceeds export.onnx_max_kl = {c.max_kl:g}")
        noise.append(worst_kl.max_kl / NOISE_KL)
    if _bad(top1, c.min_top1, above=False):
        broken.append(f"top-1 agreement {agree}/{positions} = {top1:.1%} is below export.onnx_min_top1 = "
                      f"{c.min_top1:.0%}")
        noise.append(math.inf)  # rounding flips only near-ties, never this many
    if not broken:
        return None
    per_shape = ", ".join(f"{p.batch}x{p.seq}: rel {p.relative:.2g}, KL {p.max_kl:.2g}, top-1 "
                          f"{p.top1_agree}/{p.positions}" for p in shapes)
    rounding = f"fp32 rounding reaches {NOISE_RELATIVE:g} relative and KL {NOISE_KL:g}"
    if any(not n < _NOT_NOISE for n in noise):
        meaning = f"the ONNX graph computes something else, not float rounding ({rounding})"
    else:
        meaning = (f"this is within float rounding ({rounding}): the limits are tighter than fp32 noise, "
                   "raise the export.onnx_* field named")
    return f"ONNX parity failed for {label}: {'; '.join(broken)}: {meaning} (per shape: {per_shape})."


def _shape(p: ShapeParity) -> str:
    return f"(batch={p.batch}, seq={p.seq})"


def _nan_high(x: float) -> float:
    return math.inf if x != x else x
