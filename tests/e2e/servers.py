"""Real servers for end-to-end tests: started on 127.0.0.1 in their own process group, stopped as a group."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()[-3000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:] if log else ''}")


@contextmanager
def process_group(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """Run `args` in a new session; on exit SIGTERM the whole group (servers leave children behind)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


@contextmanager
def prefect_server(tmp: Path, bin_dir: Path, template: Path | None = None) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 with its own SQLite DB (a copy of `template`'s migrated one when
    given); yields the API URL."""
    if template is not None:
        shutil.copy(template / "prefect.db", tmp / "prefect.db")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"),
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp / 'prefect.db'}",
           "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}
    env.pop("PREFECT_API_URL", None)
    log = tmp / "prefect-server.log"
    with process_group([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                       env, tmp, log) as proc:
        wait_http(f"{api}/health", 120, proc, log)
        yield api


@contextmanager
def mlflow_server(root: Path, env: dict[str, str], artifacts: str | None = None) -> Iterator[str]:
    """`mlflow server --workers 1` on 127.0.0.1 with a SQLite backend (artifacts proxied to `artifacts`, e.g.
    an s3:// bucket, when given); yields its URL. Its own session: it leaves workers behind when only its PID
    is killed."""
    port = free_port()
    args = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'server.db'}"]
    args += ["--artifacts-destination", artifacts] if artifacts else ["--default-artifact-root", str(root / "art")]
    log = root / "mlflow-server.log"
    # No job runner and huey consumers (MLflow's GenAI jobs, which memfit never submits; tests/conftest.py): the
    # cluster's env is built afresh, and without this each start cost ~14 CPU s and left 7 consumers behind a killed
    # session.
    quiet = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with process_group(args, {**env, **quiet}, root, log) as proc:
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc, log)
        yield f"http://127.0.0.1:{port}"
