"""Kill-trial plumbing: a moto S3 server, `memfit run` in its own process group, the phase read from its log."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
REGION = "us-east-1"
FAKE_KEY = "testing"

# The flow's tasks in order; Prefect logs "Finished in state ..." once per task, so their count is the phase.
# The flow's tasks in order: the attempt record (restart bookkeeping) first, then the five phases.
TASKS = ["attempt", "probe", "planning", "recovery", "training", "evaluation"]
TASK_DONE = "prefect.task_runs: Finished in state"
FLOW_BEGUN = "Beginning flow run"
FLOW_DONE = "prefect.flow_runs: Finished in state"
COMMITTED = re.compile(r"training checkpoint step (\d+) committed")
RESUMED = re.compile(r"resuming from training checkpoint (\S+) \(step (\d+)\)")
FINISHED_ALREADY = re.compile(r"run already finished at step (\d+)")
SKIPPED = re.compile(r"skipping training checkpoint (\S+):")
# Phase 5 after evaluation, in the order its steps log (SafeTensors, ONNX, the MLflow model and registry).
EXPORT_STEPS = [("export: SafeTensors", re.compile(r"Writing model shards")),
                ("export: ONNX", re.compile(r"torch[./]onnx")),
                ("export: MLflow model", re.compile(r"Downloading artifacts|registered \S+ version"))]


def start_moto() -> tuple[object, str]:
    """moto's S3 server in a thread on a free 127.0.0.1 port; returns (server, endpoint)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def s3_client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=FAKE_KEY,
                        aws_secret_access_key=FAKE_KEY, config=Config(s3={"addressing_style": "path"}))


def cli_env(endpoint: str, prefect_home: Path) -> dict[str, str]:
    """The default mode as a user has it (no PREFECT_API_URL, local MLflow), boto3 on moto, telemetry off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_", "MLFLOW_", "MEMFIT_"))}
    env.update({
        "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(prefect_home),
        "AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_KEY, "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
        # A developer's ~/.aws must not redirect or authenticate these calls.
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    })
    return env


def migrate_home(home: Path, env: dict[str, str]) -> None:
    """Migrate a Prefect home's database once, as a user's first run does (the trials then start alike)."""
    home.mkdir(parents=True, exist_ok=True)
    prefect = Path(sys.executable).parent / "prefect"
    subprocess.run([str(prefect), "server", "database", "upgrade", "-y"], env={**env, "PREFECT_HOME": str(home)},
                   check=True, capture_output=True, timeout=300)


def overrides(uri: str, *extra: str) -> list[str]:
    """The issue's `--set` overrides; `extra` are more of them (the tests turn ONNX off)."""
    sets = [f"checkpoint.uri={uri}", "checkpoint.every_steps=3", "train.max_steps=40", *extra]
    return [a for s in sets for a in ("--set", s)]


def run_args(uri: str, *extra: str) -> list[str]:
    """`memfit run configs/tiny.yaml --set ... --json`, the issue's command."""
    return ["run", TINY, *overrides(uri, *extra), "--json"]


_live: list[Proc] = []  # every run started here, so an interrupted benchmark leaves no process behind


def kill_all() -> None:
    for proc in _live:
        if proc.proc.poll() is None:
            proc.kill()


class Proc:
    """`python -m memfit.cli ARGS` in a new session; stderr lines timestamped as read and copied to a log file."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.lines: list[tuple[float, str]] = []
        self._out: list[str] = []
        self._new = threading.Condition()
        self._log = open(log_path, "w", buffering=1)  # noqa: SIM115 - line-buffered; the reader closes it
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", *args], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        _live.append(self)
        self._readers = [threading.Thread(target=self._read_err, daemon=True),
                         threading.Thread(target=lambda: self._out.extend(self.proc.stdout), daemon=True)]
        for t in self._readers:
            t.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            with self._new:
                self.lines.append((time.monotonic() - self.t0, line))
                self._log.write(line)
                self._new.notify_all()
        self._log.close()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def log(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str | re.Pattern, count: int = 1, timeout: float = 300) -> float | None:
        """Seconds since start when `pattern` had matched `count` lines; None if the process ended or time ran out."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                hits = [t for t, line in self.lines if rx.search(line)]
                if len(hits) >= count:
                    return hits[count - 1]
                if self.proc.poll() is not None and not self._readers[0].is_alive():
                    return None
                if time.monotonic() > deadline:
                    return None
                self._new.wait(0.05)

    def kill(self) -> float:
        """SIGKILL the whole group (the machine is gone: the run, its Prefect server, anything it started)."""
        at = self.elapsed()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return at

    def finish(self, timeout: float) -> int | None:
        """The exit code; None when it did not end within `timeout` s (then the group is killed)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        else:
            code = self.proc.returncode
        for t in self._readers:
            t.join(timeout=10)
        return code

    def summary(self) -> dict:
        """The `--json` summary, last on stdout; {} when there is none (the run failed or was killed)."""
        lines = "".join(self._out).strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            return {}

    def weights(self) -> Path | None:
        """The exported SafeTensors file the summary names."""
        folder = self.summary().get("safetensors_dir")
        return Path(folder) / "model.safetensors" if folder else None


def phase_of(log: str) -> str:
    """The phase a run was in when its log stopped: the last task started, and within phase 5 the last step."""
    if FLOW_BEGUN not in log:
        return "Prefect start-up"
    if FLOW_DONE in log:
        return "flow teardown"
    done = log.count(TASK_DONE)
    if done >= len(TASKS):
        return "flow teardown"
    phase = TASKS[done]
    if phase == "training":
        steps = [int(s) for s in COMMITTED.findall(log)]
        if steps:
            return f"training (step {steps[-1]} committed)"
        return "training (steps begun)" if "memory at step 1:" in log else "training (set-up)"
    if phase == "evaluation":
        for name, rx in reversed(EXPORT_STEPS):
            if rx.search(log):
                return name
    return phase


@dataclass
class BucketState:
    """Training checkpoints under one prefix: complete ones (manifest present) and uploads left half-done."""

    complete: list[int] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)

    @property
    def newest(self) -> int:
        return self.complete[-1] if self.complete else 0

    @property
    def in_flight(self) -> list[int]:
        """Half-written step folders newer than the newest complete one: an upload the kill interrupted."""
        return [s for s in self.partial if s > self.newest]


def bucket_state(client, bucket: str, prefix: str) -> BucketState:
    keys: dict[int, set[str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            m = re.match(rf"{re.escape(prefix)}/step-(\d+)/(.+)$", obj["Key"])
            if m:
                keys.setdefault(int(m.group(1)), set()).add(m.group(2))
    state = BucketState()
    for step in sorted(keys):
        (state.complete if "manifest.json" in keys[step] else state.partial).append(step)
    return state


def left_behind(folder: Path, wait: float = 15) -> list[str]:
    """Processes still running in `folder` (their working directory) once `wait` s have passed: what a killed
    run left behind (memfit promises its Prefect server ends with it, even on SIGKILL). They are then ended."""
    import psutil

    def alive() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cwd"]):
            cwd = p.info.get("cwd")
            if cwd and Path(cwd).is_relative_to(folder):
                found.append(p)
        return found

    deadline = time.monotonic() + wait
    while (procs := alive()) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid}: {' '.join(p.cmdline())[:90]}")
            p.kill()
        except psutil.Error:
            pass
    return out


def resumed_step(log: str) -> int:
    """The step a rerun's training started from, as its log says (0: from scratch)."""
    m = RESUMED.search(log) or FINISHED_ALREADY.search(log)
    return int(m.groups()[-1]) if m else 0


def same_weights(a: Path | None, b: Path | None) -> tuple[bool, str]:
    """Bitwise comparison of two exported SafeTensors files: same names, dtypes, shapes and bytes."""
    import torch
    from safetensors.torch import load_file

    if a is None or b is None or not a.exists() or not b.exists():
        return False, f"no exported weights at {a if a is None or not a.exists() else b}"
    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return False, f"tensor names differ: {sorted(x.keys() ^ y.keys())[:3]}"

    def raw(t):  # bytes, not values: -0.0 == 0.0 and NaN != NaN would blur "bitwise"
        return t.contiguous().view(-1).view(torch.uint8)

    differ = [k for k in x if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape
              or not torch.equal(raw(x[k]), raw(y[k]))]
    return not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}" if differ else "bitwise equal"


class _Planted:
    """Unpickling this creates `marker`: proof that a loader ran a pickle it was never meant to load."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker, 0o755, True)


def pickle_payloads(marker: Path) -> dict[str, bytes]:
    """A plain pickle and a torch.save file, each creating `marker` when loaded; checked live before use."""
    import io

    import torch

    def build(target: Path) -> dict[str, bytes]:
        buf = io.BytesIO()
        torch.save({"state": _Planted(str(target))}, buf)
        return {"evil.pkl": pickle.dumps(_Planted(str(target))), "model.pt": buf.getvalue()}

    probe = marker.with_name(marker.name + ".selfcheck")
    for name, data in build(probe).items():  # the payload must really fire, or "never loaded" proves nothing
        torch.load(io.BytesIO(data), weights_only=False) if name.endswith(".pt") else pickle.loads(data)  # noqa: S301
        assert probe.is_dir(), f"planted {name} does not fire when unpickled"
        shutil.rmtree(probe)
    return build(marker)


def corrupt_and_plant(client, bucket: str, prefix: str, marker: Path) -> dict:
    """Truncate the newest complete checkpoint's largest object and plant pickles beside it and the one before."""
    state = bucket_state(client, bucket, prefix)
    assert len(state.complete) >= 2, f"need two complete checkpoints to corrupt one, have {state.complete}"
    newest, previous = state.complete[-1], state.complete[-2]
    folder = f"{prefix}/step-{newest:08d}"
    files = json.loads(client.get_object(Bucket=bucket, Key=f"{folder}/manifest.json")["Body"].read())["files"]
    largest = max(files, key=lambda n: int(files[n]["bytes"]))
    body = client.get_object(Bucket=bucket, Key=f"{folder}/{largest}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{folder}/{largest}", Body=body[: len(body) // 2])
    planted = []
    for step in (newest, previous):
        for name, data in pickle_payloads(marker).items():
            key = f"{prefix}/step-{step:08d}/{name}"
            client.put_object(Bucket=bucket, Key=key, Body=data)
            planted.append(key)
    return {"newest": newest, "previous": previous, "truncated": f"{folder}/{largest}",
            "bytes": [len(body), len(body) // 2], "planted": planted}
