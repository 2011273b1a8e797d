"""Unattended recovery: a run whose machine vanishes (or is preempted) finishes by itself on another machine.

A real `prefect server` with memfit's automations, two `memfit serve` processes standing for two machines (each
its own work folder and Prefect home), training checkpoints in moto S3, one real `mlflow server`. No command is
typed after a kill: detection (heartbeats), the restart (an automation) and the resume happen on their own.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from recovery_support import BIN, TINY, Machine, complete_checkpoints, flow_runs, ks, machine_env, overrides, wait_until
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


def _deployment(client, machine: Machine):
    def found():
        assert machine.proc.poll() is None, machine.tail()
        try:
            return client.read_deployment_by_name("memfit-finetune/finetune")
        except Exception:  # noqa: BLE001 - not registered yet
            return None

    return wait_until("deployment registered", found, 120, machine.tail)


def _reference_weights(cluster, run: str) -> bytes:
    """The same run uninterrupted, by `memfit run` in the default mode: the weights every recovery must equal."""
    folder = cluster["root"] / f"reference-{run}"
    folder.mkdir()
    env = {**ks.cli_env(cluster["endpoint"], folder / "prefect-home")}
    sets = overrides(run, f"s3://{cluster['bucket']}/reference-{run}", f"sqlite:///{folder / 'mlflow.db'}")
    done = subprocess.run([str(BIN / "memfit"), "run", TINY, *sets, "--json"], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(folder.glob("runs/**/export/hf/model.safetensors")).read_bytes()


def test_a_vanished_machine_is_detected_restarted_elsewhere_and_finishes(cluster):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket = "vanish", cluster["s3"], cluster["bucket"]
    a = _serve(cluster, Machine(cluster["root"], "machine-a", cluster["env"]), run)
    b = Machine(cluster["root"], "machine-b", cluster["env"])
    context = lambda: f"--- A ---\n{a.tail()}\n--- B ---\n{b.tail()}"  # noqa: E731
    try:
        with get_client(sync_client=True) as client:
            deployment = _deployment(client, a)
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

            state = wait_until("the silent run marked Crashed", crashed, 35 + 60, context)
            crashed_after = time.monotonic() - killed_at
            assert "no heartbeat" in (state.message or ""), state

            def restarted_and_done():
                runs = [r for r in flow_runs(client, deployment_id=deployment.id) if r.id != first.id]
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
    assert crashed_after < 35 + 45, crashed_after
    assert b.weights() is not None and a.weights() is None, context()
    assert b.weights().read_bytes() == _reference_weights(cluster, run), "recovered weights differ"
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
