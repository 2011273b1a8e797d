"""Unattended recovery: a run whose machine vanishes (or is preempted) finishes by itself on another machine.

A real `prefect server` with memfit's automations, two `memfit serve` processes standing for two machines (each
its own work folder and Prefect home), training checkpoints in moto S3, one real `mlflow server`. No command is
typed after a kill: detection (heartbeats), the restart (an automation) and the resume happen on their own.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from recovery_support import (
    BIN,
    REPO,
    TINY,
    Machine,
    complete_checkpoints,
    flow_runs,
    ks,
    machine_env,
    overrides,
    wait_until,
)
from servers import mlflow_server, prefect_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_home_template, moto_server):
    """One Prefect server, one MLflow server, one bucket; machines are started per test."""
    root = tmp_path_factory.mktemp("recovery")
    s3 = ks.s3_client(moto_server)
    bucket = f"recovery-{int(time.time())}"
    s3.create_bucket(Bucket=bucket)
    (root / "mlflow").mkdir()
    with prefect_server(root, BIN, prefect_home_template) as api, \
            mlflow_server(root / "mlflow", ks.cli_env(moto_server, root)) as tracking:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield {"root": root, "api": api, "tracking": tracking, "s3": s3, "bucket": bucket,
                   "env": machine_env(moto_server, api), "endpoint": moto_server}


def _serve(cluster, machine: Machine, run: str, *extra: str) -> Machine:
    """`memfit serve` on that machine, with the run's config as the deployment's parameters."""
    sets = overrides(run, f"s3://{cluster['bucket']}/{run}", cluster["tracking"], *extra)
    return machine.start([str(BIN / "memfit"), "serve", TINY, *sets])


def _deployment(client, machine: Machine, run: str):
    """The finetune deployment once this machine's `memfit serve` registered it with `run`'s config (an earlier
    test's registration of the same deployment may still be there)."""
    def found():
        assert machine.proc.poll() is None, machine.tail()
        try:
            deployment = client.read_deployment_by_name("memfit-finetune/finetune")
        except Exception:  # noqa: BLE001 - not registered yet
            return None
        return deployment if deployment.parameters["config"]["run"]["name"] == run else None

    return wait_until("deployment registered", found, 120, machine.tail)


@pytest.fixture(scope="module")
def reference_weights(cluster) -> bytes:
    """The run uninterrupted, by `memfit run` in the default mode: the weights every recovery must equal (the run's
    name and stores do not enter the numerics, so one reference serves every test here)."""
    folder = cluster["root"] / "reference"
    folder.mkdir()
    env = {**ks.cli_env(cluster["endpoint"], folder / "prefect-home")}
    sets = overrides("reference", f"s3://{cluster['bucket']}/reference", f"sqlite:///{folder / 'mlflow.db'}")
    done = subprocess.run([str(BIN / "memfit"), "run", TINY, *sets, "--json"], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(folder.glob("runs/**/export/hf/model.safetensors")).read_bytes()


def test_a_vanished_machine_is_detected_restarted_elsewhere_and_finishes(cluster, reference_weights):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket = "vanish", cluster["s3"], cluster["bucket"]
    a = _serve(cluster, Machine(cluster["root"], "machine-a", cluster["env"]), run)
    b = Machine(cluster["root"], "machine-b", cluster["env"])
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    try:
        with get_client(sync_client=True) as client:
            deployment = _deployment(client, a, run)
            names = {x.name for x in client.read_automations()}
            assert names >= {"memfit: mark silent runs crashed", "memfit: restart preempted or vanished runs"}
            first = client.create_flow_run_from_deployment(deployment.id)
            wait_until("two training checkpoints committed", lambda: len(complete_checkpoints(s3, bucket, run)) >= 2,
                       300, context, every=0.2)
            a.vanish()
            killed_at, newest = time.monotonic(), complete_checkpoints(s3, bucket, run)[-1]
            # Machine B comes up; nobody touches the run.
            _serve(cluster, b, run)

            def crashed():
                state = client.read_flow_run(first.id).state
                return state if state.type.value == "CRASHED" else None

            state = wait_until("the silent run marked Crashed", crashed, 50 + 60, context)
            crashed_after = time.monotonic() - killed_at
            assert "no heartbeat" in (state.message or ""), state

            def restarted_and_done():
                runs = [r for r in _runs_of(client, deployment.id, run) if r.id != first.id]
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
    assert b.weights().read_bytes() == reference_weights, "recovered weights differ"
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


def _final(client, flow_run_id):
    run = client.read_flow_run(flow_run_id)
    return run if run.state and run.state.is_final() else None


def _runs_of(client, deployment_id, run: str) -> list:
    """The deployment's flow runs of this logical run (earlier tests ran the same deployment with other names)."""
    return [r for r in flow_runs(client, deployment_id=deployment_id)
            if r.parameters.get("config", {}).get("run", {}).get("name") == run]


def _next_run(client, deployment_id, run: str, after: set) -> object:
    runs = [r for r in _runs_of(client, deployment_id, run) if r.id not in after]
    return runs[0] if runs else None


def _preemption_chain(cluster, run: str, max_restarts: int, kills: int) -> tuple[object, list[str]]:
    """A run preempted `kills` times (SIGTERM to its machine after a new training checkpoint each time), a new
    machine started after each; returns the last flow run once final, and the flow runs' names."""
    from prefect.client.orchestration import get_client

    s3, bucket, budget = cluster["s3"], cluster["bucket"], f"recovery.max_restarts={max_restarts}"
    machines = [Machine(cluster["root"], f"{run}-{i}", cluster["env"]) for i in range(kills + 1)]
    context = lambda: "\n".join(f"--- {m.dir.name} ---\n{m.tail()}" for m in machines)  # noqa: E731
    seen: set = set()
    try:
        with get_client(sync_client=True) as client:
            _serve(cluster, machines[0], run, budget)
            deployment = _deployment(client, machines[0], run)
            current = client.create_flow_run_from_deployment(deployment.id)
            for i in range(kills):
                seen.add(current.id)
                before = len(complete_checkpoints(s3, bucket, run))
                wait_until(f"a training checkpoint of attempt {i + 1}",
                           lambda n=before: len(complete_checkpoints(s3, bucket, run)) > n, 300, context, every=0.2)
                machines[i].preempt()
                ended = wait_until(f"attempt {i + 1} ended", lambda c=current: _final(client, c.id), 60, context)
                assert ended.state.name == "Preempted", (ended.state, context())
                assert "training checkpoint" in ended.state.message
                ended_at = time.monotonic()
                # The restart exists before the silence window (50 s) could have passed: it came from the state.
                current = wait_until("the restart scheduled", lambda: _next_run(client, deployment.id, run, seen), 30,
                                     context, every=0.5)
                assert time.monotonic() - ended_at < 30
                _serve(cluster, machines[i + 1], run, budget)
            final = wait_until("the last attempt ended", lambda: _final(client, current.id), 300, context, every=2)
            return final, [r.name for r in _runs_of(client, deployment.id, run)]
    finally:
        for m in machines:
            m.stop()


def test_preemption_restarts_at_once_and_the_budget_ends_the_run(cluster):
    """SIGTERM (a spot notice) ends the run Preempted and it is restarted after the backoff, without waiting for
    the silence window; with recovery.max_restarts: 1 the second preemption's restart ends RestartBudgetSpent."""
    final, names = _preemption_chain(cluster, "preempt", max_restarts=1, kills=2)
    assert final.state.name == "RestartBudgetSpent", final.state
    assert "1 of recovery.max_restarts=1" in final.state.message and "preempted" in final.state.message
    assert names == ["preempt", "preempt-attempt-2", "preempt-attempt-3"], names


def test_three_preemptions_three_restarts_then_completion(cluster, reference_weights):
    from mlflow import MlflowClient

    final, names = _preemption_chain(cluster, "thrice", max_restarts=3, kills=3)
    assert final.state.is_completed(), final.state
    assert names == ["thrice", "thrice-attempt-2", "thrice-attempt-3", "thrice-attempt-4"], names
    weights = next((cluster["root"] / "thrice-3").glob("runs/**/export/hf/model.safetensors"))
    assert weights.read_bytes() == reference_weights
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    (mrun,) = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'thrice'")
    assert mrun.data.tags["memfit.attempts"] == "4" and mrun.data.tags["memfit.recovery.last_cause"] == "preempted"
    assert all(f"memfit.recovery.{n}" in mrun.data.tags for n in (2, 3, 4))
    assert mrun.data.metrics["recovery/steps_lost"] == 0  # a preemption saves at the step it stops


def test_bad_input_and_cancelled_runs_are_not_restarted_and_apply_is_idempotent(cluster):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from flows.recovery import apply_automations
    from memfit import config as cfgmod

    machine = _serve(cluster, Machine(cluster["root"], "plain", cluster["env"]), "plain")
    try:
        with get_client(sync_client=True) as client:
            deployment = _deployment(client, machine, "plain")
            params = dict(deployment.parameters)
            params["config"] = {**params["config"], "data": {**params["config"]["data"], "path": "/nonexistent/x"}}
            bad = client.create_flow_run_from_deployment(deployment.id, parameters=params)
            bad = wait_until("the bad-input run ended", lambda: _final(client, bad.id), 120, machine.tail)
            assert bad.state.type.value == "FAILED" and bad.state.name == "Failed", bad.state
            good = client.create_flow_run_from_deployment(deployment.id)
            wait_until("running", lambda: client.read_flow_run(good.id).state.is_running(), 120, machine.tail)
            client.set_flow_run_state(good.id, Cancelling(), force=True)
            cancelled = wait_until("cancelled", lambda: _final(client, good.id), 120, machine.tail)
            assert cancelled.state.type.value == "CANCELLED", cancelled.state
            time.sleep(8)  # several times the restart delay (1 s): a restart would exist by now
            ids = {r.id for r in _runs_of(client, deployment.id, "plain")}
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
    assert b.weights().read_bytes() == reference_weights, "recovered weights differ"
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
    a = _serve(cluster, Machine(cluster["root"], "mem-a", cluster["env"]), run, *short, *budget)
    b = Machine(cluster["root"], "mem-b", cluster["env"])
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    try:
        with get_client(sync_client=True) as client:
            deployment = _deployment(client, a, run)
            first = client.create_flow_run_from_deployment(deployment.id)
            ended = wait_until("the first attempt ended", lambda: _final(client, first.id), 300, context)
            assert ended.state.name == "MemoryLimit", (ended.state, context())
            assert "at step 10 passed monitor.stop_at_fraction=0.85" in ended.state.message
            assert "`none`" in _plan_artifact(client, first.id)
            a.stop()  # machine A is gone before the restart is due: B has no local copy of the measured peak
            _serve(cluster, b, run, *short, *budget)
            second = wait_until("the restart scheduled", lambda: _next_run(client, deployment.id, run, {first.id}), 60,
                                context, every=0.5)
            second = wait_until("the restart finished", lambda: _final(client, second.id), 400, context, every=2)
            assert second.state.is_completed(), (second.state, context())
            assert "memfit-attempt:2" in second.tags and second.parameters == first.parameters
            leaner = _plan_artifact(client, second.id)
    finally:
        a.stop()
        b.stop()
    record = json.loads(s3.get_object(Bucket=bucket, Key=f"{run}/memory-limits.json")["Body"].read())["records"]
    assert [r["kinds"] for r in record] == [["none", "none"]] and record[0]["measured_bytes"] > limit
    assert "`none`" not in leaner and "leaner than none, fp32, micro-batch 8x2, which measured" in leaner, leaner
    assert "no: measured" in leaner  # the candidate table says why the first stack is out
    client = MlflowClient(cluster["tracking"])
    exp = client.get_experiment_by_name("recovery-e2e")
    [mlrun] = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["memfit.recovery.last_cause"] == "memory_limit"
    assert "from_step=10" in mlrun.data.tags["memfit.recovery.2"]
    peaks = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "memory/peak_bytes")}
    assert peaks[10] > limit and max(v for s, v in peaks.items() if s > 10) <= limit, peaks
