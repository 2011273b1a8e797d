"""A spot run's life through `python -m memfit.cli run` against moto over HTTP: killed, preempted, resumed.

SIGKILL mid-upload, right after a manifest and mid-step, then SIGTERM (exit 75 within the grace), then a
run to the end: its exported weights equal an uninterrupted run's bitwise, and MLflow holds one run.
MEMFIT_TEST_UPLOAD_DELAY (test-only) slows the uploader so the kill lands inside the upload window.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness) -> str:
    """The session's Prefect test server: CLI subprocesses use it instead of starting their own (~10 s each)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture()
def base_env(s3_env) -> dict[str, str]:
    """The environment of a CLI subprocess: boto3 pointed at moto (s3_env), this checkout first on the path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    for name in ("MEMFIT_TEST_UPLOAD_DELAY", "MEMFIT_SPOT_WATCHER", "MEMFIT_SPOT_METADATA_URL"):
        env.pop(name, None)
    return env


@pytest.fixture()
def cli_env(base_env, prefect_api_url) -> dict[str, str]:
    return {**base_env, "PREFECT_API_URL": prefect_api_url}


class Run:
    """`python -m memfit.cli run ...` in the background, its stderr read line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, *, command: tuple[str, ...] = ("run", TINY),
                 **extra_env: str) -> None:
        self.lines: list[str] = []
        self._new = threading.Condition()
        self.proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", *command, *args, "--json"],
                                     cwd=cwd, env={**env, **extra_env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # stdout has its own reader: communicate() would also read stderr, taking lines from the one above.
        self._out_reader = threading.Thread(target=lambda: self._out.extend(self.proc.stdout), daemon=True)
        self._out_reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                m = re.search(pattern, self.log)
                if m:
                    return m
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n{self.log[-4000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.log[-4000:]}")
                self._new.wait(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, sig)  # the machine is gone: the process and anything it started
        else:
            self.proc.send_signal(sig)  # what Kubernetes does: SIGTERM to the container's main process

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self._out_reader.join(timeout=10)
        return self.proc.returncode, "".join(self._out)


def _overrides(root: Path, uri: str, **extra: object) -> list[str]:
    items = {"run.work_dir": root / "work", "export.dir": root / "export", "checkpoint.uri": uri,
             "tracking.uri": f"sqlite:///{root / 'mlflow.db'}", "tracking.experiment": "spot",
             "train.max_steps": 14, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2,
             "train.warmup_steps": 2, "data.synthetic_docs": 300, "train.num_threads": 1, "export.onnx": False,
             "checkpoint.grace_seconds": 20,
             # The killed runs' training slots stay leased on the shared Prefect server for a minute: this
             # test's own limit has room for them (the lease expiry itself is Prefect's business).
             "deploy.concurrency_key": f"spot-test-{root.name}", "deploy.training_slots": 8, **extra}
    return [arg for k, v in items.items() for arg in ("--set", f"{k}={v}")]


def _keys(client, bucket: str, prefix: str) -> list[str]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in resp.get("Contents", [])]


def _poll(run: Run, pred, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if run.proc.poll() is not None:
            raise AssertionError(f"exited {run.proc.returncode} before {what}:\n{run.log[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{run.log[-4000:]}"
        time.sleep(0.03)


def _reference_export(root: Path, bucket: str) -> dict[str, torch.Tensor]:
    """The uninterrupted run with the same settings, in this process (no Prefect: the phases alone)."""
    from memfit import config, phases

    args = _overrides(root, f"s3://{bucket}/reference", **{"export.dir": root / "reference-export",
                                                           "tracking.backend": "null"})
    cfg = config.load(TINY, [a for a in args if a != "--set"])
    report = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, report)
    trained = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), report)
    exported = phases.evaluate_and_release(cfg, trained)
    return load_file(str(Path(exported.safetensors_dir) / "model.safetensors"))


@pytest.mark.slow
def test_killed_preempted_and_resumed_run_equals_an_uninterrupted_one(cli_env, s3_bucket, s3_client, tmp_path):
    from memfit.checkpoints import CheckpointManager
    from memfit.storage.s3 import S3Store

    _endpoint, bucket = s3_bucket
    uri, prefix = f"s3://{bucket}/spot", "spot/"
    args = _overrides(tmp_path, uri)
    store = CheckpointManager(S3Store(uri))

    # 1. SIGKILL mid-upload: some files of step 4 are in S3, its manifest is not.
    run = Run(args, cli_env, tmp_path, MEMFIT_TEST_UPLOAD_DELAY="0.25")
    _poll(run, lambda: (k := _keys(s3_client, bucket, f"{prefix}step-00000004/")) and not any(
        x.endswith("manifest.json") for x in k), "step 4 mid-upload")
    run.kill()
    assert run.finish()[0] == -signal.SIGKILL
    assert [(e.step, e.status) for e in store.scan()] == [(2, "complete"), (4, "incomplete")]

    # 2. SIGKILL right after the step-6 manifest (before retention or anything else ran).
    run = Run(args, cli_env, tmp_path, MEMFIT_TEST_UPLOAD_DELAY="0.25")
    _poll(run, lambda: f"{prefix}step-00000006/manifest.json" in _keys(s3_client, bucket, f"{prefix}step-00000006/"),
          "step 6 manifest")
    run.kill()
    assert run.finish()[0] == -signal.SIGKILL
    assert "resuming from training checkpoint " + uri + "/step-00000002 (step 2)" in run.log
    assert 6 in [i.step for i in store.list()]

    # 3. SIGKILL mid-step: training goes on while step 8 is uploaded; kill as soon as it is committed.
    run = Run(args, cli_env, tmp_path)
    run.wait_for(r"step 8 committed")
    run.kill()
    assert run.finish()[0] == -signal.SIGKILL
    assert "(step 6)" in run.wait_for(r"resuming from training checkpoint \S+ \(step \d+\)").group(0)

    # 4. SIGTERM (a spot reclaim, `kubectl delete pod`): finish the step, save, exit 75 within the grace.
    run = Run(args, cli_env, tmp_path)
    run.wait_for(r"step 10 committed")
    sent = time.monotonic()
    run.kill(signal.SIGTERM)
    code, _ = run.finish()
    took = time.monotonic() - sent
    assert code == 75, run.log[-3000:]
    assert took < 20, f"exit {took:.1f} s after SIGTERM, grace 20 s"
    stopped = int(re.search(r"preempted at step (\d+) \(SIGTERM\)", run.log).group(1))
    assert 10 <= stopped < 14 and "Traceback" not in run.log.split("preempted at step")[-1]
    assert stopped in [i.step for i in store.list()]

    # 5. `memfit resume URI` (the config saved in the checkpoint) finishes; its exported weights equal the
    #    uninterrupted run's, bit for bit.
    run = Run([], cli_env, tmp_path, command=("resume", uri))
    code, out = run.finish()
    assert code == 0, run.log[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    # `memfit resume` says where it resumes from, and the flow's recovery phase again.
    assert summary["steps"] == 14 and f"from step {stopped} " in run.log and f"(step {stopped})" in run.log
    resumed = load_file(str(Path(summary["safetensors_dir"]) / "model.safetensors"))
    reference = _reference_export(tmp_path, bucket)
    assert resumed.keys() == reference.keys()
    differ = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run's: {differ[:5]}"

    # One MLflow run across all five processes, with every step's loss.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("spot")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]] and runs[0].info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(summary["mlflow_run_id"], "loss")}
    assert steps == set(range(1, 15))

    # `memfit checkpoints ls` lists the complete checkpoints with their steps.
    ls = subprocess.run([sys.executable, "-m", "memfit.cli", "checkpoints", "ls", uri, "--json"], env=cli_env,
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr[-2000:]
    listing = json.loads(ls.stdout.strip().splitlines()[-1])
    assert [c["step"] for c in listing["checkpoints"]][-1] == 14 and len(listing["checkpoints"]) == 2
    assert all(c["status"] == "complete" and c["bytes"] > 0 for c in listing["checkpoints"])


@pytest.mark.parametrize("case", ["missing bucket", "bad credentials", "endpoint down"])
def test_s3_problems_are_one_clear_error_before_training(base_env, s3_bucket, tmp_path, case):
    import socket
    import urllib.request

    _endpoint, bucket = s3_bucket
    env = dict(base_env)
    uri = f"s3://{bucket}/run"
    if case == "missing bucket":
        uri, needle = "s3://memfit-no-such-bucket/run", "bucket memfit-no-such-bucket does not exist"
    elif case == "bad credentials":
        env["AWS_SECRET_ACCESS_KEY"] = secret = "memfit-never-printed"
        needle = "credentials rejected"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{s.getsockname()[1]}"
        needle = f"cannot reach {env['AWS_ENDPOINT_URL_S3']}"

    def moto_auth(value: str) -> None:  # moto checks credentials only when told to
        req = urllib.request.Request(f"{base_env['AWS_ENDPOINT_URL_S3']}/moto-api/reset-auth", data=value.encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5).close()

    if case == "bad credentials":
        moto_auth("0")
    try:
        proc = subprocess.run([sys.executable, "-m", "memfit.cli", "run", TINY, *_overrides(tmp_path, uri)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        if case == "bad credentials":
            moto_auth("inf")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert "error: " in proc.stderr.splitlines()[-1]
    assert "prefect" not in proc.stderr.lower()  # failed before the flow (and any model) started
    if case == "bad credentials":
        assert secret not in proc.stderr
