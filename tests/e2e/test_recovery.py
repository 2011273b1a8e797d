"""Unattended recovery: a run whose machine vanishes (or is preempted) finishes by itself on another machine.

A real `prefect server` with memfit's automations, two `memfit serve` processes standing for two machines (each
its own work folder and Prefect home), training checkpoints in moto S3, one real `mlflow server`. No command is
typed after a kill: detection (heartbeats), the restart (an automation) and the resume happen on their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from recovery_support import (
    BIN,
    REPO,
    TINY,
    Machine,
    complete_checkpoints,
    deployment_of,
    final_run,
    flow_runs,
    newest_checkpoint,
    next_run,
    overrides,
    preemption_chain,
    runs_of,
    serve_machine,
    serve_plain_prefect,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_vanished_machine_is_detected_restarted_elsewhere_and_finishes(cluster, reference_weights):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket = "vanish", cluster["s3"], cluster["bucket"]
    a = serve_machine(cluster, Machine(cluster["root"], "machine-a", cluster["env"]), run)
    b = Machine(cluster["root"], "machine-b", cluster["env"])
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    try:
        with get_client(sync_client=True) as client:
            deployment = deployment_of(client, a, run)
            names = {x.name for x in client.read_automations()}
            assert names >= {"memfit: mark silent runs crashed", "memfit: restart preempted or vanished runs"}
            first = client.create_flow_run_from_deployment(deployment.id)
            wait_until("two training checkpoints committed", lambda: len(complete_checkpoints(s3, bucket, run)) >= 2,
                       300, context, every=0.2)
            a.vanish()
            killed_at, newest = time.monotonic(), complete_checkpoints(s3, bucket, run)[-1]
            # Machine B comes up; nobody touches the run.
            serve_machine(cluster, b, run)

            def crashed():
                state = client.read_flow_run(first.id).state
                return state if state.type.value == "CRASHED" else None

            state = wait_until("the silent run marked Crashed", crashed, 50 + 60, context)
            crashed_after = time.monotonic() - killed_at
            assert "no heartbeat" in (state.message or ""), state

            def restarted_and_done():
                runs = [r for r in runs_of(client, deployment.id, run) if r.id != first.id]
                final = [r for r in runs if r.state and r.state.is_final()]
                return final[0] if final else None

            second = wait_until("the restarted run finished", restarted_and_done, 400, context, every=2)
            assert second.state.is_completed(), (second.state, context())
            assert "memfit-attempt:2" in second.tags and "memfit-recovery" in second.tags, second.tags
            assert second.name == f"{run}-attempt-2"
            assert second.parameters == first.parameters  # the same run: its parameters as they were
    finally:
        a.stop()
        b.stop()
    # Detected within the silence window and a few evaluation rounds of the server's trigger service.
    assert crashed_after < 50 + 45, crashed_after
    assert b.weights() is not None and a.weights() is None, context()
    assert b.weights().read_bytes() == reference_weights(), "recovered weights differ"
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one logical run, one MLflow run
    tags, metrics = runs[0].data.tags, runs[0].data.metrics
    assert runs[0].info.status == "FINISHED"
    assert tags["memfit.recovery.last_cause"] == "vanished" and tags["memfit.attempts"] == "2", tags
    assert f"from_step={newest}" in tags["memfit.recovery.2"], tags["memfit.recovery.2"]
    assert metrics["recovery/resumed_from_step"] == newest and metrics["recovery/steps_lost"] >= 0
    assert metrics["recovery/downtime_s"] > 0
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert max(steps) == 160 and set(range(1, 161)) <= set(steps)  # nothing missing from the story


def test_preemption_restarts_at_once_and_the_budget_ends_the_run(cluster):
    """SIGTERM (a spot notice) ends the run Preempted and it is restarted after the backoff, without waiting for
    the silence window; with recovery.max_restarts: 1 the second preemption's restart ends RestartBudgetSpent."""
    final, names = preemption_chain(cluster, "preempt", max_restarts=1, kills=2)
    assert final.state.name == "RestartBudgetSpent", final.state
    assert "1 of recovery.max_restarts=1" in final.state.message and "preempted" in final.state.message
    assert names == ["preempt", "preempt-attempt-2", "preempt-attempt-3"], names


def test_three_preemptions_three_restarts_then_completion(cluster, reference_weights):
    from mlflow import MlflowClient

    final, names = preemption_chain(cluster, "thrice", max_restarts=3, kills=3)
    assert final.state.is_completed(), final.state
    assert names == ["thrice", "thrice-attempt-2", "thrice-attempt-3", "thrice-attempt-4"], names
    weights = next((cluster["root"] / "thrice-3").glob("runs/**/export/hf/model.safetensors"))
    assert weights.read_bytes() == reference_weights()
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    (mrun,) = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'thrice'")
    assert mrun.data.tags["memfit.attempts"] == "4" and mrun.data.tags["memfit.recovery.last_cause"] == "preempted"
    assert all(f"memfit.recovery.{n}" in mrun.data.tags for n in (2, 3, 4))
    assert mrun.data.metrics["recovery/steps_lost"] == 0  # a preemption saves at the step it stops


def _attempts(client, deployment_id, run: str, seen: set) -> list:
    """The runs of this logical run not seen yet, a duplicate restart (ended at once) left out."""
    return [r for r in runs_of(client, deployment_id, run) if r.id not in seen and not r.name.endswith("-duplicate")
            and not (r.state and r.state.name == "DuplicateRestart")]  # named so while it still runs


def _running(client, deployment_id, run: str, seen: set):
    runs = [r for r in _attempts(client, deployment_id, run, seen) if r.state and r.state.is_running()]
    return runs[0] if runs else None


@pytest.mark.timeout(1500)  # three machines, two faults, and the shared reference run if this test comes first
def test_a_runner_shutdown_cancel_is_restarted_and_a_noticed_machine_claims_nothing(cluster, reference_weights):
    """Two faults in one logical run. (1) Prefect's own runner (machine A, a plain prefect.serve as an older memfit
    had) gets SIGTERM and cancels the run in flight, "Runner is shutting down.": no person asked for that Cancelled,
    so recovery restarts it, and the restart waits for machine B. (2) Machine B, running that restart, gets a spot
    notice from its metadata service while machine C is up: B claims nothing from that moment, its run saves and
    ends Preempted, B leaves by itself, and the restart created a second later runs on C, not on B. A and B are
    slow machines (MEMFIT_TEST_STEP_DELAY): their runs cannot end before the next fault, however loaded this
    machine is (CI once saw A's run complete before B had started)."""
    from fixtures.faults import FakeMetadata
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket, root = "drain", cluster["s3"], cluster["bucket"], cluster["root"]
    imds = FakeMetadata()  # B's metadata service; A and C have none (the spot watcher is off there)
    # A training checkpoint every 10 steps: B shows it trains after 20 s of its slow steps (40 s at the suite's 20)
    spot = ["checkpoint.spot.poll_seconds=0.5", "checkpoint.every_steps=10"]
    a = Machine(root, "drain-a", {**cluster["env"], "MEMFIT_TEST_STEP_DELAY": "0.5"})  # 160 steps: 80 s at least
    b = Machine(root, "drain-b", {**cluster["env"], "MEMFIT_SPOT_WATCHER": "true", "MEMFIT_TEST_STEP_DELAY": "2",
                                  "MEMFIT_SPOT_METADATA_URL": imds.url})  # from step 10: 300 s at least
    c = Machine(root, "drain-c", cluster["env"])
    context = lambda: "\n".join(f"--- {m.dir.name} ---\n{m.tail()}" for m in (a, b, c))  # noqa: E731
    serving = "polling for scheduled runs"
    try:
        with get_client(sync_client=True) as client:
            serve_plain_prefect(cluster, a, run, *spot)
            deployment = deployment_of(client, a, run)
            first = client.create_flow_run_from_deployment(deployment.id)
            wait_until("a training checkpoint on A", lambda: complete_checkpoints(s3, bucket, run), 300, context,
                       every=0.2)
            os.kill(a.proc.pid, signal.SIGTERM)  # Prefect's runner alone, as a shutdown stops it
            a.proc.wait(90)
            ended = wait_until("attempt 1 ended", lambda: final_run(client, first.id), 60, context)
            assert ended.state.type.value == "CANCELLED" and ended.state.message == "Runner is shutting down.", \
                (ended.state, context())
            before = newest_checkpoint(s3, bucket, run)
            serve_machine(cluster, b, run, *spot)
            wait_until("a training checkpoint on B", lambda: newest_checkpoint(s3, bucket, run) > before,
                       400, context, every=0.2)
            # Attempt 1 ended twice (its flow Preempted by the SIGTERM, then Cancelled by the runner): two restarts,
            # the later ended DuplicateRestart at once; the one still running is attempt 2.
            second = wait_until("the restart running on B", lambda: _running(client, deployment.id, run,
                                                                             {first.id}), 60, context)
            # C polls every 5 s, B every second: a B still claiming would take the next restart first.
            serve_machine(cluster, c, run, *spot, "deploy.poll_seconds=5")
            wait_until("C serving", lambda: serving in c.tail(), 120, context)
            imds.instance_action = {"action": "terminate", "time": "2026-12-04T00:02:00Z"}
            ended = wait_until("attempt 2 ended", lambda: final_run(client, second.id), 60, context)
            assert ended.state.name == "Preempted" and "training checkpoint" in ended.state.message, ended.state
            third = wait_until("the restart scheduled", lambda: _attempts(client, deployment.id, run,
                                                                          {first.id, second.id}), 30, context)[0]
            assert b.proc.wait(90) == 0, context()  # drained and gone without a signal
            third = wait_until("the restart finished", lambda: final_run(client, third.id), 400, context, every=2)
            assert third.state.is_completed(), (third.state, context())
            names = [r.name for r in runs_of(client, deployment.id, run)]
    finally:
        for m in (a, b, c):
            m.stop()
        imds.close()
    assert str(third.id) not in b.tail(200_000) and c.weights() is not None and b.weights() is None, context()
    assert c.weights().read_bytes() == reference_weights()
    assert re.search(r"spot interruption notice.*draining", b.tail(200_000)), b.tail()
    assert "attempted to send logs to the API" not in b.tail(200_000)
    assert [n for n in names if not n.endswith("-duplicate")] == [run, f"{run}-attempt-2", f"{run}-attempt-3"], names
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    [mlrun] = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")
    tags = mlrun.data.tags
    assert tags["memfit.recovery.2"].startswith("cause=runner_shutdown"), tags
    assert tags["memfit.recovery.3"].startswith("cause=preempted") and tags["memfit.attempts"] == "3", tags


def test_bad_input_and_cancelled_runs_are_not_restarted_and_apply_is_idempotent(cluster):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from flows.recovery import apply_automations
    from memfit import config as cfgmod

    machine = serve_machine(cluster, Machine(cluster["root"], "plain", cluster["env"]), "plain")
    try:
        with get_client(sync_client=True) as client:
            deployment = deployment_of(client, machine, "plain")
            params = dict(deployment.parameters)
            params["config"] = {**params["config"], "data": {**params["config"]["data"], "path": "/nonexistent/x"}}
            bad = client.create_flow_run_from_deployment(deployment.id, parameters=params)
            bad = wait_until("the bad-input run ended", lambda: final_run(client, bad.id), 120, machine.tail)
            assert bad.state.type.value == "FAILED" and bad.state.name == "Failed", bad.state
            good = client.create_flow_run_from_deployment(deployment.id)
            wait_until("running", lambda: client.read_flow_run(good.id).state.is_running(), 120, machine.tail)
            client.set_flow_run_state(good.id, Cancelling(), force=True)
            cancelled = wait_until("cancelled", lambda: final_run(client, good.id), 120, machine.tail)
            assert cancelled.state.type.value == "CANCELLED", cancelled.state
            time.sleep(8)  # several times the restart delay (1 s): a restart would exist by now
            ids = {r.id for r in runs_of(client, deployment.id, "plain")}
            assert ids == {bad.id, good.id}, ids
            cfg = cfgmod.load(TINY, overrides_as_list("plain", cluster))
            first, second = apply_automations(cfg), apply_automations(cfg)
            assert {r["applied"] for r in second} == {"unchanged"}, second
            mine = [a for a in client.read_automations() if a.name.startswith("memfit: ")]
            assert sorted(a.name for a in mine) == sorted(r["name"] for r in first)
    finally:
        machine.stop()


def overrides_as_list(run: str, cluster) -> list[str]:
    args = overrides(run, f"s3://{cluster['bucket']}/{run}", cluster["tracking"])
    return args[1::2]


def test_a_vanished_worker_machine_is_restarted_on_the_other_worker(cluster, reference_weights):
    """The same with `prefect deploy` and a process work pool: two workers stand for two machines (each its own
    work folder, MEMFIT_HOME for the deployment's pull step), the automations applied by the CLI."""
    import yaml
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from memfit import config as cfgmod

    run, s3, bucket, root = "workers", cluster["s3"], cluster["bucket"], cluster["root"]
    pool, sets = "memfit-process-e2e", overrides(run, f"s3://{bucket}/{run}", cluster["tracking"])
    env = cluster["env"]
    cfg = cfgmod.load(TINY, sets[1::2])
    deploy_file = root / "workers-prefect.yaml"
    deploy_file.write_text(yaml.safe_dump({
        "name": "memfit", "prefect-version": "3.9.1", "build": None, "push": None,
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $MEMFIT_HOME }}"}}],
        "deployments": [{"name": "finetune-workers", "entrypoint": "flows/finetune.py:finetune",
                         "work_pool": {"name": pool, "job_variables": {
                             "env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}}},
                         "tags": ["memfit", "memfit-recovery"],
                         "parameters": {"config": cfg.model_dump(mode="json")}}]}))
    for args in (["prefect", "work-pool", "create", "--type", "process", pool],
                 ["prefect", "--no-prompt", "deploy", "--prefect-file", str(deploy_file), "--name",
                  "finetune-workers"],
                 ["memfit", "automations", "apply", TINY, *sets]):
        done = subprocess.run([str(BIN / args[0]), *args[1:]], env={**env, "PREFECT_HOME": str(root / "cli-home")},
                              cwd=REPO, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    machines = []
    for name in ("worker-a", "worker-b"):
        m = Machine(root, name, env)
        for link in ("flows", "tasks", "configs"):
            (m.dir / link).rmdir() if (m.dir / link).is_dir() and not (m.dir / link).is_symlink() else None
            (m.dir / link).symlink_to(REPO / link)
        m.env["MEMFIT_HOME"] = str(m.dir)
        machines.append(m)
    a, b = machines
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    worker = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--prefetch-seconds", "5"]
    try:
        a.start([*worker, "--name", "worker-a"])
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("memfit-finetune/finetune-workers")
            first = client.create_flow_run_from_deployment(deployment.id)
            wait_until("two training checkpoints committed", lambda: len(complete_checkpoints(s3, bucket, run)) >= 2,
                       300, context, every=0.2)
            a.vanish()
            newest = complete_checkpoints(s3, bucket, run)[-1]
            b.start([*worker, "--name", "worker-b"])
            state = wait_until("marked Crashed", lambda: (s := client.read_flow_run(first.id).state).type.value ==
                               "CRASHED" and s, 50 + 60, context)
            assert "no heartbeat" in state.message
            second = wait_until("restarted and finished", lambda: _next_final(client, deployment.id, first.id), 400,
                                context, every=2)
    finally:
        a.stop()
        b.stop()
    assert second.state.is_completed(), (second.state, context())
    assert second.name == f"{run}-attempt-2" and second.parameters == first.parameters
    assert b.weights() is not None and a.weights() is None, context()
    assert b.weights().read_bytes() == reference_weights(), "recovered weights differ"
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["memfit.recovery.last_cause"] == "vanished"
    assert runs[0].data.metrics["recovery/resumed_from_step"] == newest


def _next_final(client, deployment_id, first_id):
    runs = [r for r in flow_runs(client, deployment_id=deployment_id) if r.id != first_id]
    return runs[0] if runs and runs[0].state and runs[0].state.is_final() else None


def _plan_artifact(client, flow_run_id) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    found = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=["memory-plan"])))
    return found[0].data if found else ""


def test_a_run_stopped_at_the_memory_limit_restarts_with_a_leaner_stack_and_completes(cluster):
    """monitor.stop_at_fraction stops the planner's first choice (no checkpointing) at step 10: the run ends
    MemoryLimit, the automation restarts it on its own, and the restart, on another machine, reads the measured
    peak from the checkpoint store, plans a leaner stack, resumes from step 10 and completes."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket = "leaner", cluster["s3"], cluster["bucket"]
    # Short, and the planner's first choice fits its own limit but not the monitor's (as in
    # tests/integration/test_leaner_restart.py); the 20 s backoff leaves time to take machine A away.
    short = ["train.max_steps=40", "memory.loss=plain", "recovery.backoff_seconds=20",
             "recovery.max_backoff_seconds=20"]
    sets = overrides(run, f"s3://{bucket}/{run}", cluster["tracking"], *short)
    env = {**cluster["env"], "PREFECT_HOME": str(cluster["root"] / "plan-home")}
    planned = subprocess.run([str(BIN / "memfit"), "plan", TINY, *sets, "--json"], env=env, cwd=cluster["root"],
                             capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-3000:]
    peak = json.loads(planned.stdout.strip().splitlines()[-1])["predicted_peak_bytes"]
    budget = [f"memory.budget_gb={peak / 0.925 / 1e9:.9f}", "monitor.stop_at_fraction=0.85"]
    limit = peak / 0.925 * 0.85
    a = serve_machine(cluster, Machine(cluster["root"], "mem-a", cluster["env"]), run, *short, *budget)
    b = Machine(cluster["root"], "mem-b", cluster["env"])
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    try:
        with get_client(sync_client=True) as client:
            deployment = deployment_of(client, a, run)
            first = client.create_flow_run_from_deployment(deployment.id)
            ended = wait_until("the first attempt ended", lambda: final_run(client, first.id), 300, context)
            assert ended.state.name == "MemoryLimit", (ended.state, context())
            assert "at step 10 passed monitor.stop_at_fraction=0.85" in ended.state.message
            assert "`none`" in _plan_artifact(client, first.id)
            a.stop()  # machine A is gone before the restart is due: B has no local copy of the measured peak
            serve_machine(cluster, b, run, *short, *budget)
            second = wait_until("the restart scheduled", lambda: next_run(client, deployment.id, run, {first.id}), 60,
                                context, every=0.5)
            second = wait_until("the restart finished", lambda: final_run(client, second.id), 400, context, every=2)
            assert second.state.is_completed(), (second.state, context())
            assert "memfit-attempt:2" in second.tags and second.parameters == first.parameters
            leaner = _plan_artifact(client, second.id)
    finally:
        a.stop()
        b.stop()
    record = json.loads(s3.get_object(Bucket=bucket, Key=f"{run}/memory-limits.json")["Body"].read())["records"]
    assert [r["kinds"] for r in record] == [["none", "none"]] and record[0]["measured_bytes"] > limit
    assert "leaner than none, fp32, micro-batch 8x2, which measured" in leaner, leaner
    # The candidate table says why the stack that stopped is out, and the restart chose another (a checkpointing
    # policy, or the same blocks with lean layers: whichever is fastest once scaled by what the first one measured).
    rows = [line for line in leaner.splitlines() if line.startswith("| ")]
    stopped = "| none | 2 none | fp32 | 8 x 2 | no | plain / adamw |"
    assert any(stopped in r and "no: measured" in r for r in rows), leaner
    assert not any(stopped in r for r in rows if r.startswith("| **chosen**")), leaner
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    [mlrun] = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["memfit.recovery.last_cause"] == "memory_limit"
    assert "from_step=10" in mlrun.data.tags["memfit.recovery.2"]
    peaks = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "memory/peak_bytes")}
    assert peaks[10] > limit and max(v for s, v in peaks.items() if s > 10) <= limit, peaks
