"""infra/skypilot/memfit-finetune.yaml through SkyPilot's own loader, in a venv of its own (opt-in).

skypilot 0.14.1 pins click<8.2 and uvicorn<0.36, against constraints.txt (click 8.5.1) and memfit's uvicorn>=0.54,
so it cannot live in .venv. Point MEMFIT_SKYPILOT_PYTHON at another venv's python to run this:
    python3 -m venv /tmp/skyvenv && /tmp/skyvenv/bin/pip install skypilot==0.14.1
    MEMFIT_SKYPILOT_PYTHON=/tmp/skyvenv/bin/python .venv/bin/python -m pytest tests/integration/test_skypilot_loader.py
It starts a Python process that imports sky (≈ 2 s) and needs no network and no cloud account.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SKY_YAML = "infra/skypilot/memfit-finetune.yaml"

# Runs under the SkyPilot venv's python, from the repository root (workdir: . must be a folder there).
PROBE = r"""
import json, sys
import sky
from sky.jobs import recovery_strategy
from sky.utils import yaml_utils

path = sys.argv[1]
out = {"version": sky.__version__}
try:
    sky.Task.from_yaml(path)  # what `sky jobs launch` does without --env
    out["without_env"] = "accepted"
except ValueError as err:
    out["without_env"] = str(err)
task = sky.Task.from_yaml_config(yaml_utils.read_yaml(path),
                                 env_overrides=[("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")])
(res,) = list(task.resources)
rec = dict(res.job_recovery)
out.update(use_spot=res.use_spot, accelerators=res.accelerators, job_recovery=rec,
           strategy_known=recovery_strategy.registry.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(rec["strategy"])
           is not None, envs=task.envs, run=task.run)
print(json.dumps(out))
"""


def test_skypilot_loader_accepts_the_yaml() -> None:
    python = os.environ.get("MEMFIT_SKYPILOT_PYTHON")
    if not python:
        pytest.skip("MEMFIT_SKYPILOT_PYTHON unset: no venv with skypilot==0.14.1 (it conflicts with memfit's pins)")
    proc = subprocess.run([python, "-c", PROBE, SKY_YAML], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == "0.14.1"
    assert "MLFLOW_TRACKING_URI" in out["without_env"] and "--env" in out["without_env"]
    assert out["use_spot"] is True and out["accelerators"] == {"L4": 1}
    assert out["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "recover_on_exit_codes": [75],
                                   "max_restarts_on_errors": 0}
    assert out["strategy_known"]
    assert out["envs"]["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5000"
    assert "memfit run" in out["run"] and "checkpoint.uri=s3://" in out["run"]
