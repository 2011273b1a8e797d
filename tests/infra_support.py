"""Paths and readers the deployment-file tests share (unit: text and Prefect checks; integration: Compose)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
EXPECTED_SERVICES = {"postgres", "minio", "minio-init", "prefect-server", "mlflow", "worker", "worker-gpu", "serve"}


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())

def pinned(requirement_name: str) -> str:
    """The version pinned with == in pyproject's dependencies."""
    for req in pyproject()["project"]["dependencies"]:
        m = re.fullmatch(rf"{re.escape(requirement_name)}==([\w.+]+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise AssertionError(f"{requirement_name} is not pinned with == in pyproject.toml")

def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            values[key.strip()] = value.strip()
    return values
