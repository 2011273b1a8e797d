"""Machines for the recovery tests: `memfit serve` or a process worker per work folder, one Prefect server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "bench"))
import kill_support as ks  # noqa: E402 - bench/ is scripts, not a package

TINY = str(REPO / "configs" / "tiny.yaml")


def overrides(name: str, checkpoint_uri: str, tracking_uri: str, *extra: str) -> list[str]:
    """A run long enough to be killed after two training checkpoints, short enough for the suite."""
    sets = [f"run.name={name}", "train.max_steps=160", "checkpoint.every_steps=20", "data.synthetic_docs=300",
            "export.onnx=false", f"checkpoint.uri={checkpoint_uri}", f"tracking.uri={tracking_uri}",
            "tracking.experiment=recovery-e2e", "deploy.poll_seconds=1", "recovery.heartbeat_seconds=30",
            "recovery.silent_after_seconds=50", "recovery.backoff_seconds=1", "recovery.max_backoff_seconds=4",
            "registry.enabled=false", *extra]
    return [arg for s in sets for arg in ("--set", s)]


class Machine:
    """One machine: its own work folder and Prefect home, running `memfit serve` (or a worker) in its own
    process group, so a SIGKILL of the group is the machine vanishing."""

    def __init__(self, root: Path, name: str, env: dict[str, str]) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "configs").mkdir(exist_ok=True)
        self.env = {**env, "PREFECT_HOME": str(self.dir / "prefect-home")}
        self.log = self.dir / "machine.log"
        self.proc: subprocess.Popen | None = None

    def start(self, args: list[str]) -> Machine:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, env=self.env, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def vanish(self) -> None:
        """SIGKILL everything the machine runs at once: its process group and every descendant (Prefect starts
        each flow run in a process group of its own, so the group alone would leave the training running)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        os.killpg(self.proc.pid, signal.SIGKILL)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)
        psutil.wait_procs(tree, timeout=10)

    def preempt(self, timeout: float = 120) -> int | None:
        """A spot notice to the whole machine: SIGTERM to its process group, then wait for it to end."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.vanish()
            return None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def weights(self) -> Path | None:
        found = sorted(self.dir.glob("runs/**/export/hf/model.safetensors"))
        return found[0] if found else None


def machine_env(endpoint: str, api: str) -> dict[str, str]:
    env = ks.cli_env(endpoint, Path("/nonexistent"))
    env.update({"PREFECT_API_URL": api, "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_LOGGING_LEVEL": "INFO"})
    return env


def wait_until(what: str, check: Callable[[], Any], timeout: float, context: Callable[[], str], every: float = 1.0
               ) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{context()}")
        time.sleep(every)


def complete_checkpoints(s3: Any, bucket: str, prefix: str) -> list[int]:
    resp = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    return sorted(int(o["Key"].split("/step-")[1].split("/")[0]) for o in resp.get("Contents", [])
                  if o["Key"].endswith("/manifest.json"))


def flow_runs(client: Any, run_tag: str | None = None, deployment_id: Any = None) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    flt = FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag]) if run_tag else None,
                        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]) if deployment_id else None)
    return client.read_flow_runs(flow_run_filter=flt, sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=50)
