"""`memfit run` starts Prefect's server and the MLflow tracking process first, so that they boot on the other
core while torch, the flow and Prefect import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "mlflow", "prefect", "onnx")

# Runs `memfit run` as the console script does, with subprocess.Popen watched: when the uvicorn server and
# then the tracking process are started, print which heavy packages this process had imported by then; leave
# at the second (nothing else is needed; the reaper ends the server with this process).
# At the second, it also prints the niceness of memfit's process and of the server (once the server set it).
SPY = """
import json, os, subprocess, sys, time
real, watched, server = subprocess.Popen, json.loads(sys.argv[1]), []
class Spy(real):
    def __init__(self, args, *rest, **kwargs):
        tracking = any("memfit.tracking.child" in str(a) for a in args)
        if tracking or any("uvicorn" in str(a) for a in args):
            heavy = sorted(m for m in watched if m in sys.modules)
            seen = {"heavy": heavy, "env": kwargs.get("env", {}).get("PREFECT__SERVER_EPHEMERAL"),
                    "new_session": kwargs.get("start_new_session")}
            if tracking:
                import psutil
                for _ in range(100):
                    seen["nice"] = [os.getpriority(os.PRIO_PROCESS, 0), psutil.Process(server[0]).nice()]
                    if seen["nice"][1] != seen["nice"][0]:
                        break
                    time.sleep(0.1)
            print("AT-TRACKING-START" if tracking else "AT-SERVER-START", json.dumps(seen), flush=True)
            if tracking:
                os._exit(0)
        super().__init__(args, *rest, **kwargs)
        if not tracking and any("uvicorn" in str(a) for a in args):
            server.append(self.pid)
subprocess.Popen = Spy
sys.argv = ["memfit", "run", *sys.argv[2:]]
from memfit.cli import main
main()
"""


def test_server_process_starts_before_the_heavy_imports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    sets = [f"run.work_dir={tmp_path / 'work'}", f"checkpoint.uri={tmp_path / 'ckpt'}",
            f"export.dir={tmp_path / 'export'}"]
    proc = subprocess.run([sys.executable, "-c", SPY, json.dumps(HEAVY), str(REPO / "configs" / "tiny.yaml"),
                           *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AT-SERVER-START ")]
    assert lines, f"no Prefect server was started (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    seen = json.loads(lines[0].split(" ", 1)[1])
    # Imported before the server's Popen, these would run before it boots instead of beside it.
    assert seen["heavy"] == [], seen
    assert seen["env"] == "1" and seen["new_session"] is True  # Prefect's ephemeral server, in its own session
    tracking = [ln for ln in proc.stdout.splitlines() if ln.startswith("AT-TRACKING-START ")]
    assert tracking, f"no tracking process was started (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    seen = json.loads(tracking[0].split(" ", 1)[1])
    # MLflow loads in that process, beside the server, never in this one before the first training step.
    assert seen["heavy"] == [] and seen["new_session"] is True, seen
    # The server boots at a lower priority than memfit's own start-up, the critical path on a busy machine.
    assert seen["nice"][1] > seen["nice"][0], seen
    # memfit left a split second after starting its server (as a SIGKILL at start-up would): the reaper still
    # ends the server (it once left before reading which process to end, and the server ran on).
    deadline = time.monotonic() + 20
    while (left := _servers_of(tmp_path / "prefect")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Prefect server(s) {left} outlived memfit"


def _servers_of(home: Path) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if "uvicorn" in " ".join(p.cmdline()) and p.environ().get("PREFECT_HOME") == str(home):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_the_memory_tracker_loads_without_the_rest_of_torchs_tools_package():
    """memfit needs MemTracker and ModTracker from torch.distributed._tools; the package's __init__ also imports
    the runtime estimator and with it torch._inductor (≈ 1.3 s before every run's first step). The package,
    imported later, is still the real one, with the classes memfit already holds."""
    check = ("import sys; import memfit.memory.estimator.tracker as tr, memfit.memory.estimator.timeline; "
             "assert 'torch._inductor' not in sys.modules, 'torch._inductor was imported'; "
             "import torch.distributed._tools as tools; "
             "assert tools.MemTracker is tr.MemTracker and hasattr(tools, 'FSDPMemTracker'); print('ok')")
    proc = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
