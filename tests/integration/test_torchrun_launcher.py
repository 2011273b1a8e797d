"""The launcher with stand-in torchrun ranks (plain Python processes): stop and save requests reach the ranks,
and the multi-node manifest's start script gives every node its rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memfit import config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return config.load(REPO / "configs" / "tiny.yaml", list(overrides))


def _fake_torchrun(monkeypatch, tmp_path, rank_script: str, rank_args: str):
    """torchrun's stand-in: two processes running `rank_script` with `rank_args` (an expression of i).
    Returns the (config, job) to pass to launch.run_torchrun."""
    import sys

    from memfit.distributed import launch

    runner = ("import subprocess, sys\n"
              f"ps = [subprocess.Popen([sys.executable, '-c', {rank_script!r}, *{rank_args}]) for i in (0, 1)]\n"
              "sys.exit(max(p.wait() for p in ps))\n")
    monkeypatch.setattr(launch, "torchrun_command", lambda cfg, job_path: [sys.executable, "-c", runner])
    return _cfg("distributed.nproc_per_node=2"), launch.Job(config={}, plan={}, resume={}, job_dir=str(tmp_path))


def test_a_stop_request_reaches_every_rank_process(tmp_path, monkeypatch):
    """The launcher's loop: when the flow process is told to stop, torchrun's children get SIGTERM."""
    import threading

    from memfit.distributed import launch

    # Two "ranks" that record SIGTERM and exit 75, as memfit's ranks do.
    rank = ("import signal, sys, time, pathlib\n"
            "def h(*_):\n"
            "    pathlib.Path(sys.argv[1]).write_text('TERM'); sys.exit(75)\n"
            "signal.signal(signal.SIGTERM, h)\n"
            "pathlib.Path(sys.argv[1] + '.up').write_text('up')\n"
            "time.sleep(60)\n")
    cfg, job = _fake_torchrun(monkeypatch, tmp_path, rank, f"[r'{tmp_path}/rank' + str(i)]")
    stop = threading.Event()

    def request_stop_when_ranks_are_up() -> None:
        import time

        while not ((tmp_path / "rank0.up").exists() and (tmp_path / "rank1.up").exists()):
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=request_stop_when_ranks_are_up, daemon=True).start()
    code = launch.run_torchrun(cfg, job, stop)
    assert code == 75
    assert (tmp_path / "rank0").read_text() == "TERM" and (tmp_path / "rank1").read_text() == "TERM"


def test_a_save_request_waits_for_a_ready_rank_and_goes_to_one(tmp_path, monkeypatch):
    """SIGUSR1 would end a rank that has not installed its handler yet: the launcher holds the request until a
    rank has marked itself ready, then signals that one rank (the step's all-reduce tells the others)."""
    import threading

    from memfit.distributed import launch

    # Both ranks are slow to start; each records SIGUSR1s once its handler is in, marks itself ready, and ends
    # a second after either rank got one (a second signal would show up), or after 60 s without any.
    rank = ("import glob, signal, sys, time, pathlib\n"
            "out = pathlib.Path(sys.argv[1])\n"
            "time.sleep(1.0)\n"
            "signal.signal(signal.SIGUSR1, lambda *_: out.write_text(out.read_text() + 'USR1'))\n"
            "out.write_text('')\n"
            "from memfit.distributed.launch import mark_ready\n"
            "mark_ready(pathlib.Path(sys.argv[2]))\n"
            "end = time.monotonic() + 60\n"
            "got = lambda: any('USR1' in pathlib.Path(f).read_text() for f in glob.glob(sys.argv[2] + '/rank*.txt'))\n"
            "while time.monotonic() < end and not got(): time.sleep(0.05)\n"
            "time.sleep(1)\n")
    cfg, job = _fake_torchrun(monkeypatch, tmp_path, rank, f"[r'{tmp_path}/rank' + str(i) + '.txt', r'{tmp_path}']")
    save_request = threading.Event()
    save_request.set()  # before any rank is up: sending SIGUSR1 now would kill the rank
    code = launch.run_torchrun(cfg, job, threading.Event(), save_request)
    assert code == 0  # no rank was killed by an early signal
    got = sorted((tmp_path / f"rank{i}.txt").read_text() for i in (0, 1))
    assert got == ["", "USR1"] and not save_request.is_set()


def test_multinode_manifest_starts_nodes_1_to_n_minus_1(tmp_path):
    import subprocess

    import yaml

    docs = list(yaml.safe_load_all((REPO / "infra" / "k8s" / "multinode.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert spec["backoffLimit"] == 0  # a failed node fails the run instead of rejoining a dead rendezvous
    container = spec["template"]["spec"]["containers"][0]
    script = container["args"][0].replace("exec memfit", "echo memfit")
    for index, node_rank in ((0, 1), (2, 3)):
        out = subprocess.run(container["command"] + [script], capture_output=True, text=True, check=True,
                             env={"JOB_COMPLETION_INDEX": str(index), "PATH": os.environ["PATH"]}).stdout
        assert out.split() == ["memfit", "launch-node", "/etc/memfit/run.yaml", "--set",
                               f"distributed.node_rank={node_rank}"]
    # The pod template of the Prefect pool labels the flow pod, which the Service selects for the rendezvous.
    pool = json.loads((REPO / "infra" / "k8s" / "spot-work-pool.json").read_text())
    assert pool["job_configuration"]["job_manifest"]["spec"]["template"]["metadata"]["labels"] == "{{ labels }}"
