"""`memfit run` stopped at the memory limit, run again by hand: the rerun plans a leaner stack, resumes, completes.

The budget is set from the planner's own estimate of the tiny run, so that its first choice (no checkpointing)
fits the planner's limit but passes monitor.stop_at_fraction once the optimizer state exists (step 2 on):
the monitor stops it at its step-10 reading, with a training checkpoint, exit 76.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import tiny_overrides

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
STOP_AT = 0.85
# The planner keeps 5% free (memory.safety_margin): a budget of peak / 0.925 lets no checkpointing fit it.
HEADROOM = 0.925


def _memfit(root: Path, *args: str, sets: list[str]) -> subprocess.CompletedProcess:
    flags = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args, TINY, *flags], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_rerun_after_the_memory_limit_plans_leaner_resumes_and_completes(tmp_path):
    from mlflow import MlflowClient

    base = tiny_overrides(tmp_path, **{"data.synthetic_docs": 400, "train.eval_batches": 1, "train.max_steps": 30,
                                       "checkpoint.every_steps": 20, "monitor.every_steps": 10, "export.onnx": False,
                                       "registry.enabled": False, "memory.loss": "plain"})
    unbounded = _memfit(tmp_path, "plan", "--json", sets=base)
    assert unbounded.returncode == 0, unbounded.stderr[-3000:]
    peak = json.loads(unbounded.stdout.strip().splitlines()[-1])["predicted_peak_bytes"]
    sets = [*base, f"memory.budget_gb={peak / HEADROOM / 1e9:.9f}", f"monitor.stop_at_fraction={STOP_AT}"]
    limit = peak / HEADROOM * STOP_AT

    first = _memfit(tmp_path, "run", sets=sets)
    assert first.returncode == 76, first.stderr[-3000:]
    last = first.stderr.strip().splitlines()[-1]
    assert last.startswith("error: memory peak") and "at step 10 passed monitor.stop_at_fraction=0.85" in last
    assert "with a leaner stack" in last and "memory-limits.json" in last
    record = json.loads((tmp_path / "checkpoints" / "memory-limits.json").read_text())["records"]
    assert len(record) == 1 and record[0]["kinds"] == ["none", "none"] and record[0]["step"] == 10
    assert record[0]["stack"]["micro_batch_size"] == 8 and record[0]["measured_bytes"] > limit

    # `memfit plan` says why the stack that ran is out, and what it picks instead.
    shown = _memfit(tmp_path, "plan", sets=sets)
    assert shown.returncode == 0, shown.stderr[-3000:]
    # The stopped stack's row (plain / adamw, no lean layers); the rerun may keep its blocks with lean layers.
    stopped_row = next(line for line in shown.stdout.splitlines()
                        if "| none | 2 none | fp32 | 8 x 2 | no | plain / adamw |" in line)
    assert f"| no: measured {record[0]['measured_bytes'] / 1e9:.4g} GB at step 10 > limit" in stopped_row
    assert "leaner than none, fp32, micro-batch 8x2, which measured" in shown.stdout.splitlines()[0]

    second = _memfit(tmp_path, "run", "--json", sets=sets)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    plan = summary["plan"]
    assert summary["status"] == "completed" and summary["steps"] == 30
    stopped = record[0]["stack"]  # not the stack that stopped
    assert (plan["block_kinds"], plan["micro_batch_size"], plan["lean_layers"]) != (
        record[0]["kinds"], stopped["micro_batch_size"], stopped["lean_layers"])
    assert plan["predicted_peak_bytes"] * record[0]["measured_bytes"] / record[0]["predicted_bytes"] <= limit
    assert "resuming from training checkpoint" in second.stderr and "(step 10)" in second.stderr

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])  # one run, continued
    assert run.info.status == "FINISHED" and run.data.tags["memfit.resumed_from_step"] == "10"
    peaks = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "memory/peak_bytes")}
    assert peaks[10] > limit  # what stopped the first attempt
    resumed = {s: v for s, v in peaks.items() if s > 10}
    assert set(resumed) == {11, 20, 30} and max(resumed.values()) <= limit, peaks  # the leaner stack, measured
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} >= set(range(11, 31))
