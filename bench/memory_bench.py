"""Gradient-checkpointing benchmark: activation memory, peak and step time per policy, estimate beside each.

Reference workload (the issue's): a tiny Llama, 8 blocks x hidden 256, global batch 8, sequence 256, fp32,
CPU. Side by side in one process: no checkpointing; full checkpointing switched on the way a Hugging Face
user does (`model.gradient_checkpointing_enable()`); memfit's full, every_k (k = 2, 4) and selective; and
the planner's choice at activation budgets of 25/50/55/75% of no-checkpointing's activations (once with the
micro-batch free, once with it fixed, so the policy-only planner is visible too).

Memory is measured with memfit's tracker (torch's MemTracker) on real tensors, one steady-state step per
mode; time is the median over rounds of blocks of consecutive steps per mode (never interleaved single
steps), as a ratio to no checkpointing measured in the same rounds. By default time is this process's CPU
time on one torch thread: other processes stretch it less than wall time, but they still share caches and
memory bandwidth (a loaded machine measured full checkpointing 2-3% slower): run it on an idle machine.

    PYTHONPATH=. python bench/memory_bench.py            # ~12 min on 2 cores; writes bench/out/
    PYTHONPATH=. python bench/memory_bench.py --quick    # smaller and shorter, to try it out
    PYTHONPATH=. python bench/memory_bench.py --device cuda --shape llama-3.2-1b   # on a GPU: bf16-mixed,
                                                         # wall time after a synchronize, batch 8 x 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from technique_rows import technique_rows  # noqa: E402

from memfit.config import MemoryConfig  # noqa: E402
from memfit.config.devices import PROFILES, profile_for_report  # noqa: E402
from memfit.memory.estimator.compose import Estimate, Stack  # noqa: E402
from memfit.memory.estimator.estimate import Estimator  # noqa: E402
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step  # noqa: E402
from memfit.memory.estimator.tracker import StepTracker  # noqa: E402
from memfit.memory.planner.plan import assignments, choose, describe  # noqa: E402
from memfit.memory.techniques.policies import EveryKCheckpointing, assign_blocks, find_blocks  # noqa: E402

SAVE_OPS = tuple(MemoryConfig().selective_save_ops)
MB = 1e6


@dataclass
class Mode:
    name: str
    kinds: tuple[str, ...] | None  # None: the Hugging Face way (gradient_checkpointing_enable)
    stack: Stack
    note: str = ""
    budget_frac: float | None = None
    estimate: Estimate | None = None
    measured_peak: int = 0
    measured_act: int = 0
    blocks_s: list[float] = field(default_factory=list)


# Model shapes (the reference workload, and Llama-3.2-1B's published config.json) with the batch each
# is measured at; the command line can override any of these.
SHAPES = {
    "reference": {"layers": 8, "hidden": 256, "intermediate": 1024, "heads": 4, "kv_heads": 4, "vocab": 512,
                  "batch": 8, "seq": 256, "tie": False},
    "llama-3.2-1b": {"layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8,
                     "vocab": 128256, "batch": 8, "seq": 2048, "tie": True},
}


def build(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(args.seq, 512), tie_word_embeddings=args.tie, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(args.device)
    if args.precision == "bf16-true":
        model.to(torch.bfloat16)  # pure bf16 weights, as the trainer holds them
    model.train()
    return model


def set_mode(model, mode: Mode) -> None:
    if mode.kinds is None:
        assign_blocks(model, ["none"] * len(find_blocks(model)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()  # what a Hugging Face user writes
    else:
        assign_blocks(model, mode.kinds, save_ops=SAVE_OPS)


def batches_for(stack: Stack, args, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (stack.micro_batch_size, args.seq)
    return [torch.randint(0, args.vocab, shape, generator=gen).to(args.device) for _ in range(stack.grad_accum_steps)]


def measure_memory(model, optimizer, mode: Mode, args) -> None:
    set_mode(model, mode)
    tracker = StepTracker(find_blocks(model))
    tracker.track_external(model, optimizer)
    with tracker:
        run_step(model, optimizer, batches_for(mode.stack, args, 1), args.precision, tracker)
    res = tracker.result()
    mode.measured_peak = res.peak_bytes
    mode.measured_act = [s.end["activations"] for s in res.segments if s.label.endswith(".fpost")][-1]


def clock(args) -> float:
    # CPU time of this process: on a shared machine other processes stretch wall time more than our CPU time.
    # On a GPU, wall time once the queued kernels have finished.
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.process_time() if args.clock == "cpu" else time.perf_counter()


def time_blocks(model, optimizer, modes: list[Mode], args) -> None:
    for r in range(args.rounds):
        for mode in modes:
            set_mode(model, mode)
            batches = batches_for(mode.stack, args, 2 + r)
            run_step(model, optimizer, batches, args.precision)  # warm-up in this mode
            t0 = clock(args)
            for _ in range(args.steps):
                run_step(model, optimizer, batches, args.precision)
            mode.blocks_s.append((clock(args) - t0) / args.steps)
        print(f"  timing round {r + 1}/{args.rounds} done", flush=True)


def planner_modes(est: Estimator, n: int, none: Estimate, fracs: list[float], batch: int, precision: str
                  ) -> list[Mode]:
    base = Stack(precision, batch, 1, False)
    micros = [m for m in (batch, batch // 2, batch // 4, 1) if m >= 1 and batch % m == 0]
    stacks = [Stack(precision, m, batch // m, False) for m in micros]
    every = assignments(n)
    by_stack = {s: [est.estimate(s, k) for k in every] for s in dict.fromkeys(stacks)}
    out = []
    for free_micro in (True, False):
        cands = [e for s, es in by_stack.items() for e in es if free_micro or s == base]
        for frac in (fracs if free_micro else [0.55]):
            plan = choose(cands, None, configured=base, baseline=none, safety_margin=0.0,
                          activation_budget=int(frac * none.activation_bytes))
            if not plan.fits:
                print(f"  planner at {frac:.0%}: nothing fits ({plan.error})")
                continue
            c = plan.chosen
            label = f"planner @{frac:.0%}" + ("" if free_micro else " (micro-batch fixed)")
            out.append(Mode(label, c.kinds, c.stack, note=describe(c), budget_frac=frac, estimate=c))
    return out


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def write_outputs(modes: list[Mode], none: Mode, full: Mode, args, out: Path, extra: dict) -> str:
    """`full` is the Hugging Face switch (the issue's reference); memfit's own full policy is checked too."""
    base_t = statistics.median(none.blocks_s)
    full_ratio = statistics.median(full.blocks_s) / base_t
    rows = ["| mode | what | activations MB (est) | act % of none | peak MB (est) | step time x none (pred) |",
            "|---|---|---|---|---|---|"]
    data = []
    for m in modes:
        ratio = statistics.median(m.blocks_s) / base_t
        e = m.estimate
        pred_ratio = e.step_seconds / none.estimate.step_seconds if e else float("nan")
        rows.append(f"| {m.name} | {m.note} | {m.measured_act / MB:.1f} ({e.activation_bytes / MB:.1f}) | "
                    f"{100 * m.measured_act / none.measured_act:.1f}% | {m.measured_peak / MB:.1f} "
                    f"({e.peak_bytes / MB:.1f}) | {ratio:.3f} ({pred_ratio:.3f}) |")
        data.append({"mode": m.name, "note": m.note, "kinds": list(m.kinds) if m.kinds else "hf-full",
                     "micro_batch_size": m.stack.micro_batch_size, "grad_accum_steps": m.stack.grad_accum_steps,
                     "measured_activation_bytes": m.measured_act, "estimated_activation_bytes": e.activation_bytes,
                     "measured_peak_bytes": m.measured_peak, "estimated_peak_bytes": e.peak_bytes,
                     "step_time_ratio": ratio, "predicted_step_time_ratio": pred_ratio,
                     "step_seconds_blocks": m.blocks_s, "budget_frac": m.budget_frac})
    table = "\n".join(rows)
    checks = []
    for m in modes:
        if m.kinds is None or m.name == "full":
            r = statistics.median(m.blocks_s) / base_t
            checks.append((f"{m.name}: activations <= 10% of none", m.measured_act <= 0.10 * none.measured_act,
                           f"{100 * m.measured_act / none.measured_act:.1f}%"))
            checks.append((f"{m.name}: step time <= 1.30x none", r <= 1.30, f"{r:.3f}x"))
    for m in modes:
        if m.budget_frac == 0.55 and "fixed" in m.name:
            # An extra row, not a target: the policy-only planner (recompute alone, no smaller micro-batch).
            r = statistics.median(m.blocks_s) / base_t
            checks.append((f"{m.name}: activations <= budget", m.measured_act <= 0.55 * none.measured_act,
                           f"{100 * m.measured_act / none.measured_act:.1f}% of none"))
            extra.setdefault("info", []).append(
                f"{m.name}: overhead {100 * (r - 1):+.1f}% vs full's {100 * (full_ratio - 1):+.1f}% (not a target: "
                "recompute alone, the micro-batch held fixed)")
        elif m.budget_frac == 0.55:
            r = statistics.median(m.blocks_s) / base_t
            ok_mem = m.measured_act <= 0.55 * none.measured_act
            ok_t = (r - 1) <= (full_ratio - 1) / 3
            checks.append((f"{m.name}: activations <= budget", ok_mem,
                           f"{100 * m.measured_act / none.measured_act:.1f}% of none"))
            checks.append((f"{m.name}: overhead <= 1/3 of full's", ok_t,
                           f"{100 * (r - 1):+.1f}% vs full {100 * (full_ratio - 1):+.1f}%"))
    worst_peak = max(abs(m.estimate.peak_bytes / m.measured_peak - 1) for m in modes)
    worst_act = max(abs(m.estimate.activation_bytes / m.measured_act - 1) for m in modes if m.measured_act)
    checks.append(("estimator: peak within 10% for every mode", worst_peak <= 0.10, f"worst {100 * worst_peak:.2f}%"))
    checks.append(("estimator: activations within 10% for every mode", worst_act <= 0.10,
                   f"worst {100 * worst_act:.2f}%"))
    checks.append(("Llama-3-8B-shaped estimate < 60 s", extra["llama3_8b_seconds"] < 60,
                   f"{extra['llama3_8b_seconds']:.1f} s"))
    check_md = "\n".join(f"- {'PASS' if ok else 'MISS'}: {what} ({val})" for what, ok, val in checks)
    check_md += "".join(f"\n- info: {line}" for line in extra.get("info", []))
    where = (f"CPU ({torch.get_num_threads()} thread(s))" if args.device == "cpu"
             else torch.cuda.get_device_name())
    head = (f"Workload: Llama {args.layers} blocks x hidden {args.hidden}, batch {args.batch}, seq {args.seq}, "
            f"{args.precision}, {where}; time = {args.clock} time, median of {args.rounds} rounds x "
            f"{args.steps} steps per mode; none = {base_t:.3f} s/step. Measured first, the estimator's prediction in "
            "parentheses.")
    md = f"{head}\n\n{table}\n\nTargets:\n\n{check_md}\n"
    if extra.get("techniques_table"):
        md += ("\nLoss, optimizer, step in backward and lean layers (bench/technique_rows.py):\n\n"
               f"{extra['techniques_table']}\n")
    (out / "memory_bench.md").write_text(md)
    (out / "memory_bench.json").write_text(json.dumps({"args": vars(args), "rows": data, **extra,
                                                        "checks": [list(c) for c in checks]}, indent=2))
    plot(data, none.measured_act, out / "memory_bench.png", plot_title(args))
    return md


def plot(rows: list[dict], none_act: int, path: Path, title: str) -> None:
    """Activations after the forward vs step-time ratio, one point per mode, the measured Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.4))
    groups: list[tuple[float, float, list[str]]] = []  # points close together share one label
    top = max(r["measured_activation_bytes"] for r in rows) / MB
    for r in rows:
        x, y = r["step_time_ratio"], r["measured_activation_bytes"] / MB
        planner = r["mode"].startswith("planner")
        ax.scatter([x], [y], s=110 if planner else 45, marker="*" if planner else "o", zorder=3)
        ax.scatter([x], [r["estimated_activation_bytes"] / MB], s=20, marker="x", color="grey", zorder=2)
        near = next((g for g in groups if abs(g[0] - x) < 0.02 and abs(g[1] - y) < 0.04 * top), None)
        if near is None:
            groups.append((x, y, [r["mode"]]))
        else:
            near[2].append(r["mode"])
    for x, y, names in groups:
        ax.annotate("\n".join(names), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7.5)
    front = pareto([(r["step_time_ratio"], r["measured_activation_bytes"] / MB) for r in rows])
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:green", label="Pareto front (measured)")
    ax.scatter([], [], marker="x", color="grey", label="estimator's prediction")
    for frac in (0.25, 0.5, 0.55, 0.75):
        ax.axhline(frac * none_act / MB, color="grey", lw=0.6, ls=":")
        ax.annotate(f"{frac:.0%} of none", (1.0, frac * none_act / MB), fontsize=7, color="grey",
                    xycoords=("axes fraction", "data"), ha="right", va="bottom")
    xs = [r["step_time_ratio"] for r in rows]
    ax.set_xlim(min(xs) - 0.02, max(xs) + 0.12)  # room for the labels of the slowest points
    ax.set_xlabel("step time / no checkpointing (median over blocks of steps)")
    ax.set_ylabel("activations alive after the forward (MB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_title(args) -> str:
    where = "CPU" if getattr(args, "device", "cpu") == "cpu" else "GPU"
    return (f"Gradient checkpointing on {where}: Llama {args.layers} blocks x {args.hidden}, batch {args.batch} x "
            f"{args.seq}, {getattr(args, 'precision', 'fp32')} - memory vs time")


def llama3_8b_seconds() -> float:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3-8b"))
    t0 = time.perf_counter()
    est = Estimator(cfg, 2048, PROFILES["h100-80gb"], save_ops=SAVE_OPS)
    e = est.estimate(Stack("bf16-mixed", 4, 1, False), ["full"] * 32)
    print(f"  Llama-3-8B-shaped, full FT bf16-mixed, full checkpointing: peak {e.peak_bytes / 1e9:.1f} GB")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="reference", help="model shape and batch")
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the shape's")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"], default=None,
                    help="default: fp32 on CPU, bf16-mixed on CUDA")
    ap.add_argument("--steps", type=int, default=4, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per mode (median taken)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is exact)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="process CPU time or wall time (default: cpu on CPU, wall on CUDA)")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--quick", action="store_true", help="4 blocks x 128, seq 128, 2 rounds of 2 steps")
    ap.add_argument("--no-techniques", action="store_true", help="skip the chunked-loss and optimizer rows")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG from a memory_bench.json, run nothing")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        none_act = next(r["measured_activation_bytes"] for r in saved["rows"] if r["mode"] == "none")
        target = Path(args.replot).with_suffix(".png")
        plot(saved["rows"], none_act, target, plot_title(argparse.Namespace(**saved["args"])))
        print(f"wrote {target}")
        return
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.seq, args.steps, args.rounds = 4, 128, 512, 128, 2, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    args.precision = args.precision or ("fp32" if args.device == "cpu" else "bf16-mixed")
    args.clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build(args)
    n = len(find_blocks(model))
    base = Stack(args.precision, args.batch, 1, False)
    profile = PROFILES["cpu"] if args.device == "cpu" else profile_for_report(
        {"type": "cuda", "name": torch.cuda.get_device_name(), "bf16_supported": torch.cuda.is_bf16_supported(),
         "memory_total_bytes": torch.cuda.get_device_properties(0).total_memory})
    est = Estimator(model.config, args.seq, profile, save_ops=SAVE_OPS, anchor_micro_batch=args.batch)
    print("estimating ...", flush=True)
    fixed = [Mode("none", ("none",) * n, base, "no checkpointing"),
             Mode("full (HF gradient_checkpointing_enable)", None, base, "every block, transformers' own switch"),
             Mode("full", ("full",) * n, base, "every block (memfit)"),
             Mode("every_k k=2", tuple(EveryKCheckpointing(k=2).block_kinds(n)), base, "blocks 0, 2, 4, ..."),
             Mode("every_k k=4", tuple(EveryKCheckpointing(k=4).block_kinds(n)), base, "blocks 0, 4, ..."),
             Mode("selective", ("selective",) * n, base, "save matmul/attention outputs")]
    for m in fixed:
        m.estimate = est.estimate(m.stack, m.kinds or ("full",) * n)
    none, full = fixed[0], fixed[1]
    modes = fixed + planner_modes(est, n, none.estimate, [0.25, 0.5, 0.55, 0.75], args.batch, args.precision)
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    print("measuring memory ...", flush=True)
    for m in modes:
        measure_memory(model, optimizer, m, args)
        print(f"  {m.name:<40} act {m.measured_act / MB:8.1f} MB (est {m.estimate.activation_bytes / MB:8.1f})"
              f"  peak {m.measured_peak / MB:8.1f} MB (est {m.estimate.peak_bytes / MB:8.1f})", flush=True)
    print("timing ...", flush=True)
    time_blocks(model, optimizer, modes, args)
    extra: dict = {"llama3_8b_seconds": llama3_8b_seconds()}
    if not args.no_techniques:
        print("memory techniques besides checkpointing ...", flush=True)
        extra["techniques_table"], extra["techniques"] = technique_rows(build, args, est, clock)
    md = write_outputs(modes, none, full, args, out, extra)
    print(md)
    print(f"wrote {out / 'memory_bench.md'}, {out / 'memory_bench.json'}, {out / 'memory_bench.png'}")


if __name__ == "__main__":
    main()
