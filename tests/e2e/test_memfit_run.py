"""`memfit run configs/tiny.yaml --json` as a new user runs it: a real process, ephemeral Prefect."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
LOADED_AT_EXIT = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(m for m in ("mlflow", "matplotlib", "deepspeed")
                                                            if m in sys.modules))))
sys.argv = ["memfit", *sys.argv[2:]]
from memfit.cli import main
main()
"""


def test_memfit_run_tiny_json(tmp_path, prefect_home_template):
    home = tmp_path / "prefect-home"  # this run's flow run alone in its database
    shutil.copytree(prefect_home_template, home)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    # Run from a fresh folder with the shipped config: defaults put MLflow and outputs under the cwd.
    (tmp_path / "configs").symlink_to(REPO / "configs")
    # As the console script runs it, noting at exit which of MLflow and matplotlib memfit's own process loaded, and
    # DeepSpeed, installed for the ZeRO tests: saving a model must not import it (runtime/importing.py).
    proc = subprocess.run([sys.executable, "-c", LOADED_AT_EXIT, str(tmp_path / "loaded.json"), "run",
                           "configs/tiny.yaml", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Phases 3 and 5 did their MLflow work (metrics, model logging, registry, plots) in the tracking process.
    assert json.loads((tmp_path / "loaded.json").read_text()) == [], "memfit's process imported these"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("mlflow_run_id", "tracking_uri", "checkpoint_uri", "safetensors_dir", "onnx_path", "steps",
                "initial_val_loss", "final_val_loss"):
        assert key in out, key
    assert out["steps"] == 60
    assert out["final_val_loss"] < out["initial_val_loss"]
    assert out["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"

    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out["safetensors_dir"]).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    sess = ort.InferenceSession(out["onnx_path"], providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input_ids": ids.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-4

    from mlflow import MlflowClient

    client = MlflowClient(out["tracking_uri"])
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "loss" in run.data.metrics
    # The review story: system metrics, the PNGs, and a registered version behind the champion alias.
    assert "system/cpu_utilization_percentage" in run.data.metrics
    plots = {a.path for a in client.list_artifacts(out["mlflow_run_id"], "plots")}
    assert plots == {"plots/loss_curve.png", "plots/memory_breakdown.png"}
    assert out["registered_model"] == "tiny@champion" and out["gate_passed"] is True
    champion = client.get_model_version_by_alias("tiny", "champion")
    assert champion.run_id == out["mlflow_run_id"] and str(champion.version) == out["model_version"]
    assert (tmp_path / "mlruns").is_dir()  # artifacts beside the default mlflow.db in the working folder
    ckpts = sorted(p.name for p in Path(out["checkpoint_uri"]).iterdir()) if not out["checkpoint_uri"].startswith(
        "s3://") else []
    assert ckpts[-1] == "step-00000060"
    # The Prefect UI shows the flow run's log to its last line: Prefect's log worker is drained at exit while
    # the ephemeral server still runs (before, the last lines were lost against the stopped server).
    with sqlite3.connect(home / "prefect.db") as db:
        flow_lines = [m for (m,) in db.execute("SELECT message FROM log WHERE name = 'prefect.flow_runs' "
                                                  "ORDER BY timestamp")]
    assert flow_lines and flow_lines[-1] == "Finished in state Completed()", flow_lines[-3:]


def test_sigkilled_run_takes_its_ephemeral_prefect_server_along(tmp_path):
    """An out-of-memory kill skips Prefect's own clean-up: the server must still not outlive `memfit run`."""
    import time

    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "run", "configs/tiny.yaml"], cwd=tmp_path,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "Beginning flow run" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "uvicorn" in " ".join(c.cmdline())]
        assert len(servers) == 1, log.read_text()[-3000:]
        proc.kill()  # SIGKILL: no atexit, no finally
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(servers, timeout=20)
        assert not alive, f"the ephemeral Prefect server outlived the killed run: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in locals().get("servers", []):  # a failed run of this test leaves nothing behind either
            if p.is_running():
                p.kill()
