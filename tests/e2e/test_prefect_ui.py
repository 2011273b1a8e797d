"""Run from the Prefect UI: a real `prefect server`, `memfit serve`, a run created through the API, the form."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import prefect_server, process_group

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium missing in CI: .ci/run installs Debian's chromium")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, prefect_home_template):
    tmp = tmp_path_factory.mktemp("ui")
    (tmp / "configs").symlink_to(REPO / "configs")
    with prefect_server(tmp, BIN, prefect_home_template) as api:
        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp / "prefect-home"),
               "PYTHONUNBUFFERED": "1"}
        args = [str(BIN / "memfit"), "serve", "configs/tiny.yaml", "--set", "train.max_steps=8",
                "--set", "checkpoint.every_steps=4", "--set", "data.synthetic_docs=300", "--set", "export.onnx=false",
                "--set", "tracking.experiment=ui-e2e", "--set", "deploy.poll_seconds=1"]
        from prefect.settings import PREFECT_API_URL, temporary_settings

        # Prefect's settings in this process, not only the environment: a test before this one in the same
        # process (an xdist worker runs many) may have left a settings context naming its own server.
        with process_group(args, env, tmp, tmp / "serve.log") as proc, \
                temporary_settings(updates={PREFECT_API_URL: api}):
            os.environ["PREFECT_API_URL"] = api
            try:
                from prefect.client.orchestration import get_client

                deadline = time.monotonic() + 120
                deployment = None
                while deployment is None:
                    assert proc.poll() is None, (tmp / "serve.log").read_text()[-3000:]
                    try:
                        with get_client(sync_client=True) as c:
                            deployment = c.read_deployment_by_name("memfit-finetune/finetune")
                    except Exception:  # noqa: BLE001 - not registered yet
                        assert time.monotonic() < deadline, (tmp / "serve.log").read_text()[-3000:]
                        time.sleep(1)
                yield api, deployment, tmp
            finally:
                os.environ.pop("PREFECT_API_URL", None)


def test_finetune_run_created_through_the_api(served):
    from prefect.client.orchestration import get_client

    api, deployment, tmp = served
    params = dict(deployment.parameters)
    params["config"]["train"]["max_steps"] = 6
    params["config"]["run"]["name"] = "from-the-api"
    with get_client(sync_client=True) as c:
        run = c.create_flow_run_from_deployment(deployment.id, parameters=params)
        deadline = time.monotonic() + 300
        while True:
            run = c.read_flow_run(run.id)
            if run.state and run.state.is_final():
                break
            assert time.monotonic() < deadline, (tmp / "serve.log").read_text()[-4000:]
            time.sleep(2)
        assert run.state.is_completed(), (run.state, (tmp / "serve.log").read_text()[-4000:])
        assert run.name == "from-the-api"
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        keys = {a.key for a in arts}
        assert {"baseline-probe", "memory-plan", "eval-and-export"} <= keys
        result = c.read_flow_run(run.id).state
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ui-e2e")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "from-the-api" and runs[0].info.status == "FINISHED"
    assert len(client.get_metric_history(runs[0].info.run_id, "loss")) == 6
    assert result.is_completed()


def test_ui_renders_the_parameter_form(served):
    api, deployment, tmp = served
    base = api.removesuffix("/api")
    url = f"{base}/deployments/deployment/{deployment.id}/run"
    proc = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium'}",
                           "--virtual-time-budget=30000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=180)
    dom = proc.stdout
    # The form is generated from the pydantic config: field descriptions from memfit/config/__init__.py appear in it.
    assert "Optimizer steps to train for" in dom, dom[-2000:]
    assert "Gradient checkpointing policy" in dom
    assert "finetune" in dom
