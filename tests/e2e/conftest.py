"""E2e fixtures: one default-mode machine (a Prefect home, moto S3) and its uninterrupted reference run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The kill-trials benchmark's functions (bench/ is scripts, not a package): the tests run the same trials.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.fixture(scope="session")
def default_mode_bench(moto_server, prefect_home_template, tmp_path_factory):
    """A user's machine in the default mode (no PREFECT_API_URL, one Prefect home, local MLflow per work
    folder) with checkpoints on moto, after one uninterrupted run of the issue's command (ONNX off):
    the reference weights every killed-and-rerun run must equal bitwise. Shared by the kill tests."""
    from kill_trials import Bench

    root = tmp_path_factory.mktemp("default-mode")
    home = root / "prefect-home"
    shutil.copytree(prefect_home_template, home)
    bench = Bench(root, moto_server, home, extra=("export.onnx=false",), rerun_timeout=300)
    bench.run_reference()
    return bench


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, prefect_home_template, moto_server):
    """The recovery tests' world: one Prefect server, one MLflow server, one bucket; machines are started per test
    (tests/e2e/recovery_support.py). Session-wide: the recovery file and the stress loop share it."""
    import time

    import kill_support as ks
    from recovery_support import machine_env
    from servers import mlflow_server, prefect_server

    root = tmp_path_factory.mktemp("recovery")
    s3 = ks.s3_client(moto_server)
    bucket = f"recovery-{int(time.time())}"
    s3.create_bucket(Bucket=bucket)
    (root / "mlflow").mkdir()
    with prefect_server(root, Path(sys.executable).parent, prefect_home_template) as api, \
            mlflow_server(root / "mlflow", ks.cli_env(moto_server, root)) as tracking:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield {"root": root, "api": api, "tracking": tracking, "s3": s3, "bucket": bucket,
                   "env": machine_env(moto_server, api), "endpoint": moto_server}


class ReferenceRun:
    """The run uninterrupted, started in the background: called, it waits for the run and gives its weights."""

    def __init__(self, args: list[str], env: dict[str, str], folder: Path) -> None:
        self.folder, self._weights = folder, None
        self._log = open(folder / "reference.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, env=env, cwd=folder, stdout=self._log, stderr=subprocess.STDOUT)

    def __call__(self) -> bytes:
        if self._weights is None:
            code = self.proc.wait(600)
            assert code == 0, (self.folder / "reference.log").read_text(errors="replace")[-3000:]
            self._weights = next(self.folder.glob("runs/**/export/hf/model.safetensors")).read_bytes()
        return self._weights

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def reference_weights(cluster):
    """The run uninterrupted, by `memfit run` in the default mode: the weights every recovery must equal (the run's
    name and stores do not enter the numerics, so one reference serves every test here). Started in the background
    when the first test asks for it, and waited for when a test first compares (`reference_weights()`): its minute
    of CPU overlaps that test's wait for the silence window, when this worker is otherwise idle."""
    import kill_support as ks
    from recovery_support import BIN, TINY, overrides

    folder = cluster["root"] / "reference"
    folder.mkdir()
    env = {**ks.cli_env(cluster["endpoint"], folder / "prefect-home")}
    sets = overrides("reference", f"s3://{cluster['bucket']}/reference", f"sqlite:///{folder / 'mlflow.db'}")
    run = ReferenceRun([str(BIN / "memfit"), "run", TINY, *sets, "--json"], env, folder)
    yield run
    run.close()
