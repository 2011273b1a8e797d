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
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "memfit",
})
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)
# A developer shell or pod with the spot watcher on must not make tests poll the cloud metadata service.
for _name in ("MEMFIT_SPOT_WATCHER", "MEMFIT_SPOT_METADATA_URL", "MEMFIT_TEST_UPLOAD_DELAY"):
    os.environ.pop(_name, None)

import pytest  # noqa: E402

pytest_plugins = ["fixtures.s3"]

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


# Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) each worker builds the fixtures its tests use:
# a module-scoped training run split over two workers would run twice. These groups keep each such module
# on one worker, and the tests that time themselves or kill processes at moments in one queue of their own.
_TIMED_GROUP = "timed"


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return  # `-p no:xdist`: the marker is not registered, and one process needs no groups
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {fd[-1].scope for fd in defs.name2fixturedefs.values()} if defs else set()
        if item.get_closest_marker("timed") or "default_mode_bench" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(_TIMED_GROUP))
        elif scopes & {"module", "class"}:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
