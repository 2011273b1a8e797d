"""E2e fixtures: one default-mode machine (a Prefect home, moto S3) and its uninterrupted reference run."""

from __future__ import annotations

import shutil
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
