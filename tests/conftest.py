"""Shared fixtures: telemetry off, a tiny config, a temp MLflow store, one session-wide Prefect harness."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before prefect/mlflow are imported anywhere: no telemetry, an isolated Prefect home, patient start-up.
_HOME = Path(tempfile.mkdtemp(prefix="memfit-tests-"))
os.environ.update({
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "AWS_EC2_METADATA_DISABLED": "true",
    "PREFECT_HOME": str(_HOME / "prefect"),
    # The ONNX graph cache (memfit/release/onnx_cache.py): shared by the session's exports, never ~/.cache.
    "MEMFIT_CACHE_DIR": str(_HOME / "cache"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "memfit",
    # `mlflow server`/`mlflow ui` otherwise start a job runner and ~7 huey consumer processes (MLflow's GenAI
    # jobs, which memfit never submits): ~14 s of CPU per server start (measured), for nothing a test checks.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
})
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Under pytest-xdist each worker gets its share of the cores, in this process (torch reads OMP_NUM_THREADS when it
# is first imported, below) and in every `memfit run` it starts (memfit.runtime.env.default_threads): two workers each
# running torch on every core spin for threads the other holds (serial suite 2723 CPU s, `-n 2` 3391).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# A developer shell or pod with the spot watcher on must not make tests poll the cloud metadata service.
for _name in ("MEMFIT_SPOT_WATCHER", "MEMFIT_SPOT_METADATA_URL", "MEMFIT_TEST_UPLOAD_DELAY",
              "MEMFIT_TEST_STEP_DELAY"):
    os.environ.pop(_name, None)

import gc  # noqa: E402

import pytest  # noqa: E402

pytest_plugins = ["fixtures.s3"]


def pytest_configure(config):
    """The process that collects (a worker, or the only process) imports torch, transformers, MLflow and Prefect
    with the cyclic GC paused, as memfit's own processes do (memfit/runtime/importing.py): ≈ 2 CPU s less per worker."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        gc.disable()


def pytest_collection_finish(session):
    """Then the garbage collection left goes, and what remains (the imported modules) is frozen out of the later
    full collections of this long-lived process, before the collector resumes."""
    if not gc.isenabled():
        gc.collect()
        gc.freeze()
        gc.enable()

from tests_support import tiny_overrides  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test harness (a temporary server + SQLite DB) for the whole session (~10 s once)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_home_template(tmp_path_factory) -> Path:
    """A Prefect home with its database migrated once: copied into a test's PREFECT_HOME, each Prefect server
    the test starts skips ~9 s of migrations (what a user's second run skips too)."""
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("prefect-home-template")
    prefect = Path(sys.executable).parent / "prefect"
    subprocess.run([str(prefect), "server", "database", "upgrade", "-y"], env={**os.environ, "PREFECT_HOME": str(home)},
                   check=True, capture_output=True, timeout=300)
    return home


@pytest.fixture()
def mlflow_uri(tmp_path: Path) -> str:
    """A fresh MLflow tracking store on SQLite (a real store, not a mock)."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture()
def tiny_config(tmp_path: Path, mlflow_uri: str):
    """configs/tiny.yaml, shortened, with every output under tmp_path."""
    from memfit import config

    def make(**extra: object):
        base = {"train.max_steps": 12, "checkpoint.every_steps": 4, "train.warmup_steps": 2,
                "data.synthetic_docs": 400, "export.onnx": False}
        base.update(extra)
        return config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, mlflow_uri, **base))

    return make



# Under pytest-xdist (`make test TEST_WORKERS=2`: `-n 2 --dist loadfile`) each worker builds the fixtures its
# tests use, so a test file is the unit of work: a module-scoped training run is never built on both workers. The files
# below also share one unit: they kill runs at moments or time themselves (a rerun within 2 minutes, an exit
# within the SIGTERM grace, an error before start-up ends), and kill_trials and default_mode_resume share one
# reference run (default_mode_bench). So no two of them share the machine, and that run is made once.
# (Not `xdist_group` marks: with pytest 9.2 `--dist loadgroup` silently ignores them, pytest-xdist#1386.)
TIMED_FILES = frozenset({
    "tests/e2e/test_kill_trials.py",
    "tests/e2e/test_default_mode_resume.py",
    "tests/e2e/test_default_mode_signals.py",
    "tests/e2e/test_spot_resume.py",
    "tests/integration/test_cli.py",
})


# The longest units first (longest-processing-time order), then e2e, integration and unit files, each tier as
# pytest-xdist orders it (most tests first): the short files fill in at the end and both workers finish together. In
# xdist's own order (by test count) the few-test, minutes-long files came last: one worker ran on alone for up
# to a minute (measured 2026-12-02: 855 s against 913 s). Their seconds on 2 workers, 2026-12-02, for order only.
LONGEST_FIRST = ("tests/e2e/test_recovery.py",  # ≈ 580 s: machines killed and restarted by Prefect automations
                 "timed",  # ≈ 390 s: the kill trials, default-mode resume and signals, spot chain, CLI bounds
                 "tests/e2e/test_readme_commands.py",  # ≈ 500 s
                 "tests/integration/test_onnx_parity.py",  # ≈ 150 s
                 "tests/integration/test_distributed.py",  # ≈ 120 s
                 "tests/integration/test_memory_cli.py", "tests/integration/test_golden_losses.py",
                 "tests/integration/test_onnx_cache.py", "tests/e2e/test_prefect_ui.py", "tests/e2e/test_memfit_run.py")


@pytest.hookimpl(optionalhook=True)  # the hook exists only when pytest-xdist is loaded
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist_schedule import scheduler

    return scheduler(config, log, TIMED_FILES, LONGEST_FIRST)
