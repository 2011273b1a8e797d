"""PNG charts of a step's memory timeline (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_COLORS = {"parameter": "#4c72b0", "buffer": "#64b5cd", "gradient": "#8172b2", "optimizer": "#ccb974",
           "activation": "#dd8452", "recompute": "#c44e52", "temporary": "#8c8c8c", "other": "#b0b0b0"}
_PHASE_SHADE = {"forward": "#dbe9f6", "backward": "#fbe3d6", "optimizer": "#e2f0d9"}
_POLICY_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _unit(peak: float) -> tuple[float, str]:
    return (1e9, "GB") if peak >= 2e9 else (1e6, "MB")


def _save(fig: Any, path: Path) -> Path:
    """Write the figure atomically, then close it (saved or not: figures hold memory until closed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)  # never a half-written PNG under the final name
        return path
    finally:
        _plt().close(fig)


def _shade_phases(ax: Any, spans: dict[str, list[list[int]]], start: int) -> None:
    for phase, color in _PHASE_SHADE.items():
        for i, (s, e) in enumerate(spans.get(phase, [])):
            ax.axvspan(s - start, e - start, color=color, alpha=0.6, lw=0, label=phase if i == 0 else None, zorder=0)


def plot_timeline(name: str, summary: dict[str, Any], path: Path, subtitle: str = "") -> Path:
    """Stacked live bytes by category over one optimizer step, phases shaded, the peak marked."""
    plt = _plt()
    tl = summary["timeline"]
    div, unit = _unit(summary["peak_bytes"])
    fig, ax = plt.subplots(figsize=(11, 5))
    start = tl.get("start", 0)
    _shade_phases(ax, summary["spans"], start)
    cats = list(tl["categories"])
    ax.stackplot(tl["event"], *[[v / div for v in tl["categories"][c]] for c in cats],
                 labels=cats, colors=[_COLORS.get(c, "#999999") for c in cats], alpha=0.9, zorder=2)
    peak = summary["peak_at"]
    if peak is not None:
        ax.annotate(f"peak {summary['peak_bytes'] / div:.2f} {unit}\n{peak['phase']}: {peak['op']}",
                    xy=(peak["event"] - start, summary["peak_bytes"] / div), xytext=(10, -30),
                    textcoords="offset points",
                    fontsize=8, arrowprops={"arrowstyle": "->", "lw": 0.8}, zorder=3)
    ax.set_xlabel("tensor allocations and releases into the step")
    ax.set_ylabel(f"live tensor memory ({unit})")
    ax.set_title(f"memory over one training step: policy {name}" + (f"\n{subtitle}" if subtitle else ""),
                 fontsize=10)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.margins(x=0)
    fig.tight_layout()
    return _save(fig, path)


def plot_compare(summaries: dict[str, dict[str, Any]], path: Path, subtitle: str = "") -> Path:
    """Total live bytes (top) and activation bytes (bottom, saved + recomputed) of several policies."""
    plt = _plt()
    div, unit = _unit(max(s["peak_bytes"] for s in summaries.values()))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for i, (name, s) in enumerate(summaries.items()):
        color = _POLICY_COLORS[i % len(_POLICY_COLORS)]
        tl = s["timeline"]
        # No step time here: a few steps on a shared machine are no timing; bench/ measures time side by side.
        top.plot(tl["event"], [v / div for v in tl["total"]], color=color, lw=1.4,
                 label=f"{name}: peak {s['peak_bytes'] / div:.2f} {unit}")
        bottom.plot(tl["event"], [v / div for v in tl["activations"]], color=color, lw=1.4,
                    label=f"{name}: peak {s['peak_activation_bytes'] / div:.2f} {unit}")
        top.axhline(s["peak_bytes"] / div, color=color, lw=0.7, ls=":")
    top.set_ylabel(f"all live tensors ({unit})")
    bottom.set_ylabel(f"activations ({unit})\nsaved + recomputed")
    bottom.set_xlabel("tensor allocations and releases into the step (recompute makes the backward longer)")
    top.set_title("gradient checkpointing policies, one training step each" + (f"\n{subtitle}" if subtitle else ""),
                  fontsize=10)
    for ax in (top, bottom):
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
        ax.margins(x=0)
    fig.tight_layout()
    return _save(fig, path)
