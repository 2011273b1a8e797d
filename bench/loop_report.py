"""bench/loop_overhead.py's report: the ratios per turn pair, where memfit's time goes, the table and the plot."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
THREADS = 2  # torch threads of every loop, in every variant


def breakdown(r: dict, warmup: int) -> dict[str, float]:
    """memfit-full's time per timed step, by part (seconds); the parts add up to the measured period."""
    steps = r["step_s"]
    timed = range(len(steps) - r["steps"], len(steps))  # indices of the timed steps (step number = index + 1)
    counted = set(r["counted"])
    after_save = {s + k for s in r["saved_at"] for k in (1, 2)}
    clean = [steps[i] for i in timed if i + 1 not in counted and i + 1 not in after_save]
    base = statistics.median(clean)
    n = len(timed)
    monitor_step = sum(steps[i] - base for i in timed if i + 1 in counted)
    interference = sum(steps[i] - base for i in timed if i + 1 in after_save and i + 1 not in counted)
    # Whole-run totals, scaled to the timed share of the steps.
    share = n / len(steps)
    parts = {"step (median, clean steps)": base,
             "monitor: dispatch-mode step": monitor_step / n,
             "monitor: reading": r["monitor_read_s"] * share / n,
             "save: snapshot + hand-off": r["save_call_s"] * share / n,
             "save: background write interference (2 steps)": interference / n,
             "log: MLflow flush before a save": r["flush_s"] * share / n,
             "log: metric calls": r["log_caller_s"] * share / n}
    parts["rest of the loop"] = r["seconds"] / n - sum(parts.values())
    return parts


def spread(vals: list[float]) -> str:
    """median (quartiles; range) of ratios."""
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else vals * 3
    return f"{statistics.median(vals):.3f}x ({q[0]:.3f}-{q[2]:.3f}; {min(vals):.3f}-{max(vals):.3f})"


def print_table(args: argparse.Namespace, loops: list[str], variants: list[str], results: dict[str, list[dict]]
                ) -> None:
    def blocks(mode: str) -> list[float]:
        return [x for r in results[mode] for x in r["blocks"]]

    def med(mode: str) -> float:  # seconds per step: the median turn
        return statistics.median(blocks(mode))

    def cpu(mode: str) -> float:  # CPU seconds per step: the median round (whole timed span, waits included)
        return statistics.median(r["cpu_seconds"] / r["steps"] for r in results[mode])

    def pairs(a: str, b: str) -> list[float]:  # turn by turn: the same turn of the same round
        return [x / y for ra, rb in zip(results[a], results[b], strict=True)
                for x, y in zip(ra["blocks"], rb["blocks"], strict=True)]

    def cpu_ratio(a: str, b: str) -> str:
        vals = sorted(ra["cpu_seconds"] / ra["steps"] / (rb["cpu_seconds"] / rb["steps"])
                      for ra, rb in zip(results[a], results[b], strict=True))
        return f"{statistics.median(vals):.3f}x"

    import platform

    base = "bare" if "bare" in loops else loops[0]
    others = [lp for lp in loops if lp != base]
    n_pairs = len(pairs(f"{others[0]}:{variants[0]}", f"{base}:{variants[0]}")) if others else 0
    lines = [f"Loop overhead, {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
             f"{THREADS} torch threads, AdamW {args.optimizer}; {args.rounds} rounds, each loop of a variant in its "
             f"own process, taking turns of {args.block} steps ({args.steps} timed steps each, after {args.warmup}); "
             f"ms/step: the median turn; ratios per turn pair ({n_pairs} a variant): median (quartiles; range); "
             "CPU: process CPU seconds over the timed span (background threads included), median of rounds", "",
             "| variant | " + " | ".join(f"{lp} ms/step (CPU ms)" for lp in loops) + " | "
             + " | ".join(f"{lp} / {base}" for lp in others) + " | "
             + " | ".join(f"{lp} / {base} CPU" for lp in others) + " |",
             "|---" * (1 + len(loops) + 2 * len(others)) + "|"]
    for v in variants:
        cells = [f"{1000 * med(f'{lp}:{v}'):.2f} ({1000 * cpu(f'{lp}:{v}'):.2f})" for lp in loops]
        cells += [spread(pairs(f"{lp}:{v}", f"{base}:{v}")) for lp in others]
        cells += [cpu_ratio(f"{lp}:{v}", f"{base}:{v}") for lp in others]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if "full" in variants and "none" in variants:  # two process groups: per round, the median turns
        lines += ["", "full vs the same loop with nothing (per round, median turns): " + ", ".join(
            f"{lp} " + spread([statistics.median(f["blocks"]) / statistics.median(n["blocks"]) for f, n in
                               zip(results[f"{lp}:full"], results[f"{lp}:none"], strict=True)]) for lp in loops)]
    lines += ["", "CPU while waiting for a turn (background threads), ms per timed step: " + ", ".join(
        f"{m} {1000 * statistics.median(r['paused_cpu_s'] / r['steps'] for r in rs):.2f}" for m, rs in results.items())]
    for lp in [x for x in ("memfit", "before") if x in loops and "full" in variants]:
        parts = [breakdown(r, args.warmup) for r in results[f"{lp}:full"]]
        total = med(f"{lp}:full")
        lines += ["", f"Where {lp}'s time goes (full, ms per timed step, median of rounds):", "",
                  "| part | ms/step | share |", "|---|---|---|"]
        for key in parts[0]:
            ms = statistics.median(p[key] for p in parts)
            lines.append(f"| {key} | {1000 * ms:.3f} | {100 * ms / total:.1f}% |")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "loop_overhead.md").write_text(text + "\n")
    if args.plot:
        plot(args.plot, loops, variants, {m: med(m) for m in results})


def plot(path: Path, loops: list[str], variants: list[str], med: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / len(loops)
    names = {"none": "none (no tracking, no saves)", "full": "full (MLflow + save every 10)"}
    for k, lp in enumerate(loops):
        xs = [i + (k - (len(loops) - 1) / 2) * width for i in range(len(variants))]
        ax.bar(xs, [1000 * med[f"{lp}:{v}"] for v in variants], width, label=lp)
    ax.set_xticks(range(len(variants)), [names[v] for v in variants])
    ax.set_ylabel("ms per optimizer step (median turn)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
