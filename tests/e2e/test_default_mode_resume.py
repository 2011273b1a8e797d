"""Default mode (ephemeral Prefect, local MLflow): a run SIGKILLed after its first checkpoint never blocks its rerun.

The issue's command, killed as a group as soon as its first training checkpoint is in the bucket, then run
again on a new machine (fresh work folder and Prefect home; only the S3 checkpoints carry over): it resumes,
ends, and exports the reference's weights. The same machine, twice: tests/e2e/test_kill_trials.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import kill_support as ks
import pytest
from test_spot_resume import Run  # the CLI in its own process group, stderr read as it comes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RERUN_BOUND_S = 120  # the bound: the rerun completes within 2 minutes on 2 cores


def _kill_after_first_checkpoint(bench, name: str, env: dict[str, str], cwd: Path) -> int:
    """Start the issue's command; SIGKILL its group once a checkpoint's manifest is in the bucket. Returns the
    newest complete checkpoint's step the kill left."""
    cwd.mkdir(parents=True, exist_ok=True)
    run = Run(ks.overrides(f"s3://{bench.bucket}/{name}", *bench.extra), env, cwd)
    deadline = time.monotonic() + 600
    while not ks.bucket_state(bench.client, bench.bucket, name).complete:
        assert run.proc.poll() is None, f"exited {run.proc.returncode} before a checkpoint:\n{run.log[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after 600 s:\n{run.log[-3000:]}"
        time.sleep(0.02)
    run.kill()
    run.finish(timeout=60)
    newest = ks.bucket_state(bench.client, bench.bucket, name).newest
    assert 0 < newest < 40
    return newest


def _rerun(bench, name: str, env: dict[str, str], cwd: Path) -> tuple[str, dict]:
    """The same command again; it must end, successfully, within the issue's bound."""
    cwd.mkdir(parents=True, exist_ok=True)
    run = Run(ks.overrides(f"s3://{bench.bucket}/{name}", *bench.extra), env, cwd)
    try:
        code, out = run.finish(timeout=RERUN_BOUND_S)
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail(f"rerun still running after {RERUN_BOUND_S} s, in {ks.phase_of(run.log)}:\n{run.log[-3000:]}")
    assert code == 0, run.log[-4000:]
    return run.log, json.loads(out.strip().splitlines()[-1])


def _assert_resumed_to_reference(bench, name: str, step: int, log: str, summary: dict) -> None:
    assert f"resuming from training checkpoint s3://{bench.bucket}/{name}/step-{step:08d} (step {step})" in log
    assert summary["status"] == "completed" and summary["steps"] == 40
    equal, detail = ks.same_weights(Path(summary["safetensors_dir"]) / "model.safetensors", bench.reference)
    assert equal, f"rerun's exported weights differ from the uninterrupted run's: {detail}"


def test_rerun_on_a_new_machine_resumes_from_the_s3_checkpoint(default_mode_bench, prefect_home_template,
                                                                tmp_path):
    bench = default_mode_bench
    name = "new-machine"
    step = _kill_after_first_checkpoint(bench, name, bench.env, bench.root / name)
    # A new machine: another work folder (so MLflow's default local store is a new, empty one there) and a
    # Prefect home that never saw the killed run.
    home = tmp_path / "prefect-home"
    shutil.copytree(prefect_home_template, home)
    machine = tmp_path / "machine-b"
    log, summary = _rerun(bench, name, {**bench.env, "PREFECT_HOME": str(home)}, machine)
    _assert_resumed_to_reference(bench, name, step, log, summary)
    # MLflow's default store is new on this machine: training went on in a new run there, tagged with the
    # killed run's id and the step it resumed from.
    from mlflow import MlflowClient

    assert summary["tracking_uri"] == f"sqlite:///{machine / 'mlflow.db'}"
    first = MlflowClient(f"sqlite:///{bench.root / name / 'mlflow.db'}")
    killed_ids = [r.info.run_id for r in first.search_runs([e.experiment_id for e in first.search_experiments()])]
    tags = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.tags
    assert len(killed_ids) == 1 and summary["mlflow_run_id"] != killed_ids[0]
    assert tags["memfit.resumed_from_run_id"] == killed_ids[0] and tags["memfit.resumed_from_step"] == str(step)
