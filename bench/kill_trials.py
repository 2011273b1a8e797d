"""Kill trials: SIGKILL `memfit run` at random moments on one Prefect home, rerun it, compare its weights bitwise.

    PYTHONPATH=. python bench/kill_trials.py [--trials 10 --seed 0 --rerun-timeout 300]

Default mode, as a user runs it: no PREFECT_API_URL (each run starts Prefect's ephemeral server), one
Prefect home for every trial, MLflow on its local store in each trial's work folder, ONNX on, training
checkpoints on a moto S3 server on 127.0.0.1. First an uninterrupted run gives the reference weights and
the phases' timeline; then each trial starts the issue's command on its own checkpoint prefix, kills its
whole process group at a seeded random moment (one trial aimed inside each phase, Prefect start-up to
export, the rest anywhere in the run), reruns the same command to the end and compares the exported
SafeTensors with the reference's byte for byte. The phase hit is read from the killed run's log, an upload
in flight from the bucket. A rerun that does not end within --rerun-timeout is a hang: the table says in
which phase. A last round kills in training, truncates the newest checkpoint's largest object, plants
pickles beside it and beside the one before: the rerun must skip the newest, resume from the previous and
load no pickle. Writes bench/out/kill_trials.{md,json,png}; exits 1 if any trial fails.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kill_support as ks  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
# Where each phase starts and ends in the log, as (pattern, how many matches); None is the process start. The
# n-th task starts when n-1 tasks have finished; export is the end of the evaluation task.
_N = {task: i for i, task in enumerate(ks.TASKS)}
_START = lambda i: (ks.TASK_DONE, i) if i else (ks.FLOW_BEGUN, 1)  # noqa: E731
ANCHORS = {"Prefect start-up": None, **{t: _START(_N[t]) for t in ("probe", "planning", "recovery", "training",
                                                                     "evaluation")},
           "export": (ks.EXPORT_STEPS[0][1], 1)}
ENDS = {"Prefect start-up": (ks.FLOW_BEGUN, 1), **{t: (ks.TASK_DONE, _N[t] + 1) for t in ("probe", "planning",
                                                                                         "recovery", "training")},
        "evaluation": (ks.EXPORT_STEPS[0][1], 1), "export": (ks.TASK_DONE, len(ks.TASKS))}
TARGETS = ["Prefect start-up", "probe", "planning", "recovery", "training", "mid-upload", "evaluation", "export"]


@dataclass
class Target:
    """Where to kill: `delay` s after the phase's anchor line (mid-upload: once an upload is seen in flight)."""

    aim: str
    delay: float
    commits: int = 0  # mid-upload: wait for this many committed checkpoints first


@dataclass
class Trial:
    name: str
    aim: str
    kill_s: float | None = None
    phase: str = ""
    newest: int = 0  # the newest complete checkpoint in the bucket right after the kill
    resumed: int | None = None
    rerun_s: float | None = None
    equal: bool = False
    ok: bool = False
    note: str = ""
    left: list[str] = field(default_factory=list)  # processes still running after the rerun ended (then ended)
    extra: dict = field(default_factory=dict)


class Bench:
    """One moto bucket, one Prefect home, one work root: the trials of a run of this benchmark."""

    def __init__(self, root: Path, endpoint: str, home: Path, extra: tuple[str, ...] = (),
                 rerun_timeout: float = 300, fresh_homes: bool = False) -> None:
        self.root, self.home, self.extra, self.rerun_timeout = root, home, extra, rerun_timeout
        self.client = ks.s3_client(endpoint)
        self.bucket = f"kill-trials-{int(time.time())}"
        self.client.create_bucket(Bucket=self.bucket)
        self.env = ks.cli_env(endpoint, home)
        self.fresh_homes = fresh_homes
        self.reference: Path | None = None
        self.timeline: dict[str, tuple[float, float]] = {}
        self.wall = 0.0

    def _env(self, name: str) -> dict[str, str]:
        if not self.fresh_homes:
            return self.env
        home = self.root / "homes" / name  # diagnosis only: a home per run hides what a dead run left there
        shutil.copytree(self.home, home, dirs_exist_ok=True)
        return {**self.env, "PREFECT_HOME": str(home)}

    def args(self, prefix: str) -> list[str]:
        return ks.run_args(f"s3://{self.bucket}/{prefix}", *self.extra)

    def run_reference(self) -> Path:
        """The uninterrupted run: its weights, its wall time and each phase's window on its clock."""
        cwd = self.root / "reference"
        proc = ks.Proc(self.args("reference"), self._env("reference"), cwd, cwd / "run.log")
        code = proc.finish(max(self.rerun_timeout, 900))  # no kill before it: a slow machine, not a hang
        if code != 0:
            raise SystemExit(f"reference run {'hung' if code is None else f'exited {code}'} in "
                             f"{ks.phase_of(proc.log)}; log: {cwd / 'run.log'}")
        self.wall = proc.elapsed()
        for aim, start in ANCHORS.items():
            t0 = 0.0 if start is None else proc.wait_for(start[0], start[1], 0)
            t1 = proc.wait_for(ENDS[aim][0], ENDS[aim][1], 0)
            if t0 is not None and t1 is not None:
                self.timeline[aim] = (t0, t1)
        self.reference = proc.weights()
        return self.reference

    def plan(self, n: int, seed: int) -> list[Target]:
        """One target inside each phase (in a seeded order), then the rest anywhere in the run."""
        rng = random.Random(seed)
        aims = TARGETS[:n] if n < len(TARGETS) else TARGETS + ["anywhere"] * (n - len(TARGETS))
        rng.shuffle(aims)
        targets = []
        for aim in aims:
            if aim == "anywhere":
                targets.append(Target(aim, rng.uniform(0.02, 0.95) * self.wall))
            elif aim == "mid-upload":
                targets.append(Target(aim, 0.0, commits=rng.randint(1, 10)))
            else:
                t0, t1 = self.timeline[aim]
                targets.append(Target(aim, rng.uniform(0.1, 0.9) * (t1 - t0)))
        return targets

    def _kill(self, proc: ks.Proc, target: Target, prefix: str) -> str:
        """Wait for the target's moment and kill; '' or why the moment never came."""
        start = 0.0
        anchor = ANCHORS.get(target.aim)
        if target.aim == "mid-upload":
            anchor = (ks.COMMITTED, target.commits)
        if anchor is not None:
            start = proc.wait_for(anchor[0], anchor[1], timeout=self.rerun_timeout)
            if start is None:
                return "ended before its moment" if proc.proc.poll() is not None else "hung before its moment"
        while proc.elapsed() < start + target.delay and proc.proc.poll() is None:
            time.sleep(0.01)
        if target.aim == "mid-upload":
            deadline = time.monotonic() + 60
            while not ks.bucket_state(self.client, self.bucket, prefix).in_flight and proc.proc.poll() is None:
                if time.monotonic() > deadline:
                    return "no upload seen in flight"
                time.sleep(0.01)
        return "ended before its moment" if proc.proc.poll() is not None else ""

    def trial(self, name: str, target: Target) -> Trial:
        """Kill at the target's moment, read the phase hit, rerun to the end, compare with the reference."""
        cwd, out = self.root / name, Trial(name, target.aim)
        killed = ks.Proc(self.args(name), self._env(f"{name}-killed"), cwd, cwd / "killed.log")
        why = self._kill(killed, target, name)
        out.kill_s = killed.kill()
        out.phase = ks.phase_of(killed.log)
        state = ks.bucket_state(self.client, self.bucket, name)
        out.newest = state.newest
        if state.in_flight and out.phase.startswith("training"):
            out.phase += f", upload of step {state.in_flight[-1]} in flight"
        if why:
            out.note = why
            if why.startswith("ended"):  # nothing was killed: this trial tests nothing
                return out
        problems = self._rerun(name, cwd, out)
        if problems is None:
            return out
        if out.resumed != out.newest:
            problems.append(f"resumed from step {out.resumed}, the newest complete checkpoint was {out.newest}")
        out.ok = not problems and not why
        out.note = "; ".join([why, *problems] if why else problems)
        return out

    def _rerun(self, name: str, cwd: Path, out: Trial) -> list[str] | None:
        """Run the trial's command again to its end; what is wrong with the result, or None when it hung."""
        rerun = ks.Proc(self.args(name), self._env(f"{name}-rerun"), cwd, cwd / "rerun.log")
        code = rerun.finish(self.rerun_timeout)
        out.rerun_s, out.resumed = rerun.elapsed(), ks.resumed_step(rerun.log)
        out.left = ks.left_behind(cwd)  # also ends them
        out.extra.update({"rerun_exit": code, "killed_log": str(cwd / "killed.log"),
                          "rerun_log": str(cwd / "rerun.log"), "skipped": ks.SKIPPED.findall(rerun.log)})
        if code is None:
            out.note = f"rerun hung in {ks.phase_of(rerun.log)} (killed after {self.rerun_timeout:.0f} s)"
            return None
        out.equal, detail = ks.same_weights(rerun.weights(), self.reference)
        return ([f"rerun exited {code}"] if code else []) + ([] if out.equal else [detail])

    def corrupt_round(self, seed: int) -> Trial:
        """Kill in training, truncate the newest checkpoint, plant pickles: the rerun resumes from the one before."""
        name, rng = "corrupt", random.Random(seed + 1)
        cwd, out = self.root / name, Trial(name, "training, newest corrupted")
        marker = self.root / "PICKLE-WAS-LOADED"
        killed = ks.Proc(self.args(name), self._env(f"{name}-killed"), cwd, cwd / "killed.log")
        if killed.wait_for(ks.COMMITTED, rng.randint(3, 10), timeout=self.rerun_timeout) is None:
            killed.kill()
            out.note = f"no training checkpoint to corrupt: stopped in {ks.phase_of(killed.log)}"
            return out
        out.kill_s = killed.kill()
        out.phase = ks.phase_of(killed.log)
        planted = ks.corrupt_and_plant(self.client, self.bucket, name, marker)
        out.newest = planted["previous"]  # what the rerun must resume from
        out.extra.update(planted)
        problems = self._rerun(name, cwd, out)
        if problems is None:
            return out
        skipped = out.extra["skipped"]
        newest_uri = f"s3://{self.bucket}/{name}/step-{planted['newest']:08d}"
        out.extra["pickle_loaded"] = marker.exists()
        if newest_uri not in skipped:
            problems.append(f"truncated step {planted['newest']} not skipped (skipped: {skipped})")
        if out.resumed != planted["previous"]:
            problems.append(f"resumed from step {out.resumed}, expected {planted['previous']}")
        if marker.exists():
            problems.append("a planted pickle was loaded")
        out.ok = not problems
        out.note = "; ".join(problems) or (f"step {planted['newest']} truncated and skipped, "
                                           f"resumed from {planted['previous']}, planted pickles not loaded")
        return out


def table(trials: list[Trial]) -> str:
    head = "| trial | aimed at | kill s | phase hit | newest ckpt | resumed step | rerun s | equal | result |"
    rows = [head, "|" + "---|" * 9]
    for t in trials:
        rows.append(f"| {t.name} | {t.aim} | {_f(t.kill_s)} | {t.phase} | {t.newest} | "
                    f"{'-' if t.resumed is None else t.resumed} | {_f(t.rerun_s)} | {'yes' if t.equal else 'no'} | "
                    f"{'ok' if t.ok else 'FAIL'}{': ' + t.note if t.note else ''}"
                    f"{f'; LEFT RUNNING: {t.left[0]}' if t.left else ''} |")
    return "\n".join(rows)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def totals(trials: list[Trial], corrupt: Trial | None) -> list[str]:
    killed = [t for t in trials if not t.note.startswith("ended")]
    good = [t for t in killed if t.ok]
    walls = [t.rerun_s for t in killed if t.rerun_s is not None and t.ok]
    lines = [f"{len(good)}/{len(killed)} killed runs resumed bitwise"
             + (f" ({len(trials) - len(killed)} ended before their moment)" if len(killed) < len(trials) else "")]
    if walls:
        lines.append(f"rerun wall: median {statistics.median(walls):.1f} s, max {max(walls):.1f} s")
    for t in trials:
        if "hung" in t.note:
            lines.append(f"HANG: {t.name} ({t.note})")
    leaky = [t for t in trials + ([corrupt] if corrupt else []) if t.left]
    lines.append(f"processes left running after a kill and rerun: {len(leaky)} trials"
                 + "".join(f"; {t.name} ({t.phase}): {', '.join(t.left)}" for t in leaky))
    if corrupt is not None:
        lines.append(f"corrupted newest checkpoint: {'ok' if corrupt.ok else 'FAIL'}: {corrupt.note}")
    return lines


def plot(trials: list[Trial], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(trials) + 1.5))
    for i, t in enumerate(trials):
        ax.barh(i, t.kill_s or 0, color="#c44e52", label="killed run, to the kill" if i == 0 else None)
        ax.barh(i, t.rerun_s or 0, left=t.kill_s or 0, color="#55a868" if t.ok else "#999999",
                label="rerun to the end (grey: failed)" if i == 0 else None)
    ax.set_yticks(range(len(trials)), [f"{t.name}: {t.phase}" for t in trials], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("s")
    ax.set_title("kill trials: SIGKILL at a random moment, then rerun")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rerun-timeout", type=float, default=300, help="s; a rerun still going after it is a hang")
    p.add_argument("--no-corrupt-round", action="store_true")
    p.add_argument("--fresh-homes", action="store_true", help="a fresh Prefect home for every run (diagnosis only)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs) even when all pass")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="memfit-kill-trials-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below ends the runs in flight
    server, endpoint = ks.start_moto()
    started = time.monotonic()
    try:
        home = root / "prefect-home"
        ks.migrate_home(home, ks.cli_env(endpoint, home))  # the machine after a user's first run
        bench = Bench(root, endpoint, home, rerun_timeout=args.rerun_timeout, fresh_homes=args.fresh_homes)
        bench.run_reference()
        print(f"reference run: {bench.wall:.1f} s; phases: "
              + ", ".join(f"{k} {a:.1f}-{b:.1f}" for k, (a, b) in bench.timeline.items()), flush=True)
        trials = []
        for i, target in enumerate(bench.plan(args.trials, args.seed), 1):
            trials.append(bench.trial(f"trial-{i:02d}", target))
            print(table(trials[-1:]).splitlines()[-1], flush=True)
        corrupt = None if args.no_corrupt_round else bench.corrupt_round(args.seed)
    finally:
        ks.kill_all()
        server.stop()
    everything = trials + ([corrupt] if corrupt else [])
    summary = totals(trials, corrupt)
    text = "\n".join([f"# Kill trials (seed {args.seed}, reference run {bench.wall:.1f} s, "
                      f"{(time.monotonic() - started) / 60:.1f} min in all)", "", table(everything), "",
                      *[f"- {line}" for line in summary]])
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kill_trials.md").write_text(text + "\n")
    (args.out / "kill_trials.json").write_text(json.dumps(
        {"seed": args.seed, "reference_wall_s": bench.wall, "timeline": bench.timeline, "totals": summary,
         "trials": [asdict(t) for t in everything], "work": str(root)}, indent=2))
    plot(everything, args.out / "kill_trials.png")
    failed = [t for t in everything if (not t.ok and not t.note.startswith("ended")) or t.left]
    print(f"\nwrote {args.out / 'kill_trials.md'}, kill_trials.json and kill_trials.png")
    if failed or args.keep:
        print(f"logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
