"""PNG figures for a run's review: the loss curve and the memory breakdown (matplotlib, Agg, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GB = 1e9


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: never look for a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(out)
    return out


def loss_curve(train: list[tuple[int, float]], val: list[tuple[int, float]], out: str | Path,
               title: str = "loss") -> Path:
    """Training loss per optimizer step (line) and validation loss (points), on one axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], lw=1.2, label="train loss")
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o--", ms=5, label="validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        return _save(fig, Path(out))
    finally:
        plt.close(fig)


def memory_breakdown(baseline: dict[str, Any] | None, per_step: list[tuple[int, float]], out: str | Path,
                     plan: dict[str, Any] | None = None) -> Path:
    """Left: the baseline probe's peak split by kind against the budget. Right: peak memory per step."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        breakdown = {k: v for k, v in ((baseline or {}).get("breakdown") or {}).items() if v}
        if breakdown:
            names = list(breakdown)
            values = [breakdown[n] / GB for n in names]
            bottom = 0.0
            for name, value in zip(names, values, strict=True):
                left.bar(["plain step"], [value], bottom=bottom, label=name)
                bottom += value
        elif baseline and baseline.get("peak_bytes"):
            left.bar(["plain step"], [baseline["peak_bytes"] / GB], label="peak")
        budget = (baseline or {}).get("budget_bytes")
        if budget:
            left.axhline(budget / GB, color="red", ls="--", label="budget")
        left.set_ylabel("GB")
        policy = (plan or {}).get("policy")
        left.set_title("baseline probe: peak by kind" + (f"\n(plan: {policy})" if policy else ""))
        if left.get_legend_handles_labels()[0]:
            left.legend(fontsize=8)
        if per_step:
            right.plot([s for s, _ in per_step], [v / GB for _, v in per_step], lw=1.2)
        right.set_xlabel("optimizer step")
        right.set_ylabel("GB")
        right.set_title("peak memory per step (GPU allocator, or process RSS on CPU)")
        right.grid(alpha=0.3)
        return _save(fig, Path(out))
    finally:
        plt.close(fig)
