"""Seconds from `memfit run` to its first training step and to its end: a fresh Prefect home, a warm one, and
the rerun after a SIGKILL (the out-of-memory killer, a lost spot host), side by side in one table.

    PYTHONPATH=. python bench/startup.py [--rounds 1] [--steps 8] [--set export.onnx=false ...] [--code DIR ...]

Each run is `python -m memfit.cli run configs/tiny.yaml --set train.max_steps=STEPS` in its own folder, on a
pseudo-terminal so that training's progress bar draws: the first training step is the bar's first update (the
resumed step after the SIGKILL). Beside the seconds, the CPU seconds memfit's own process had used by then (its
critical path, which a busy machine stretches less than wall time) and the load average: on a shared machine
read those first. `--code DIR` (repeatable) runs the same scenarios with another checkout's code, in
alternating rounds (e.g. main beside a branch). Prints a Markdown table and writes bench/out/startup.md.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "out"
BAR = re.compile(rb"train:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
MARKS = {"server": b"Starting temporary server", "flow": b"Beginning flow run", "training": b"training: steps",
         "committed": b"committed to"}


def cli_env(home: Path, code: Path) -> dict[str, str]:
    """The default mode as a user has it: no PREFECT_API_URL, MLflow in the working folder, telemetry off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "MEMFIT_"))}
    env.update({"PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(home), "HF_HUB_OFFLINE": "1",
                "DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "MLFLOW_DISABLE_TELEMETRY": "true",
                # A busy shared machine can take over a minute to boot a server: a slow row, not a failed one.
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})
    return env


class Run:
    """One `memfit run` on a pseudo-terminal; `seconds[mark]` is when a mark first appeared, from the start."""

    def __init__(self, folder: Path, home: Path, sets: list[str], code: Path, kill_after_commit: bool = False
                 ) -> None:
        import psutil

        self.seconds: dict[str, float] = {}
        self.output = b""
        args = [a for s in sets for a in ("--set", s)]
        master, slave = pty.openpty()
        # A terminal of 0 x 0 (a new pty's size) gets an empty progress bar: give it a real one.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "run", "configs/tiny.yaml", *args],
                                     cwd=folder, env=cli_env(home, code), stdin=subprocess.DEVNULL, stdout=slave,
                                     stderr=slave, start_new_session=True)
        os.close(slave)
        first_count: int | None = None
        scanned = 0
        try:
            while True:
                ready, _, _ = select.select([master], [], [], 0.5)
                if not ready:
                    if self.proc.poll() is not None:
                        break
                    continue
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the terminal's last writer is gone
                    break
                if not chunk:
                    break
                now = time.monotonic() - self.t0
                self.output += chunk
                for name, needle in MARKS.items():
                    if name not in self.seconds and needle in self.output:
                        self.seconds[name] = now
                for match in BAR.finditer(self.output, scanned):  # a bar drawn across two reads too
                    scanned = match.end()
                    count = int(match.group(1))
                    if first_count is None:
                        first_count = count  # the bar's first draw: the step it starts from
                    elif count > first_count and "first_step" not in self.seconds:
                        self.seconds["first_step"] = now
                        try:
                            cpu = psutil.Process(self.proc.pid).cpu_times()
                            self.seconds["cpu_first_step"] = cpu.user + cpu.system
                        except psutil.Error:
                            pass
                if kill_after_commit and "committed" in self.seconds:
                    self.proc.kill()  # SIGKILL to memfit alone, as the OOM killer does
                    break
        finally:
            self.code = self.proc.wait()
            self.seconds["end"] = time.monotonic() - self.t0
            self.load = os.getloadavg()[0]  # the 1-minute load average as the run ends
            os.close(master)


def scenario_runs(root: Path, steps: int, extra: list[str], code: Path) -> dict[str, Run]:
    """fresh home, warm home (same home and MLflow store, new outputs), SIGKILL, and the rerun after it."""
    (root / "configs").symlink_to(REPO / "configs")
    home = root / "prefect-home"

    def sets(name: str, max_steps: int) -> list[str]:
        return [f"run.work_dir={root / name / 'work'}", f"checkpoint.uri={root / name / 'checkpoints'}",
                f"export.dir={root / name / 'export'}", f"train.max_steps={max_steps}", *extra]

    runs = {"fresh home": Run(root, home, sets("fresh", steps), code),
            "warm home": Run(root, home, sets("warm", steps), code)}
    # Long enough to be killed after its first training checkpoint, then rerun to the end from it.
    long_sets = sets("killed", max(steps, 40)) + ["checkpoint.every_steps=2"]
    runs["SIGKILLed"] = Run(root, home, long_sets, code, kill_after_commit=True)
    runs["rerun after SIGKILL"] = Run(root, home, long_sets, code)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="train.max_steps of the fresh and warm runs")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more --set overrides")
    parser.add_argument("--code", action="append", type=Path, default=[],
                        help="a checkout whose memfit to run (default: this one); repeat to compare")
    args = parser.parse_args()
    codes = [c.resolve() for c in args.code] or [REPO]
    rows: dict[str, list[dict[str, float]]] = {}
    loads: list[float] = []
    for _ in range(args.rounds):
        for code in codes:
            with tempfile.TemporaryDirectory(prefix="memfit-startup-") as tmp:
                for name, run in scenario_runs(Path(tmp), args.steps, args.sets, code).items():
                    ok = run.code == 0 or name == "SIGKILLed"
                    if not ok or "first_step" not in run.seconds:
                        tail = run.output.decode(errors="replace")[-3000:]
                        raise SystemExit(f"{name} ({code}): exit {run.code}, no first training step seen:\n{tail}")
                    label = name if len(codes) == 1 else f"{name} ({code.name})"
                    rows.setdefault(label, []).append(run.seconds)
                    loads.append(run.load)
                    print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.seconds.items()), flush=True)
    columns = ["server", "flow", "training", "first_step", "cpu_first_step", "end"]
    lines = [f"`memfit run configs/tiny.yaml --set train.max_steps={args.steps}` "
             f"{' '.join('--set ' + s for s in args.sets)}; {args.rounds} round(s), median seconds from the command; "
             f"{os.cpu_count()} CPUs, load average during the runs {min(loads):.1f} to {max(loads):.1f}", "",
             "| run | server process started | flow run begins | `training: steps` line | first training step "
             "| memfit CPU s by then | end |", "|---|---|---|---|---|---|---|"]
    for name, samples in rows.items():
        cells = [f"{statistics.median(s[c] for s in samples):.1f}" if all(c in s for s in samples) else "-"
                 for c in columns]
        if name.startswith("SIGKILLed"):
            cells[-1] = "killed"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / "startup.md").write_text(table + "\n")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
