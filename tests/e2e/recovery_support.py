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


def newest_checkpoint(s3: Any, bucket: str, prefix: str) -> int:
    """The step of the newest complete training checkpoint, -1 before the first. Wait on this, never on how many
    there are: retention (checkpoint.keep_last=2) deletes the oldest after each commit, so the count stays at 2 and
    a new checkpoint shows as a third only between a commit and the pruning — a window a poller can miss (which is
    how the chain test once saw "no training checkpoint of attempt 3 within 300 s" while attempt 3 committed two
    and completed)."""
    return max(complete_checkpoints(s3, bucket, prefix), default=-1)


def flow_runs(client: Any, run_tag: str | None = None, deployment_id: Any = None) -> list[Any]:
    """The newest 200 flow runs, oldest first. Newest: the stress loop puts four runs a round on one deployment,
    and the oldest 50 once hid round 13's restart (a restart is found before it runs, under Prefect's random name,
    so the name cannot narrow the query)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    flt = FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag]) if run_tag else None,
                        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]) if deployment_id else None)
    return client.read_flow_runs(flow_run_filter=flt, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)[::-1]


# -- a cluster's deployment runs (the recovery tests and the stress loop share these) -------------------------------

def serve_machine(cluster: dict[str, Any], machine: Machine, run: str, *extra: str) -> Machine:
    """`memfit serve` on that machine, with the run's config as the deployment's parameters."""
    sets = overrides(run, f"s3://{cluster['bucket']}/{run}", cluster["tracking"], *extra)
    return machine.start([str(BIN / "memfit"), "serve", TINY, *sets])


def deployment_of(client: Any, machine: Machine, run: str) -> Any:
    """The finetune deployment once this machine's `memfit serve` registered it with `run`'s config (an earlier
    test's registration of the same deployment may still be there)."""
    def found() -> Any:
        assert machine.proc is not None and machine.proc.poll() is None, machine.tail()
        try:
            deployment = client.read_deployment_by_name("memfit-finetune/finetune")
        except Exception:  # noqa: BLE001 - not registered yet
            return None
        return deployment if deployment.parameters["config"]["run"]["name"] == run else None

    return wait_until("deployment registered", found, 120, machine.tail)


def final_run(client: Any, flow_run_id: Any) -> Any:
    run = client.read_flow_run(flow_run_id)
    return run if run.state and run.state.is_final() else None


def runs_of(client: Any, deployment_id: Any, run: str) -> list[Any]:
    """The deployment's flow runs of this logical run (earlier tests ran the same deployment with other names)."""
    return [r for r in flow_runs(client, deployment_id=deployment_id)
            if r.parameters.get("config", {}).get("run", {}).get("name") == run]


def next_run(client: Any, deployment_id: Any, run: str, after: set) -> Any:
    runs = [r for r in runs_of(client, deployment_id, run) if r.id not in after]
    return runs[0] if runs else None


def preemption_chain(cluster: dict[str, Any], run: str, max_restarts: int, kills: int) -> tuple[Any, list[str]]:
    """A run preempted `kills` times (SIGTERM to its machine after a new training checkpoint each time), a new
    machine started after each; returns the last flow run once final, and the flow runs' names."""
    from prefect.client.orchestration import get_client

    s3, bucket, budget = cluster["s3"], cluster["bucket"], f"recovery.max_restarts={max_restarts}"
    machines = [Machine(cluster["root"], f"{run}-{i}", cluster["env"]) for i in range(kills + 1)]
    context = lambda: "\n".join(f"--- {m.dir.name} ---\n{m.tail()}" for m in machines)  # noqa: E731
    seen: set = set()
    deployment = None
    try:
        with get_client(sync_client=True) as client:
            serve_machine(cluster, machines[0], run, budget)
            deployment = deployment_of(client, machines[0], run)
            current = client.create_flow_run_from_deployment(deployment.id)
            for i in range(kills):
                seen.add(current.id)
                before = newest_checkpoint(s3, bucket, run)
                wait_until(f"a training checkpoint of attempt {i + 1}",
                           lambda n=before: newest_checkpoint(s3, bucket, run) > n, 300, context, every=0.2)
                machines[i].preempt()
                ended = wait_until(f"attempt {i + 1} ended", lambda c=current: final_run(client, c.id), 60, context)
                assert ended.state.name == "Preempted", (ended.state, context())
                # Saved by the run itself at the step it stopped, not ended by the drain deadline after a hang (a
                # handler that logged once waited for ever on a log lock: tests/unit/test_signal_relay.py).
                assert ended.state.message.startswith("preempted at step"), (ended.state.message, context())
                ended_at = time.monotonic()
                # The restart exists before the silence window (50 s) could have passed: it came from the state.
                current = wait_until("the restart scheduled", lambda: next_run(client, deployment.id, run, seen), 30,
                                     context, every=0.5)
                assert time.monotonic() - ended_at < 30
                serve_machine(cluster, machines[i + 1], run, budget)
            final = wait_until("the last attempt ended", lambda: final_run(client, current.id), 300, context, every=2)
            return final, [r.name for r in runs_of(client, deployment.id, run)]
    finally:
        for m in machines:
            m.stop()
        if deployment is not None:
            cancel_leftovers(deployment.id, run)


def cancel_leftovers(deployment_id: Any, run: str) -> None:
    """After a failed round, its runs not yet final are cancelled (a person's cancel: recovery leaves it), so
    the next round's machines, serving the same deployment, do not pick them up."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        for r in runs_of(client, deployment_id, run):
            if not (r.state and r.state.is_final()):
                client.set_flow_run_state(r.id, Cancelled(message="cancelled by the test after its round"), force=True)


# Prefect's own runner serving memfit's deployment, as a plain `prefect.serve` (or a memfit before its draining
# runner) does: on SIGTERM it cancels the runs in flight with "Runner is shutting down." — the Cancelled that no
# person asked for, which recovery must restart.
_PLAIN_RUNNER = """
import os, sys
from memfit import config
from flows.deploy import build_deployments
from flows.recovery import apply_automations
from prefect import serve
cfg = config.load(sys.argv[1], sys.argv[2:])
os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(cfg.recovery.heartbeat_seconds))
apply_automations(cfg)
serve(*build_deployments(cfg, ("finetune",)), pause_on_shutdown=False, query_seconds=cfg.deploy.poll_seconds)
"""


def serve_plain_prefect(cluster: dict[str, Any], machine: Machine, run: str, *extra: str) -> Machine:
    sets = overrides(run, f"s3://{cluster['bucket']}/{run}", cluster["tracking"], *extra)
    return machine.start([sys.executable, "-c", _PLAIN_RUNNER, TINY, *sets[1::2]])
