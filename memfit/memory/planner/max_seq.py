"""`memfit plan --max-seq`: the longest sequence the planned stack, made lean per token, fits the budget with."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from memfit.config.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.memory.estimator.compose import Estimate, Stack
from memfit.memory.estimator.estimate import Estimator
from memfit.memory.estimator.fake_model import model_config_for
from memfit.memory.planner.plan import fit_margin
from memfit.memory.planner.search import make_estimator, plan_for, resolve_target


def longest_context_stack(cfg: Any, profile: DeviceProfile, planned: Estimate, vocab_size: int
                          ) -> tuple[Stack, tuple[str, ...]]:
    """The planned stack (precision, LoRA/quantization, micro-batch, optimizer) made as lean per token as the
    config lets it be: under memory.policy auto every block checkpointed (offloaded on a CUDA target), under
    memory.loss auto the loss a run resolves auto to (chunked for large vocabularies, as `memfit estimate`
    assumes), even where the planner chose plain at data.seq_len, and under memory.lean_layers auto the lean
    layers where the planner searches (policy or LoRA auto). Activations grow with the sequence, the
    weights do not, so that is the stack that fits the longest sequence; a fixed policy or loss is kept."""
    from memfit.memory.techniques.loss import resolve_loss

    stack, kinds = planned.stack, planned.kinds
    if cfg.memory.policy == "auto":
        kinds = ("offload" if profile.kind == "cuda" else "full",) * len(kinds)
    if cfg.memory.loss == "auto":
        stack = replace(stack, loss=resolve_loss("auto", vocab_size, cfg.distributed.world_size))
    if cfg.memory.lean_layers == "auto" and (cfg.memory.policy == "auto" or cfg.lora.enabled == "auto"):
        stack = replace(stack, lean_layers=True)  # where the planner may turn them on (off under a fixed policy)
    return stack, kinds


MAX_SEQ_STEP = 64  # --max-seq answers in multiples of this many tokens


def longest_seq_len(est: Estimator, stack: Stack, kinds: tuple[str, ...], limit: int, hi: int,
                    step: int = MAX_SEQ_STEP) -> tuple[int, Estimate | None]:
    """The longest sequence (a multiple of `step`, at most `hi`) whose estimated peak with `stack` and `kinds`
    fits `limit`, and its estimate; (0, None) if none fits.

    Each estimate traces a whole step (seconds on a large model), so the search probes where the curve through
    the last estimates crosses the limit (the peak is near a quadratic in the sequence: weights, activations
    linear in it, eager attention scores quadratic), then that guess's neighbour, which closes the bracket when
    the guess was right; after two guesses in a row that did not halve the bracket, bisection. The answer
    does not depend on the curve: the length returned fits and one step more does not (or is `hi`)."""
    peaks: dict[int, int] = {}
    fitting: dict[int, Estimate] = {}

    def fits(k: int) -> bool:
        e = est.at_seq_len(k * step).estimate(stack, kinds)
        peaks[k] = e.peak_bytes
        if e.peak_bytes <= limit:
            fitting[k] = e
        return k in fitting

    top = hi // step
    if fits(top):
        return top * step, fitting[top]
    a, b, misses = 0, top, 0  # invariant: a*step fits (or a is 0), b*step does not
    while b - a > 1:
        width = b - a
        guess = None if misses >= 2 else _crossing(peaks, limit, a, b)
        k = (a + b) // 2 if guess is None else guess
        a, b = (k, b) if fits(k) else (a, k)
        if guess is not None:
            neighbour = k + 1 if a == k else k - 1
            if a < neighbour < b:
                a, b = (neighbour, b) if fits(neighbour) else (a, neighbour)
            # Two misses in a row: the curve does not fit this estimator, bisect from here on.
            misses = 0 if b - a <= width // 2 else misses + 1
    return a * step, fitting.get(a)


def _crossing(peaks: dict[int, int], limit: int, a: int, b: int) -> int | None:
    """The largest k in (a, b) the curve through the last three estimates (two: a line) puts under `limit`."""
    import numpy as np

    if len(peaks) < 2:
        return None
    ks = list(peaks)[-3:]
    coeffs = np.polyfit(ks, [peaks[k] for k in ks], len(ks) - 1)
    coeffs[-1] -= limit
    inside = [r.real for r in np.roots(coeffs) if abs(r.imag) < 1e-9 and a < r.real < b]
    if not inside:
        return None
    return int(min(max(int(np.floor(min(inside))), a + 1), b - 1))


def max_seq_report(cfg: Any, device: str | None = None, budget_gb: float | None = None) -> dict[str, Any]:
    """`memfit plan --max-seq`: the stack the planner chooses at data.seq_len, made lean per token
    (longest_context_stack), then the longest data.seq_len it fits the budget with."""
    from memfit.config import DataConfig
    from memfit.models.loading import model_max_positions

    profile, budget, source = resolve_target(cfg, device, budget_gb)
    if budget is None:
        raise ConfigError("--max-seq needs a memory budget: set --device, --budget-gb or memory.budget_gb")
    hf_config = model_config_for(cfg)
    est = make_estimator(cfg, profile, hf_config)
    plan = plan_for(cfg, profile, budget, source, estimator=est)
    stack_est = plan.chosen or min(plan.table, key=lambda x: x.peak_bytes)
    stack, kinds = longest_context_stack(cfg, profile, stack_est, int(getattr(hf_config, "vocab_size", 0) or 0))
    limit = int(budget * (1 - fit_margin(cfg.memory.safety_margin, profile.kind)))
    hi = next(int(m.le) for m in DataConfig.model_fields["seq_len"].metadata if getattr(m, "le", None))
    t0 = time.perf_counter()
    seq, best = longest_seq_len(est, stack, kinds, limit, hi)
    stack_est = best or stack_est
    positions = model_max_positions(hf_config)
    out = {"max_seq_len": seq, "device": profile.name, "budget_bytes": budget, "budget_source": source,
           "limit_bytes": limit, "stack": plan.row(stack_est), "planned_at_seq_len": cfg.data.seq_len,
           "planned_fits": plan.fits, "model_max_positions": positions, "search_seconds": round(
               time.perf_counter() - t0, 1), "predicted_peak_bytes": best.peak_bytes if best else None,
           "breakdown": dict(best.breakdown) if best else None}
    out["note"] = (f"the model's position embeddings cover {positions} tokens: beyond that it needs RoPE scaling "
                   "(or long-context pre-training) to be useful" if positions and seq > positions else "")
    return out
