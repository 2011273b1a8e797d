"""Turning one step's timeline into figures: peaks, per-phase and per-module tables, a compact curve."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from memfit.memory.estimator.timeline import ACTIVATION_CATEGORIES, CATEGORIES, StepTimeline

MB = 1e6
TOP_LEVEL = "(top level)"
_TEMPORARY = ("temporary", "recompute", "other")


def module_rows(model: nn.Module) -> dict[str, str]:
    """Every module's name → the table row it is reported in: one row per block of a layer stack.

    The "trunk" is every module that is or holds a ModuleList (the model, its decoder, the layer list);
    a module is reported under its first ancestor off the trunk: `model.layers.3.mlp.up_proj` under
    `model.layers.3`, `lm_head` under itself. Work done in a trunk module's own forward (masks, the loss)
    stays in that module's row; the root's is "(top level)".
    """
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    trunk: set[str] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            parts = name.split(".") if name else []
            trunk.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    rows: dict[str, str] = {}
    for name in names.values():
        parts = name.split(".") if name else []
        row = name
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in trunk:
                row = prefix
                break
        rows[name] = row or TOP_LEVEL
    rows.setdefault("", TOP_LEVEL)
    return rows


def _row(rows: dict[str, str], module: str) -> str:
    if module in rows:
        return rows[module]
    # A name ModTracker made for a module reached twice (tied or shared): report it under its nearest known parent.
    parts = module.split(".")
    while parts:
        parts.pop()
        if ".".join(parts) in rows:
            return rows[".".join(parts)]
    return TOP_LEVEL


def _bytes_by_row(model: nn.Module, rows: dict[str, str], nbytes_of: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:  # tied weights count once, under their first owner
                seen.add(id(p))
                out[_row(rows, mod_name)] += nbytes_of(p)
    return out


def summarize(tl: StepTimeline, model: nn.Module, optimizer: Any, max_points: int = 3000) -> dict[str, Any]:
    """The figures of one classified timeline (see `StepTimeline.classify`), JSON-able."""
    curves = tl.curves()
    total = curves["total"]
    act = [a + r for a, r in zip(curves["activation"], curves["recompute"], strict=True)]
    n = len(total)
    peak_i = max(range(n), key=total.__getitem__) if n else 0
    peak_rec = tl.allocs[abs(tl.events[peak_i]) - 1] if n else None
    fw_end = tl.forward_spans[0][1] if tl.forward_spans else 0
    after_fw = {c: 0 for c in CATEGORIES}
    for r in tl.live_at(fw_end):
        after_fw[r.category] += r.nbytes

    def span_peak(spans: list[list[int]]) -> int:
        return max((max(total[s:e], default=0) for s, e in spans if e > s), default=0)

    return {
        "peak_bytes": max(total, default=0),
        "peak_activation_bytes": max(act, default=0),
        "activation_bytes_after_forward": after_fw["activation"],
        "at_peak": {c: curves[c][peak_i] for c in CATEGORIES} if n else {},
        "after_forward": after_fw,
        "peak_at": ({"event": peak_i, "phase": peak_rec.phase, "op": peak_rec.op, "module": peak_rec.module or
                     TOP_LEVEL} if peak_rec is not None else None),
        "phase_peaks": {"forward": span_peak(tl.forward_spans), "backward": span_peak(tl.backward_spans),
                        "optimizer": span_peak(tl.optimizer_spans)},
        "allocated_bytes": {c: sum(r.nbytes for r in tl.allocs if r.category == c and r.phase != "before")
                            for c in CATEGORIES},
        "events": n,
        "spans": {"forward": tl.forward_spans, "backward": tl.backward_spans, "optimizer": tl.optimizer_spans},
        "largest_allocations": [
            {"bytes": r.nbytes, "op": r.op, "module": r.module or TOP_LEVEL, "phase": r.phase, "category": r.category}
            for r in sorted((r for r in tl.allocs if r.phase != "before"), key=lambda r: -r.nbytes)[:10]],
        "modules": module_table(tl, model, optimizer),
        # The step starts after the state adopted before it (parameters, optimizer state): a flat baseline.
        "timeline": downsample(curves, max_points, start=max(0, sum(r.phase == "before" for r in tl.allocs) - 1)),
    }


def module_table(tl: StepTimeline, model: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
    """Per row (see `module_rows`): parameters, gradients, optimizer state, activations left by the first
    forward, bytes recomputed in the first backward, the peak of its temporaries, and the step's peak
    total while its forward and its backward ran."""
    rows = module_rows(model)
    params = _bytes_by_row(model, rows, lambda p: p.untyped_storage().nbytes())
    grad_b = _bytes_by_row(model, rows, lambda p: tl.grad_nbytes.get(id(p), 0))
    state = getattr(optimizer, "state", {})
    # Only what lives beside the parameter: the CPU-offloaded AdamW's moments are host memory.
    opt_b = _bytes_by_row(model, rows, lambda p: sum(v.untyped_storage().nbytes() for v in state.get(p, {}).values()
                                                     if isinstance(v, torch.Tensor) and v.device == p.device))
    fw_end = tl.forward_spans[0][1] if tl.forward_spans else 0
    bw0 = tl.backward_spans[0] if tl.backward_spans else [0, 0]
    act: dict[str, int] = defaultdict(int)
    for r in tl.live_at(fw_end, ("activation",)):
        act[_row(rows, r.module)] += r.nbytes
    recomputed: dict[str, int] = defaultdict(int)
    fw_peak: dict[str, int] = defaultdict(int)
    bw_peak: dict[str, int] = defaultdict(int)
    temp_live: dict[str, int] = defaultdict(int)
    temp_peak: dict[str, int] = defaultdict(int)
    total = 0
    for ev in tl.events:
        r = tl.allocs[abs(ev) - 1]
        row = _row(rows, r.module)
        total += r.nbytes if ev > 0 else -r.nbytes
        if r.category in _TEMPORARY and r.phase != "before":
            temp_live[row] += r.nbytes if ev > 0 else -r.nbytes
            temp_peak[row] = max(temp_peak[row], temp_live[row])
        if ev <= 0:
            continue
        if r.phase == "forward":
            fw_peak[row] = max(fw_peak[row], total)
        elif r.phase in ("backward", "recompute"):
            bw_peak[row] = max(bw_peak[row], total)
        if r.phase == "recompute" and bw0[0] <= r.born < bw0[1]:
            recomputed[row] += r.nbytes
    order = list(dict.fromkeys([*rows.values(), TOP_LEVEL]))
    table = []
    for row in order:
        figures = {"params_bytes": params.get(row, 0), "grads_bytes": grad_b.get(row, 0),
                   "optimizer_bytes": opt_b.get(row, 0), "activation_bytes": act.get(row, 0),
                   "recomputed_bytes": recomputed.get(row, 0), "temporary_peak_bytes": temp_peak.get(row, 0),
                   "forward_peak_bytes": fw_peak.get(row, 0), "backward_peak_bytes": bw_peak.get(row, 0)}
        if any(figures.values()):
            table.append({"module": row, **figures})
    return table


def downsample(curves: dict[str, list[int]], max_points: int, start: int = 0) -> dict[str, Any]:
    """At most `max_points` samples from event `start` on (renumbered from 0; spans and `peak_at` keep the
    original numbering), each bucket represented by its highest total, so peaks survive."""
    total = curves["total"]
    n = len(total)
    step = max(1, -(-(n - start) // max_points))
    idx = [max(range(s, min(s + step, n)), key=total.__getitem__) for s in range(start, n, step)]
    keep = [c for c in CATEGORIES if any(curves[c])]
    return {"event": [i - start for i in idx], "start": start, "total": [total[i] for i in idx],
            "categories": {c: [curves[c][i] for i in idx] for c in keep},
            "activations": [sum(curves[c][i] for c in ACTIVATION_CATEGORIES) for i in idx]}


def markdown(name: str, description: str, summary: dict[str, Any]) -> str:
    """One policy's section of modules.md: headline figures, then the per-module table (MB)."""
    s = summary
    peak = f"- peak: **{s['peak_bytes'] / MB:.2f} MB**"
    if s.get("peak_at"):
        peak += f" ({s['peak_at']['phase']}, `{s['peak_at']['op']}` in `{s['peak_at']['module']}`)"
    if s.get("predicted_peak_bytes"):
        peak += f"; the planner predicted {s['predicted_peak_bytes'] / MB:.2f} MB"
    lines = [f"## policy `{name}`", "", description, "", peak,
             (f"- peak activation memory (saved + recomputed): **{s['peak_activation_bytes'] / MB:.2f} MB**; "
              f"activations alive after the first forward: {s['activation_bytes_after_forward'] / MB:.2f} MB"),
             "- phase peaks: " + ", ".join(f"{k} {v / MB:.2f} MB" for k, v in s["phase_peaks"].items()), ""]
    cols = [("params_bytes", "params"), ("grads_bytes", "grads"), ("optimizer_bytes", "optimizer"),
            ("activation_bytes", "activations"), ("recomputed_bytes", "recomputed"),
            ("temporary_peak_bytes", "temporaries (peak)"), ("forward_peak_bytes", "fwd peak"),
            ("backward_peak_bytes", "bwd peak")]
    lines.append("| module | " + " | ".join(c[1] for c in cols) + " |")
    lines.append("|---|" + "---:|" * len(cols))
    for row in s["modules"]:
        lines.append(f"| `{row['module']}` | " + " | ".join(f"{row[k] / MB:.3f}" for k, _ in cols) + " |")
    sums = {k: sum(r[k] for r in s["modules"]) for k, _ in cols[:5]}
    lines.append("| **sum** | " + " | ".join(f"**{sums[k] / MB:.3f}**" for k, _ in cols[:5]) + " | | | |")
    lines.append("")
    return "\n".join(lines)


def _per_rank(out: dict[str, Any]) -> str:
    ranks = out.get("ranks")
    return "" if ranks is None else f" per rank ({ranks['strategy']} on {ranks['world_size']} ranks)"


def estimate_text(out: dict[str, Any]) -> str:
    """Pure: `memfit estimate`'s report (memory.search.estimate_report) as the lines a person reads."""
    gb = 1e9
    lines = [f"{out['policy']} on {out['device']}, {out['precision']}, micro-batch {out['micro_batch_size']} x "
             f"{out['grad_accum_steps']} x {out['seq_len']} tokens{', LoRA' if out['lora'] else ''}: "
             f"peak {out['total_bytes'] / gb:.3f} GB{_per_rank(out)} ({out['peak_at']})"]
    lines += [f"  {k:<12} {v / gb:10.3f} GB" for k, v in out["breakdown"].items()]
    if out["budget_bytes"] is not None:
        lines.append(f"  budget {out['budget_bytes'] / gb:.3f} GB ({out['budget_source']}): "
                     f"{'fits' if out['fits'] else 'does NOT fit'}")
    active = "" if out["experts"] is None else (
        f", {_count(out['params_active'])} active per token ({out['experts']['per_token']} of "
        f"{out['experts']['routed']} routed experts; routed activations booked as tokens x top-k rows, which "
        f"grouped_mm holds however the router spreads them)")
    lines.append(f"  parameters: {_count(out['params_total'])}{active}")
    if (dpo := out.get("dpo")) is not None:
        read = "the data's longest pair" if dpo["pairs_read"] else "data.seq_len: the pairs or their tokenizer unread"
        head = "every position" if dpo["logits_keep"] is None else f"the last {dpo['logits_keep']} positions"
        passes = "" if dpo["coverage"] is None else f"; the steps go over the training pairs {dpo['coverage']:.2f}x"
        lines.append(f"  dpo: {dpo['pairs']} pair{'s' if dpo['pairs'] != 1 else ''} a micro-batch ({dpo['rows']} "
                     f"rows of {dpo['row_tokens']} tokens, {read}), the head on {head}{passes}")
        lines.append(f"  reference: {dpo['reference_why']}")
    for row in out["adapter_rows"]:
        fits = "" if row["fits"] is None else (": fits" if row["fits"] else ": does NOT fit")
        lines.append(f"  {row['stack']:<17} peak {row['peak_bytes'] / gb:8.3f} GB, weights "
                     f"{row['weight_bytes'] / gb:.3f} GB, {row['n_trainable'] / 1e6:.1f} M trainable{fits}")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"

