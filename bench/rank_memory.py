"""What one rank holds against what the plan said it would, for every strategy, on two CPU ranks (gloo).

    python bench/rank_memory.py                  # -> docs/rank_memory.json and the table below it
    python bench/rank_memory.py --out /tmp/x     # elsewhere

Each row is a real `memfit` run of configs/tiny.yaml through phases 1-3 (probe, plan, train) for a few steps: one
process, then two ranks under torchrun with ddp, fsdp2, deepspeed_zero2 and deepspeed_zero3 (rows skipped without
DeepSpeed), with no gradient checkpointing and with every block checkpointed, in fp32, then in bf16-mixed (the
precision of every GPU run; DeepSpeed then holds the model itself in bf16). The plan's predicted peak is
the planner's one-rank figure (planner/sharding.py rank_share); the measured peak is rank 0's live tensor bytes at
its peak step (monitor.track_tensors, the figure a memory budget is held to on CPU), as MLflow logged it
(`memory/peak_bytes`). A ratio below 1 is a plan that holds less than the rank did.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from memfit import config, phases  # noqa: E402
from memfit.files import write_json_atomic  # noqa: E402

FULL = "every block checkpointed"
ROWS = [("one process", 1, "single", "none", "fp32"), (f"one process, {FULL}", 1, "single", "full", "fp32"),
        ("ddp", 2, "ddp", "none", "fp32"), (f"ddp, {FULL}", 2, "ddp", "full", "fp32"),
        ("fsdp2", 2, "fsdp2", "none", "fp32"), (f"fsdp2, {FULL}", 2, "fsdp2", "full", "fp32"),
        ("deepspeed_zero2", 2, "deepspeed_zero2", "none", "fp32"),
        (f"deepspeed_zero2, {FULL}", 2, "deepspeed_zero2", "full", "fp32"),
        ("deepspeed_zero3", 2, "deepspeed_zero3", "none", "fp32")]
ROWS += [(f"{label}, bf16-mixed", ranks, strategy, "none", "bf16-mixed")
         for label, ranks, strategy in (("one process", 1, "single"), ("ddp", 2, "ddp"), ("fsdp2", 2, "fsdp2"),
                                        ("deepspeed_zero2", 2, "deepspeed_zero2"),
                                        ("deepspeed_zero3", 2, "deepspeed_zero3"))]


def run_row(work: Path, ranks: int, strategy: str, policy: str, steps: int, precision: str = "fp32") -> dict[str, Any]:
    """One short run; the plan's per-rank peak beside rank 0's measured one."""
    from mlflow import MlflowClient
    from tests_support import tiny_overrides

    root = Path(tempfile.mkdtemp(prefix="rank-memory-"))
    extra: dict[str, Any] = {"train.max_steps": steps, "checkpoint.every_steps": steps, "train.warmup_steps": 1,
                             "data.synthetic_docs": 400, "export.onnx": False, "run.work_dir": str(work),
                             "tracking.experiment": "rank-memory", "monitor.every_steps": 1,
                             "memory.budget_gb": 1.0, "memory.policy": policy, "train.precision": precision}
    if ranks > 1:
        extra.update({"distributed.nproc_per_node": ranks, "distributed.strategy": strategy})
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, f"sqlite:///{root / 'mlflow.db'}", **extra))
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    report = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    history = MlflowClient(cfg.tracking.uri).get_metric_history(report.mlflow_run_id, "memory/peak_bytes")
    measured = max(m.value for m in history)
    return {"predicted_bytes": plan.predicted_peak_bytes, "measured_bytes": int(measured),
            "ratio": round(plan.predicted_peak_bytes / measured, 3), "strategy": plan.strategy,
            "micro_batch_per_rank": plan.micro_batch_size // ranks, "policy": plan.policy}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | ranks | rows a rank | planned MB | measured MB | planned / measured |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['label']} | {r['ranks']} | | | | skipped: {r['skipped']} |")
            continue
        lines.append(f"| {r['label']} | {r['ranks']} | {r['micro_batch_per_rank']} | "
                     f"{r['predicted_bytes'] / 1e6:.3f} | {r['measured_bytes'] / 1e6:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for rank_memory.json")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank-memory-work-"))  # one preset build shared by the rows
    rows = []
    for label, ranks, strategy, policy, precision in ROWS:
        row: dict[str, Any] = {"label": label, "ranks": ranks}
        if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            row["skipped"] = "DeepSpeed not installed"
        else:
            row.update(run_row(work, ranks, strategy, policy, args.steps, precision))
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "rank_memory.json", {"model": "configs/tiny.yaml", "device": "cpu (gloo)",
                                                      "rows": rows})
    print(table(rows))


if __name__ == "__main__":
    main()
