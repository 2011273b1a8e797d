"""After a retrain that passes the gate: refresh the running `memfit serve-model` (or start one) on the new champion."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prefect import flow, get_run_logger, task

from flows.retrain import retrain
from memfit.config import MemfitConfig
from memfit.errors import ModelLoadError
from memfit.reports import RunSummary


def _health(url: str) -> dict[str, Any] | None:
    try:
        return httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None


def refresh(url: str, version: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Ask the server at `url` to poll its alias now and wait until it serves `version`; its /health then.

    ModelLoadError when the server kept its old model (the reason is the server's own line) or never got there."""
    deadline = time.monotonic() + timeout_s
    health: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        try:
            health = httpx.post(f"{url}/admin/refresh", timeout=timeout_s).json()
        except (httpx.HTTPError, ValueError):
            health = _health(url)
        if health and health.get("version") == version:
            return health
        if health and health.get("last_error") and f"version {version} " in health["last_error"]:
            raise ModelLoadError(f"{url} kept {health['model']}: {health['last_error']}")
        time.sleep(1.0)
    raise ModelLoadError(f"{url} did not serve version {version} within {timeout_s:.0f} s (last /health: {health})")


def start_server(config_path: Path, url: str, log_file: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """`memfit serve-model` on config_path as a process of its own (it outlives this flow run); its /health."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        subprocess.Popen([sys.executable, "-m", "memfit.cli", "serve-model", "--config", str(config_path)],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = _health(url)
        if health:
            return health
        time.sleep(1.0)
    raise ModelLoadError(f"memfit serve-model did not answer at {url} within {timeout_s:.0f} s; see {log_file}")


@task(name="refresh-model-server", retries=1, retry_delay_seconds=10)
def refresh_server_task(config: MemfitConfig, version: str, start_if_down: bool) -> dict[str, Any]:
    """The server on config.serve follows the new champion now; started on it when none answers."""
    logger = get_run_logger()
    host = "127.0.0.1" if config.serve.host in ("0.0.0.0", "::") else config.serve.host
    url = f"http://{host}:{config.serve.port}"
    if _health(url) is None:
        if not start_if_down:
            logger.warning("no memfit serve-model answers at %s: nothing to refresh", url)
            return {}
        work = Path(config.run.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        config_path = work / "serve-model.yaml"
        config_path.write_text(config.to_yaml())
        health = start_server(config_path, url, work / "logs" / "serve-model.log")
        logger.info("started memfit serve-model at %s: %s", url, health.get("model"))
        return health
    health = refresh(url, version)
    logger.info("memfit serve-model at %s now serves %s", url, health["model"])
    return health


@flow(name="memfit-retrain-and-serve", flow_run_name="{config.run.name}-retrain-serve", log_prints=True,
      validate_parameters=True)
def retrain_and_serve(config: MemfitConfig = MemfitConfig(), data_uri: str | None = None,  # noqa: B008
                      start_if_down: bool = True) -> RunSummary:
    """Retrain; when the gate passes and moves the alias, the model server serves the new version at once."""
    summary = retrain(config=config, data_uri=data_uri)
    if summary.gate_passed and summary.model_version:
        refresh_server_task(config, summary.model_version, start_if_down)
    return summary
