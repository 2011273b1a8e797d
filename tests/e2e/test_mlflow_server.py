"""A spot-style run against a real `mlflow server` (artifacts in moto S3): preempted, resumed in ONE run,
exported, uploaded and registered, with planted secrets absent from everything the server stored."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]
REPO = Path(__file__).resolve().parents[2]
PLANTED_PASSWORD = "planted-uri-password-41d7"  # in tracking.uri: a config value
PLANTED_ENV = ("MEMFIT_PLANTED_SECRET_TOKEN", "planted-env-token-93ac55")  # in the environment
SERVER_AWS_SECRET = "planted-server-aws-secret-0e6f"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(moto_server, tmp_path_factory):
    """`mlflow server --workers 1` on 127.0.0.1, SQLite backend, artifacts proxied to a moto S3 bucket."""
    import boto3

    root = tmp_path_factory.mktemp("mlflow-server")
    bucket = "mlflow-artifacts"
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1", aws_access_key_id="server",
                 aws_secret_access_key=SERVER_AWS_SECRET).create_bucket(Bucket=bucket)
    port = _free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "server", "AWS_SECRET_ACCESS_KEY": SERVER_AWS_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_S3_ENDPOINT_URL": moto_server,
           "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1,localhost", "MLFLOW_DISABLE_TELEMETRY": "true"}
    db = root / "server.db"
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed after the server stops
    # Its own session: mlflow server leaves worker processes behind when only its PID is killed.
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
                             "--artifacts-destination", f"s3://{bucket}/mlartifacts"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("mlflow server did not come up:\n" + (root / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        yield {"port": port, "bucket": bucket, "db": db, "endpoint": moto_server}
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def _all_s3_bytes(client, bucket: str) -> list[tuple[str, bytes]]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out.append((obj["Key"], client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()))
    return out


def test_preempted_run_resumes_in_one_run_and_registers(mlflow_server, s3_env, s3_client, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tests_support import tiny_overrides

    from memfit import config, phases
    from memfit.errors import Preempted
    from memfit.tracking.mlflow_tracker import MLflowTracker

    port, bucket = mlflow_server["port"], mlflow_server["bucket"]
    s3_client.create_bucket(Bucket="runs")
    monkeypatch.setenv(*PLANTED_ENV)
    uri = f"http://memfit:{PLANTED_PASSWORD}@127.0.0.1:{port}"
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, uri, **{
        "train.max_steps": 8, "checkpoint.every_steps": 3, "data.synthetic_docs": 300, "export.onnx": False,
        "checkpoint.uri": "s3://runs/tiny/checkpoints", "export.uri": "s3://runs/tiny/exports",
        "tracking.system_metrics_interval_s": 0.5}))
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)

    original = MLflowTracker.log_metrics

    def preempt_at_5(self, metrics, step):
        original(self, metrics, step)
        if step == 5 and "loss" in metrics:
            time.sleep(1.2)  # let the system-metrics sampler log in this segment too
            os.kill(os.getpid(), signal.SIGTERM)  # a spot reclaim

    monkeypatch.setattr(MLflowTracker, "log_metrics", preempt_at_5)
    with pytest.raises(Preempted):
        phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    monkeypatch.setattr(MLflowTracker, "log_metrics", original)

    client = MlflowClient(f"http://127.0.0.1:{port}")
    (killed,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert killed.info.status == "KILLED" and killed.data.tags["memfit.status"] == "preempted"
    system_before = client.get_metric_history(killed.info.run_id, "system/cpu_utilization_percentage")
    assert system_before  # sampled during the first segment

    resume = phases.recover_training_checkpoint(cfg)
    assert resume.step == 5 and resume.mlflow_run_id == killed.info.run_id  # the id travels in the checkpoint
    trained = phases.train(cfg, plan, resume, probe)
    exported = phases.evaluate_and_release(cfg, trained)
    assert trained.mlflow_run_id == killed.info.run_id

    exp_id = client.get_experiment_by_name("tests").experiment_id
    (run,) = client.search_runs([exp_id])  # ONE run for both segments and the export
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["memfit.resumed_from_step"] == "5" and run.data.tags["memfit.status"] == "completed"
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(loss_steps) == list(range(1, 9))  # before and after the preemption, each step once
    system = [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")]
    assert len(system) > len(system_before) and len(set(system)) == len(system)  # continued, no step reused

    # Registered from the server, artifacts in S3, the export uploaded with its manifest last.
    mv = client.get_model_version_by_alias("tiny", "champion")
    assert mv.run_id == run.info.run_id and exported.registry["version"] == str(mv.version)
    keys = [k for k, _ in _all_s3_bytes(s3_client, bucket)]
    assert any(k.endswith("/artifacts/plots/loss_curve.png") for k in keys)
    assert any(k.endswith("/artifacts/hf/model.safetensors") and "/models/" in k for k in keys)
    assert exported.export_uri == f"s3://runs/tiny/exports/{run.info.run_id}"
    assert mv.tags["memfit.export_uri"] == exported.export_uri
    from memfit.release.from_checkpoint import download_export

    assert (download_export(exported.export_uri, tmp_path / "dl") / "hf" / "model.safetensors").is_file()

    # Nothing the server stored holds a planted secret: its database and every artifact object in S3.
    planted = [PLANTED_PASSWORD.encode(), PLANTED_ENV[1].encode(), SERVER_AWS_SECRET.encode()]
    stored = [("server.db", mlflow_server["db"].read_bytes()), *_all_s3_bytes(s3_client, bucket)]
    assert len(stored) > 20
    for key, data in stored:
        assert not any(p in data for p in planted), key
    params = run.data.params
    assert params["tracking.uri"] == f"http://memfit:***@127.0.0.1:{port}"
