"""The default mode as users run it (no PREFECT_API_URL, one Prefect home): slots, stop signals, one-line errors.

While the training slot is taken a run waits and says so, and SIGTERM ends it at once with exit 75; Ctrl-C
during Prefect's start-up does the same; an error inside a task is memfit's one line; a slot holder SIGKILLed
while a run waits lets it train at once; and no Prefect server outlives its run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


class Cli:
    """`python -m memfit.cli run TINY ...` in its own process group, stderr to a file we can poll."""

    def __init__(self, folder: Path, home: Path, *sets: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.err_path = folder / "stderr.txt"
        args = [a for s in (*sets, "export.onnx=false", "tracking.system_metrics=false") for a in ("--set", s)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "PREFECT_HOME": str(home)}
        env.pop("PREFECT_API_URL", None)
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "run", TINY, *args], cwd=folder,
                                         env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.err:
            assert self.proc.poll() is None or needle in self.err, f"exited {self.proc.returncode}:\n{self.err[-3000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} within {timeout} s:\n{self.err[-3000:]}"
            time.sleep(0.2)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            raise AssertionError(f"still running after {timeout} s:\n{self.err[-3000:]}") from None


def _servers_of(home: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "uvicorn" in " ".join(p.info["cmdline"] or []) and p.environ().get("PREFECT_HOME") == str(home):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture()
def home(tmp_path, prefect_home_template) -> Path:
    shared = tmp_path / "prefect-home"
    shutil.copytree(prefect_home_template, shared)
    return shared


def _sets(folder: Path, *extra: str) -> tuple[str, ...]:
    return (f"run.work_dir={folder / 'work'}", f"checkpoint.uri={folder / 'checkpoints'}",
            f"export.dir={folder / 'export'}", "checkpoint.grace_seconds=20", *extra)


HOLD_SLOT = """
import sys, time
from memfit.runtime.slots import machine_slot
with machine_slot(sys.argv[1], "memfit-training", 1, run="stand-in", notify=print):
    print("held", flush=True)
    time.sleep(600)
"""


def test_slots_signals_and_errors_in_the_default_mode(tmp_path, home):
    from memfit.runtime.slots import machine_slot

    slots = home / "memfit-slots"  # where `memfit run` keeps its training slots in the default mode
    bad_model = tmp_path / "bad-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text('{"model_type": "llama"}')  # passes preflight, fails to load

    # The slot is taken (here, by this test): the run waits, says what for and who holds it, and SIGTERM
    # ends it within the grace, exit 75, one line.
    with machine_slot(slots, "memfit-training", 1, run="the-test", notify=print):
        waiter = Cli(tmp_path / "waiter", home, *_sets(tmp_path / "waiter", "train.max_steps=4"))
        waiter.wait_for("for a training slot")
        # Started once the first server is up: two Prefect servers migrating one fresh home at the same moment
        # log a (harmless) block-registration race of Prefect's own.
        broken = Cli(tmp_path / "broken", home, *_sets(tmp_path / "broken", f"model.name_or_path={bad_model}"))
        assert f"pid {os.getpid()}" in waiter.err and "the-test" in waiter.err
        assert "deploy.training_slots" in waiter.err
        waiter.signal_group(signal.SIGTERM)
        t0 = time.monotonic()
        assert waiter.wait(30) == 75, waiter.err[-3000:]
        assert time.monotonic() - t0 < 20  # checkpoint.grace_seconds
        assert waiter.err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")
        assert "Traceback" not in waiter.err

    # An error raised inside a task: memfit's one line, naming the file that holds the traceback.
    assert broken.wait(240) == 2, broken.err[-3000:]
    assert "Traceback" not in broken.err
    last = [ln for ln in broken.err.splitlines() if ln.startswith("error: ")][-1]
    assert last.startswith("error: model.name_or_path: could not load") and "traceback: " in last
    log_file = Path(last.rsplit("traceback: ", 1)[1].split(";")[0])
    assert "Traceback" in (tmp_path / "broken" / log_file).read_text()

    # Ctrl-C while Prefect's server starts: the same clean exit 75.
    early = Cli(tmp_path / "early", home, *_sets(tmp_path / "early"))
    early.wait_for("Starting temporary server")
    early.signal_group(signal.SIGINT)
    assert early.wait(30) == 75, early.err[-3000:]
    assert "Traceback" not in early.err
    # Stopped by the signal itself, not by the grace deadline: a Ctrl-C that lands in Prefect's import (which
    # swallows exceptions around its analytics start-up) once let the run go on, to exit 0 on a fast machine.
    # (memfit's last "error:" line: the tracking process, started beside the server, may log after it.)
    errors = [ln for ln in early.err.splitlines() if ln.startswith("error: ")]
    assert errors and errors[-1].startswith("error: stopped by SIGINT"), early.err[-3000:]

    # A holder SIGKILLed while a run waits (the spot reclaim, the OOM killer): the run trains at once.
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SLOT, str(slots)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    assert holder.stdout.readline().strip() == "held"
    after = Cli(tmp_path / "after", home, *_sets(tmp_path / "after", "train.max_steps=4"))
    after.wait_for("for a training slot")
    holder.kill()
    holder.wait(10)
    assert after.wait(300) == 0, after.err[-3000:]
    assert "training: steps 1 to 4" in after.err
    deadline = time.monotonic() + 20  # the reapers stop each run's server; none outlives its run
    while _servers_of(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {p.pid: _owner(p, (waiter, broken, early, after)) for p in _servers_of(home)}
    assert left == {}, left  # pid: the run that started it


def _owner(server: psutil.Process, runs: tuple[Cli, ...]) -> str:
    """Which run started this server: the one whose stderr names its port."""
    try:
        cmd = server.cmdline()
        port = cmd[cmd.index("--port") + 1]
    except (psutil.Error, ValueError, IndexError):
        return "unknown"
    names = [c.err_path.parent.name for c in runs if f"127.0.0.1:{port}" in c.err]
    return ", ".join(names) or f"port {port}, named by no run"
