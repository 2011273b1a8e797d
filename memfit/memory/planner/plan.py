"""The planner: pure functions from estimated candidate stacks and a budget to the stack a run uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.memory.estimator.compose import Estimate, Stack
from memfit.memory.techniques.policies import mixed_kinds

GB = 1e9
# The estimator on CUDA is a little under the caching allocator's peak, by up to 3.2 % (FACTS.md "GPU, measured
# 2026-12-04", est/real on an H200: 0.998, 0.997, 0.969, 0.993, 0.989): a CUDA target's limit keeps that much more
# free, so that a plan that fits does not OOM. Applied through fit_margin only.
CUDA_ESTIMATE_UNDER = 0.032


def fit_margin(safety_margin: float, device_kind: str) -> float:
    """The share of the budget a plan leaves free: memory.safety_margin, and on a CUDA target room on top of it for
    the estimator's measured bias (the estimate x 1.032 must fit what the safety margin leaves)."""
    if device_kind != "cuda":
        return safety_margin
    return 1.0 - (1.0 - safety_margin) / (1.0 + CUDA_ESTIMATE_UNDER)


def assignments(n: int, kinds: Sequence[str] = ("none", "selective", "full"), max_levels: int = 33
                ) -> list[tuple[str, ...]]:
    """Every way to give n blocks a kind, by count per kind (blocks of a kind spread evenly).

    `offload` only ever covers all blocks (mixing it gains nothing over full on the blocks it would skip).
    Deep models use counts in steps, at most `max_levels` per kind.
    """
    step = max(1, -(-n // (max_levels - 1)))
    levels = sorted(set(range(0, n + 1, step)) | {n})
    out: list[tuple[str, ...]] = []
    mixable = [k for k in kinds if k in ("selective", "full")]
    for full in (levels if "full" in mixable else [0]):
        for sel in (levels if "selective" in mixable else [0]):
            if full + sel > n:
                continue
            if "none" not in kinds and full + sel != n:
                continue
            out.append(tuple(mixed_kinds(n, {"full": full, "selective": sel, "none": n - full - sel})))
    if "offload" in kinds:
        out.append(("offload",) * n)
    return out


def every_k_kinds(n: int, k: int) -> tuple[str, ...]:
    return tuple("full" if i % k == 0 else "none" for i in range(n))


@dataclass(frozen=True)
class MeasuredPeak:
    """A stack that trained and was stopped at the memory limit: its measured peak against its estimate, and the
    limit (as the config sets it now) that peak passed. The planner trusts the measurement over the estimate."""

    stack: Stack
    kinds: tuple[str, ...]
    predicted_bytes: int
    measured_bytes: int
    step: int
    limit_bytes: int
    limit_source: str = "the memory limit"

    @property
    def ratio(self) -> float:
        """What the stack measured over what it was predicted to need, never below 1: a reading under the estimate
        (the first step's, before the optimizer state exists) says nothing about the steady peak, and an
        estimate is never scaled down by it (1.0 when no prediction was recorded)."""
        return max(1.0, self.measured_bytes / self.predicted_bytes) if self.predicted_bytes > 0 else 1.0

    def label(self) -> str:
        return f"{_kinds_label(self.kinds)}, {self.stack.label()}"


def measured_reason(e: Estimate, measured: Sequence[MeasuredPeak]) -> str | None:
    """Why a measurement rules candidate `e` out, or None. The stack that was stopped is out; so is every
    candidate whose estimate, scaled by what that stack measured over its own estimate, passes the limit: a
    restart must be leaner than what stopped, by as much as the measurement says, or it stops again."""
    for m in measured:
        if e.stack == m.stack and tuple(e.kinds) == m.kinds:
            return f"measured {m.measured_bytes / GB:.4g} GB at step {m.step} > limit {m.limit_bytes / GB:.4g} GB"
    for m in measured:
        scaled = e.peak_bytes * m.ratio
        if scaled > m.limit_bytes:
            return (f"{scaled / GB:.4g} GB > limit {m.limit_bytes / GB:.4g} GB, scaled by what {m.label()} "
                    f"measured ({m.ratio:.3g}x its estimate)")
    return None


@dataclass
class Plan:
    """The chosen stack (or none), the budget it was chosen for, and the table of what else was considered."""

    fits: bool
    chosen: Estimate | None
    budget_bytes: int | None
    limit_bytes: int | None
    budget_source: str
    baseline_seconds: float
    reason: str
    table: list[Estimate] = field(default_factory=list)
    error: str | None = None
    measured: Sequence[MeasuredPeak] = ()
    settled_stacks: int = 0  # stacks estimated without checkpointing only (settled())
    no_selective_stacks: int = 0  # stacks whose selective forms were not traced: every block full does not fit

    def excluded(self, e: Estimate) -> str | None:
        """Why a measured peak rules `e` out (memory.limits), or None."""
        return measured_reason(e, self.measured)

    def overhead(self, e: Estimate) -> float:
        return e.step_seconds / self.baseline_seconds - 1.0 if self.baseline_seconds > 0 else 0.0

    def fits_one(self, e: Estimate) -> bool:
        return (self.limit_bytes is None or e.peak_bytes <= self.limit_bytes) and self.excluded(e) is None

    def row(self, e: Estimate) -> dict[str, Any]:
        return {"policy": e.policy, "every_k": e.every_k, "blocks": _counts(e.kinds), "kinds": list(e.kinds),
                "precision": e.stack.precision, "micro_batch_size": e.stack.micro_batch_size,
                "grad_accum_steps": e.stack.grad_accum_steps, "lora": e.stack.lora, "quantize": e.stack.quantize,
                "loss": e.stack.loss, "optimizer": e.stack.optimizer,
                "optimizer_in_backward": e.stack.optimizer_in_backward, "lean_layers": e.stack.lean_layers,
                "weight_bytes": e.weight_bytes,
                "predicted_peak_bytes": e.peak_bytes, "predicted_activation_bytes": e.activation_bytes,
                "breakdown": dict(e.breakdown), "peak_at": e.peak_at,
                "predicted_step_seconds": round(e.step_seconds, 6),
                "predicted_overhead": round(self.overhead(e), 4), "fits": self.fits_one(e),
                **{k: e.extra[k] for k in ("reference", "reference_bytes") if k in e.extra},
                **({"excluded": why} if (why := self.excluded(e)) else {})}

    def to_dict(self) -> dict[str, Any]:
        head = self.row(self.chosen) if self.chosen is not None else {}
        head.update({"fits": self.fits, "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                     "budget_source": self.budget_source, "reason": self.reason, "error": self.error,
                     "settled_stacks": self.settled_stacks, "no_selective_stacks": self.no_selective_stacks,
                     "alternatives": [self.row(e) for e in self.table if e is not self.chosen]})
        return head


def _counts(kinds: Sequence[str]) -> dict[str, int]:
    return {k: sum(1 for x in kinds if x == k) for k in ("none", "selective", "full", "offload") if k in kinds}


def rank_key(e: Estimate, configured: Stack) -> tuple:
    """Fitting candidates are ranked: the configured precision, full fine-tuning and an unquantized base first
    (LoRA, then a 4-bit base, then another precision only when needed), then predicted step time, then less
    recompute (fewer checkpointed blocks)."""
    recompute = sum(1 for k in e.kinds if k in ("full", "offload")) * 2 + sum(1 for k in e.kinds if k == "selective")
    return (e.stack.lora and not configured.lora, e.stack.quantize != configured.quantize,
            e.stack.precision != configured.precision, round(e.step_seconds, 9), recompute,
            -e.stack.micro_batch_size)


def settled(e: Estimate, candidates: Sequence[Estimate], limit: int | None, configured: Stack,
            measured: Sequence[MeasuredPeak] = ()) -> bool:
    """Whether no checkpointing of `e`'s stack can be chosen, `e` being that stack without any: its fastest form
    (recompute and offload only add time to the step-time model, and lose ties on recompute). So when `e`
    fits, or a fitting candidate already ranks above it (rank_key), the stack's other assignments are not
    worth tracing."""
    def fits(c: Estimate) -> bool:
        return (limit is None or c.peak_bytes <= limit) and measured_reason(c, measured) is None

    if fits(e):
        return True
    key = rank_key(e, configured)
    return any(fits(c) and rank_key(c, configured)[:4] < key[:4] for c in candidates)


def _table(candidates: Sequence[Estimate], chosen: Estimate | None, limit: int | None,
           measured: Sequence[MeasuredPeak] = ()) -> list[Estimate]:
    """What to show: per stack the named policies and the fastest fitting mix, chosen first; a stack that was
    stopped at the memory limit always (the table says why it is out)."""
    shown: dict[tuple, Estimate] = {}
    fastest_mix: dict[Stack, Estimate] = {}
    stopped = {(m.stack, m.kinds) for m in measured}
    for e in candidates:
        if (e.stack, tuple(e.kinds)) in stopped:
            shown.setdefault((e.stack, e.kinds), e)
            continue
        if e.policy == "mixed":
            if (limit is None or e.peak_bytes <= limit) and measured_reason(e, measured) is None and (
                    e.stack not in fastest_mix or e.step_seconds < fastest_mix[e.stack].step_seconds):
                fastest_mix[e.stack] = e
            continue
        if e.policy == "every_k" and e.every_k not in (2, 4):
            continue
        shown.setdefault((e.stack, e.kinds), e)
    for e in fastest_mix.values():
        shown.setdefault((e.stack, e.kinds), e)
    rows = list(shown.values())
    if chosen is not None:
        rows = [chosen] + [e for e in rows if not (e.stack == chosen.stack and e.kinds == chosen.kinds)]
    return rows


def choose(candidates: Sequence[Estimate], budget_bytes: int | None, *, configured: Stack, baseline: Estimate,
           safety_margin: float = 0.05, budget_source: str = "memory.budget_gb",
           fixed_policy: str | None = None, activation_budget: int | None = None,
           measured: Sequence[MeasuredPeak] = ()) -> Plan:
    """The fastest candidate whose predicted peak fits `budget_bytes` less the safety margin.

    Never a candidate whose estimate exceeds that limit, nor one a measured peak rules out (`measured`: stacks
    stopped at the memory limit before, measured_reason); when none fits, `fits` is False and `error` says
    what the leanest candidate needs and which knob would help. `activation_budget` additionally caps the
    activations alive after the forward (the benchmark states its budgets that way).
    """
    limit = None if budget_bytes is None else int(budget_bytes * (1.0 - safety_margin))
    act_limit = None if activation_budget is None else int(activation_budget * (1.0 - safety_margin))
    fitting = [e for e in candidates if (limit is None or e.peak_bytes <= limit)
               and (act_limit is None or e.activation_bytes <= act_limit) and measured_reason(e, measured) is None]
    base_s = baseline.step_seconds
    if fitting:
        chosen = min(fitting, key=lambda e: rank_key(e, configured))
        plan = Plan(fits=True, chosen=chosen, budget_bytes=budget_bytes, limit_bytes=limit,
                    budget_source=budget_source, baseline_seconds=base_s, reason="", measured=tuple(measured))
        plan.reason = _why(plan, chosen, fixed_policy)
        plan.table = _table(candidates, chosen, limit, measured)
        return plan
    leanest = min(candidates, key=lambda e: e.peak_bytes)
    plan = Plan(fits=False, chosen=leanest if fixed_policy else None, budget_bytes=budget_bytes, limit_bytes=limit,
                budget_source=budget_source, baseline_seconds=base_s, reason="", measured=tuple(measured))
    over_budget = limit is not None and leanest.peak_bytes > limit
    why_out = measured_reason(leanest, measured)
    if why_out and not over_budget:  # the estimates fit; what the run measured does not
        plan.error = measured_out_message(leanest, why_out, measured, configured, fixed_policy)
    else:
        plan.error = nothing_fits_message(leanest, budget_bytes or 0, limit or 0, budget_source, configured)
    plan.reason = plan.error
    plan.table = _table(candidates, None, limit, measured)
    return plan


def _why(plan: Plan, e: Estimate, fixed_policy: str | None) -> str:
    budget = ("no memory budget" if plan.limit_bytes is None else
              f"{plan.limit_bytes / GB:.4g} GB usable of the {plan.budget_bytes / GB:.4g} GB budget "
              f"({plan.budget_source})")
    head = (f"memory.policy={fixed_policy} set in the config" if fixed_policy
            else f"fastest stack that fits: {describe(e)}")
    stopped = "".join(f"; leaner than {m.label()}, which measured {m.measured_bytes / GB:.4g} GB at step {m.step} "
                      f"> limit {m.limit_bytes / GB:.4g} GB ({m.limit_source})" for m in plan.measured)
    ranks = e.extra.get("ranks")
    per = "" if ranks is None else (f" per rank ({ranks['strategy']}: {e.stack.micro_batch_size // ranks['world_size']}"
                                    f" of each micro-batch's {e.stack.micro_batch_size} rows on each of "
                                    f"{ranks['world_size']} ranks)")
    return (f"{head}; predicted peak {e.peak_bytes / GB:.4g} GB{per} vs {budget}; predicted step "
            f"{e.step_seconds:.3g} s, {plan.overhead(e) * 100:+.1f}% vs the configured stack without "
            f"checkpointing{stopped}")


def plan_table_markdown(plan: Plan) -> str:
    """The candidate table, chosen first, as Markdown (MLflow artifact, Prefect artifact, CLI)."""
    rows = ["| | policy | blocks | precision | micro x accum | LoRA | loss / optimizer | peak GB | activations GB | "
            "step s | overhead | fits |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in plan.table:
        r = plan.row(e)
        blocks = ", ".join(f"{v} {k}" for k, v in r["blocks"].items())
        policy = f"every_k (k={e.every_k})" if e.policy == "every_k" else e.policy
        mark = "**chosen**" if e is plan.chosen else ""
        rows.append(f"| {mark} | {policy} | {blocks} | {e.stack.precision} | {e.stack.micro_batch_size} x "
                    f"{e.stack.grad_accum_steps} | {_lora_cell(e.stack)} | {_technique_cell(e.stack)} | "
                    f"{e.peak_bytes / GB:.4g} | "
                    f"{e.activation_bytes / GB:.4g} | {e.step_seconds:.3g} | {r['predicted_overhead'] * 100:+.1f}% | "
                    f"{'yes' if r['fits'] else 'no: ' + r['excluded'] if 'excluded' in r else 'no'} |")
    if plan.settled_stacks:
        rows.append(f"\n{plan.settled_stacks} stack(s) estimated without checkpointing only: each was already "
                    "slower than a stack that fits, or fitted as it was, so no recompute could make it the choice")
    if plan.no_selective_stacks:
        rows.append(f"\n{plan.no_selective_stacks} stack(s) without a selective row: not even every block fully "
                    "checkpointed fits, and selective keeps more than full in every block")
    chosen = plan.chosen or (plan.table[0] if plan.table else None)
    if chosen is not None and "reference" in chosen.extra:  # train.objective dpo: the rows are pairs x 2
        held = chosen.extra["reference_bytes"]
        counted = [f"+{held / GB:.4g} GB of its weights"] if held else []
        if chosen.extra["reference"] in ("adapter_off", "copy"):
            counted.append("its no-grad forward traced in the step")
        rows.append(f"\ndpo: micro-batches of pairs (chosen + rejected: 2 rows each); reference counted: "
                    f"{chosen.extra['reference_why']}" + (f" ({'; '.join(counted)})" if counted else ""))
    return "\n".join(rows)


def _technique_cell(stack: Stack) -> str:
    return (f"{stack.loss} / {stack.optimizer}" + (", step in backward" if stack.optimizer_in_backward else "")
            + (", lean layers" if stack.lean_layers else ""))


def _lora_cell(stack: Stack) -> str:
    return ("NF4 base" if stack.quantize == "nf4" else "yes") if stack.lora else "no"


def describe(e: Estimate) -> str:
    what = _kinds_label(e.kinds)
    if e.policy == "every_k":
        what = f"every_k (k={e.every_k})"
    return f"{what}, {e.stack.label()}"


def _kinds_label(kinds: Sequence[str]) -> str:
    counts = _counts(kinds)
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed (" + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")"


def measured_out_message(leanest: Estimate, why: str, measured: Sequence[MeasuredPeak], configured: Stack,
                         fixed_policy: str | None) -> str:
    """One line for a restart with no leaner stack left: the measured peak that stopped the run, and what to change."""
    m = measured[-1]
    head = (f"memory.policy={fixed_policy}: {describe(leanest)} {why}" if fixed_policy else
            f"no leaner stack left: {m.label()} measured {m.measured_bytes / GB:.4g} GB at step {m.step} > limit "
            f"{m.limit_bytes / GB:.4g} GB ({m.limit_source}), and the leanest candidate, {describe(leanest)}, "
            f"is out too ({why})")
    hints = (["memory.policy=auto lets the planner pick a leaner stack"] if fixed_policy else []) + \
        _hints(leanest) + ["monitor.stop_at_fraction closer to 1.0"]
    return f"{head}. What would help: " + "; ".join(hints)


def held_weights(e: Estimate) -> int:
    """The weights one process holds, or with several ranks one rank (its share where the strategy splits them)."""
    return e.breakdown["params"] if "ranks" in e.extra else e.weight_bytes


def nothing_fits_message(leanest: Estimate, budget: int, limit: int, source: str, configured: Stack) -> str:
    b = leanest.breakdown
    field_name = "memory.budget_gb" if source == "memory.budget_gb" else f"the budget ({source})"
    if held_weights(leanest) > budget:
        lean = ("" if leanest.stack.quantize != "none" else
                "; lora.enabled=auto with lora.quantize=nf4 lets the planner hold the frozen base in 16 or 4 bits"
                if not leanest.stack.lora else "; lora.quantize=nf4 holds the frozen base in 4 bits")
        return (f"{field_name}: {budget / GB:.4g} GB is below the model's weights alone "
                f"({leanest.weight_bytes / GB:.4g} GB for {leanest.n_params:,} parameters){lean}; raise "
                "memory.budget_gb or pick a larger memory.device")
    return (f"{field_name}: no stack fits {budget / GB:.4g} GB ({limit / GB:.4g} GB after the safety margin). "
            f"The leanest, {describe(leanest)}, needs {leanest.peak_bytes / GB:.4g} GB at its peak "
            f"({leanest.peak_at}): params {b['params'] / GB:.3g}, grads {b['grads'] / GB:.3g}, optimizer "
            f"{b['optimizer'] / GB:.3g}, activations {b['activations'] / GB:.3g}, other {b['other'] / GB:.3g} GB. "
            "What would help: " + "; ".join(_hints(leanest)))


def _hints(leanest: Estimate) -> list[str]:
    """The knobs that would make the leanest candidate leaner still, the biggest share of its peak first."""
    b = leanest.breakdown
    weights_etc = b["params"] + b["grads"] + b["optimizer"]
    hints = []
    if weights_etc > 0.5 * leanest.peak_bytes:
        if not leanest.stack.lora:
            hints.append("lora.enabled=true (or auto) trains adapters only: no full gradients or optimizer state")
        elif leanest.stack.quantize == "none":
            hints.append("lora.quantize=nf4 holds the frozen base in 4 bits (QLoRA)")
        if leanest.stack.precision != "bf16-true":
            hints.append("train.precision=bf16-true (or memory.allow_precisions: [bf16-true]) halves weights "
                         "and optimizer state")
    else:
        hints.append("a shorter data.seq_len or a smaller train.batch_size cuts activations")
        if leanest.stack.micro_batch_size > 1:
            hints.append("memory.allow_smaller_micro_batch=true lets the planner accumulate smaller micro-batches")
    hints.append("a larger memory.budget_gb / memory.device")
    return hints
