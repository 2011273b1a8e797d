"""What MLflow tracking costs the training step: the same tiny run with no tracker, MLflow as shipped
(batched, written on a background thread, system metrics on), and MLflow writing each batch inline.

    PYTHONPATH=. python bench/tracking_overhead.py [--steps 80] [--repeats 2]

Prints a table and writes bench/out/tracking_overhead.md. Modes run in blocks, side by side in one
process (FACTS: interleaving single steps gives wrong ratios); the first block is a warm-up.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def _config(root: Path, mode: str, steps: int):
    from memfit import config

    return config.load(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", [
        f"run.work_dir={root / 'work'}", f"checkpoint.uri={root / f'{mode}-{time.monotonic_ns()}' / 'ckpt'}",
        f"export.dir={root / 'export'}",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}", "tracking.experiment=bench",
        f"tracking.backend={'null' if mode == 'null' else 'mlflow'}", f"train.max_steps={steps}",
        f"checkpoint.every_steps={steps}", "data.synthetic_docs=600"])


def run_mode(root: Path, mode: str, steps: int) -> dict[str, float]:
    """Train `steps` steps with the tracker of `mode`; a step period includes its own metric logging."""
    from memfit import phases
    from memfit.tracking.mlflow_tracker import MLflowTracker
    from memfit.tracking.null import NullTracker

    stamps: list[float] = []
    own: dict[str, float] = {}
    originals = {}

    def recorder(cls):
        original = cls.log_metrics
        originals[cls] = original

        def log_metrics(self, metrics, step):
            if "step_time_s" in metrics:  # one call per step: the gap between calls is the whole step period
                stamps.append(time.perf_counter())
            if "tracking_overhead_fraction" in metrics:  # the tracker's own account, logged at the end
                own.update(metrics)
            return original(self, metrics, step)

        cls.log_metrics = log_metrics

    recorder(NullTracker)
    recorder(MLflowTracker)
    original_submit = MLflowTracker._submit
    if mode == "mlflow-inline":
        def inline(self):  # the same batches, written on the training thread
            original_submit(self)
            for fut in list(self._inflight):
                fut.result()
        MLflowTracker._submit = inline
    try:
        cfg = _config(root, mode, steps)
        probe = phases.check_environment_and_probe(cfg)
        plan = phases.plan_stack(cfg, probe)
        t0 = time.perf_counter()
        phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
        wall = time.perf_counter() - t0
    finally:
        for cls, fn in originals.items():
            cls.log_metrics = fn
        MLflowTracker._submit = original_submit
    periods = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    steady = periods[5:]  # the first steps include allocator warm-up
    return {"median_step_s": statistics.median(steady), "mean_step_s": statistics.fmean(steady), "wall_s": wall,
            **own}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    modes = ["null", "mlflow", "mlflow-inline"]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        run_mode(Path(tmp), "null", 20)  # warm-up: preset build, first SQLite migration, imports
        for _ in range(args.repeats):
            for mode in modes:
                results[mode].append(run_mode(Path(tmp), mode, args.steps))
    base = statistics.median(r["median_step_s"] for r in results["null"])
    lines = [f"# Tracking overhead (tiny config, {args.steps} steps x {args.repeats} blocks per mode)", "",
             "| mode | median step (ms) | mean step (ms) | median vs null | logging on the training thread "
             "| writer thread |", "|---|---|---|---|---|---|"]
    for mode in modes:
        med = statistics.median(r["median_step_s"] for r in results[mode])
        mean = statistics.fmean(r["mean_step_s"] for r in results[mode])
        own = [r for r in results[mode] if "tracking_overhead_fraction" in r]
        caller = (f"{100 * statistics.fmean(r['tracking_overhead_fraction'] for r in own):.3f}% of step time"
                  if own else "-")
        writer = f"{100 * statistics.fmean(r['tracking_writer_fraction'] for r in own):.3f}%" if own else "-"
        lines.append(f"| {mode} | {1000 * med:.2f} | {1000 * mean:.2f} | {med / base:.4f}x | {caller} | {writer} |")
    lines += ["", "mlflow = as shipped: batches of 20 steps written on a background thread, system metrics every "
              "1 s; mlflow-inline = the same batches written on the training thread."]
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "tracking_overhead.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
