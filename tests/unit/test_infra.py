"""Static checks of the deployment files, without a Docker engine or a cluster.

- docker-compose.yml is read as YAML here; tests/integration/test_compose.py runs the real Compose binary.
- .env.example, the Dockerfiles and .dockerignore are read as text.
- infra/k8s/spot-work-pool.json is validated and rendered with Prefect's own work-pool
  validation and templating code.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from infra_support import EXPECTED_SERVICES, env_example, pinned

from memfit.runtime.spot import DEFAULT_METADATA_URL

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

CHECKPOINT_GRACE_S = 30  # memfit's checkpoint grace after SIGTERM
AWS_SPOT_NOTICE_S = 120


# --------------------------------------------------------------------------- helpers


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


def test_compose_file_shape() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert "version" not in raw, "the top-level `version:` key is obsolete in Compose v2"
    assert set(raw["services"]) == EXPECTED_SERVICES
    # named volumes only (no host paths for data)
    assert {"postgres-data", "minio-data"} <= set(raw["volumes"])


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
    documented = env_example()
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
    torch_pin = pinned("torch")
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
    assert f"mlflow=={pinned('mlflow')}" in text
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
