"""The training task's side of a multi-process run: write a job file, run torchrun, read rank 0's report."""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from memfit import errors
from memfit.config import MemfitConfig
from memfit.errors import DistributedError, Preempted
from memfit.files import write_text_atomic
from memfit.reports import PlanReport, ProbeReport, ResumePoint, TrainReport
from memfit.runtime.procs import die_with_parent_hook

log = logging.getLogger("memfit.distributed")

REPORT_FILE = "report.json"
RUN_ID_FILE = "mlflow-run-id"
ERRORS_DIR = "errors"
READY_DIR = "ready"  # one file per rank PID: its signal handlers are installed


class Job(BaseModel):
    """What every rank needs to run the same training (JSON, written by the launcher)."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any]
    plan: dict[str, Any]
    resume: dict[str, Any]
    probe: dict[str, Any] | None = None
    job_dir: str

    def write(self, path: Path) -> None:
        write_text_atomic(path, self.model_dump_json(indent=2))

    @classmethod
    def read(cls, path: Path) -> Job:
        return cls.model_validate_json(Path(path).read_text())


def store_report_key(cfg: MemfitConfig) -> str:
    """Multi-node runs: where rank 0 (on whichever node the rendezvous put it) also leaves its report."""
    return f"_distributed/{cfg.distributed.rdzv_id or cfg.run.name}/{REPORT_FILE}"


def _store(cfg: MemfitConfig) -> Any:
    from memfit.storage import open_checkpoint_store

    return open_checkpoint_store(cfg)


def job_dir(cfg: MemfitConfig) -> Path:
    key = hashlib.sha256(f"{cfg.checkpoint.uri}|{cfg.distributed.node_rank}".encode()).hexdigest()[:12]
    return Path(cfg.run.work_dir).absolute() / "distributed" / key


def torchrun_command(cfg: MemfitConfig, job_path: Path, python: str = sys.executable) -> list[str]:
    """`python -m torch.distributed.run` (torchrun) for this node, running memfit's worker on each rank."""
    d = cfg.distributed
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={d.nproc_per_node}", f"--nnodes={d.nnodes}",
           # A failed rank fails the run; rerunning the flow resumes from the last training checkpoint.
           "--max-restarts=0"]
    if d.nnodes == 1 and d.rdzv_endpoint is None:
        cmd.append("--standalone")  # a free local port, no endpoint to configure
    else:
        cmd += [f"--node-rank={d.node_rank}", f"--rdzv-backend={d.rdzv_backend}",
                f"--rdzv-endpoint={d.rdzv_endpoint}", f"--rdzv-id={d.rdzv_id or cfg.run.name}"]
    return cmd + ["-m", "memfit.distributed.worker", str(job_path)]


def mark_ready(jdir: Path) -> None:
    """Called by each rank once its handlers are installed: the launcher may send it SIGUSR1 from now on."""
    (jdir / READY_DIR).mkdir(parents=True, exist_ok=True)
    (jdir / READY_DIR / str(os.getpid())).touch()


def _forward_stop(proc: subprocess.Popen[Any]) -> None:
    """Send SIGTERM to every rank (torchrun's children): they agree at the next step, save and exit 75."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    _send(ranks, signal.SIGTERM)
    log.warning("stop requested: forwarded SIGTERM to %d training processes", len(ranks))


def _forward_save(proc: subprocess.Popen[Any], jdir: Path) -> bool:
    """SIGUSR1 to one rank of this node with its handler in (before that it would end the rank); True when sent.

    One is enough: the per-step all-reduce carries its flag to every rank. Signalling all of them would let
    the signals land on either side of a step's all-reduce and make two saves of one request.
    """
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children()  # torchrun's own children are the ranks
    except psutil.NoSuchProcess:
        return False
    ready = {p.name for p in (jdir / READY_DIR).glob("*")}
    target = min((r for r in ranks if str(r.pid) in ready), key=lambda r: r.pid, default=None)
    if target is None:
        return False
    _send([target], signal.SIGUSR1)
    log.warning("save requested (spot rebalance recommendation): forwarded to training process %d", target.pid)
    return True


def _send(processes: list[Any], sig: int) -> None:
    import psutil

    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass  # ended meanwhile


def _pump(stream: Any, tail: collections.deque[str]) -> None:
    # Rank output goes through our logger, so it reaches the Prefect task's log, not only a terminal.
    for raw in iter(stream.readline, ""):
        line = raw.rstrip()
        if line:
            tail.append(line)
            log.info("%s", line)


def run_torchrun(cfg: MemfitConfig, job: Job, stop: threading.Event | None = None,
                 save_request: threading.Event | None = None) -> int:
    """Run this node's ranks to the end; forward stop and save requests to them. Returns torchrun's exit code."""
    jdir = Path(job.job_dir)
    job_path = jdir / "job.json"
    job.write(job_path)
    cmd = torchrun_command(cfg, job_path)
    log.info("launching %d processes on this node (%d in all, strategy %s): %s", cfg.distributed.nproc_per_node,
             cfg.distributed.world_size, job.plan.get("strategy"), " ".join(cmd))
    from memfit.runtime.env import default_threads

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Ranks share the cores (the worker pins torch's threads the same way); set here, torchrun skips its banner.
    env.setdefault("OMP_NUM_THREADS", str(cfg.train.num_threads or default_threads(cfg.distributed.nproc_per_node)))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    # torchrun gets its own session (a terminal's Ctrl-C must reach the ranks only through us) and is tied to
    # this process's life: a killed flow process does not leave torchrun and its ranks running.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=die_with_parent_hook())  # noqa: PLW1509
    pump = threading.Thread(target=_pump, args=(proc.stdout, tail), daemon=True, name="memfit-torchrun-log")
    pump.start()
    forwarded = False
    try:
        while proc.poll() is None:
            if stop is not None and stop.is_set() and not forwarded:
                _forward_stop(proc)
                forwarded = True
            elif save_request is not None and save_request.is_set() and _forward_save(proc, jdir):
                save_request.clear()  # otherwise kept until every rank is ready for it
            time.sleep(0.1)
    except BaseException:
        proc.terminate()  # torchrun stops its ranks (SIGTERM: they save, then are killed after 30 s)
        proc.wait()
        raise
    pump.join(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def prepare_job_dir(cfg: MemfitConfig) -> Path:
    jdir = job_dir(cfg)
    (jdir / ERRORS_DIR).mkdir(parents=True, exist_ok=True)
    for stale in [jdir / REPORT_FILE, jdir / RUN_ID_FILE, *(jdir / ERRORS_DIR).glob("*.json"),
                  *(jdir / READY_DIR).glob("*")]:
        stale.unlink(missing_ok=True)  # a result from an earlier attempt must not pass for this one's
    if cfg.distributed.nnodes > 1 and cfg.distributed.node_rank == 0:
        _store(cfg).delete(store_report_key(cfg))
    return jdir


def rank_errors(jdir: Path) -> list[dict[str, Any]]:
    """Errors the ranks wrote before exiting, the first one first (later ones are usually consequences)."""
    out = []
    for path in (jdir / ERRORS_DIR).glob("rank-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: (e.get("secondary", False), e.get("time", 0.0)))


def outcome(cfg: MemfitConfig, jdir: Path, returncode: int, stop_reason: str | None = None) -> TrainReport:
    """rank 0's report when training finished; Preempted when the ranks stopped on a signal; else the error.

    `stop_reason`: this node was told to stop (SIGTERM, spot notice) and forwarded it to its ranks.
    """
    report_path = jdir / REPORT_FILE
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    if report is None and cfg.distributed.nnodes > 1:  # rank 0 ran on another node
        try:
            report = json.loads(_store(cfg).get_bytes(store_report_key(cfg)))
        except Exception:  # noqa: BLE001 - absent: the run did not finish
            report = None
    if report is not None and report.get("preempted"):
        raise Preempted(f"preempted at step {report['steps']}: all {cfg.distributed.world_size} ranks saved training "
                        f"checkpoint {report.get('last_checkpoint_uri')}; run the same command again to resume")
    if report is not None and report.get("memory_limit") and report["steps"] < cfg.train.max_steps:
        raise errors.MemoryLimitError(f"{report['memory_limit']} (training checkpoint "
                                      f"{report.get('last_checkpoint_uri')})")
    if returncode == 0 and report is not None:
        return TrainReport(**{k: v for k, v in report.items() if k in TrainReport.model_fields})
    errs = rank_errors(jdir)
    if stop_reason is not None and not errs:
        # Stopped before the ranks could save (still starting up: a signal's default action ends a process that
        # has not installed its handler yet). Nothing trained since the last training checkpoint is lost.
        raise Preempted(f"preempted ({stop_reason}) before the ranks saved (torchrun exit code {returncode}); run "
                        "the same command again to resume from the last committed training checkpoint")
    if errs:
        first = errs[0]
        cls = getattr(errors, first.get("type", ""), None)
        message = (f"rank {first['rank']} of {cfg.distributed.world_size} failed: {first['message']} "
                   f"(torchrun exit code {returncode}; rerun the flow to resume from the last training checkpoint)")
        if isinstance(cls, type) and issubclass(cls, errors.MemfitError) and cls is not Preempted:
            raise cls(message)
        raise DistributedError(f"{message}\n{first.get('traceback', '')}".rstrip())
    raise DistributedError(f"torchrun exited with code {returncode} and no rank reported why (killed, e.g. out of "
                           "memory?); see the rank output above; rerun the flow to resume from the last training "
                           "checkpoint")


def train_distributed(cfg: MemfitConfig, plan: PlanReport, resume: ResumePoint,
                      probe_report: ProbeReport | None = None) -> TrainReport:
    """Phase 3 on several processes: torchrun runs memfit.distributed.worker on every rank of this node (what they
    share is made first: run_context.prepare_for_ranks)."""
    from memfit.runtime.preemption import stop_on_signals
    from memfit.runtime.spot import spot_watcher

    jdir = prepare_job_dir(cfg)
    job = Job(config=cfg.model_dump(mode="json"), plan=plan.model_dump(mode="json"),
              resume=resume.model_dump(mode="json"),
              probe=probe_report.model_dump(mode="json") if probe_report else None, job_dir=str(jdir))
    try:
        # One spot watcher per node, here: an interruption notice sets `stop`, forwarded to every rank as
        # SIGTERM; a rebalance recommendation (on_rebalance=save) sets `save_request`, forwarded as SIGUSR1.
        # The ranks agree on either at the end of the step and save together.
        save_request = threading.Event()
        with stop_on_signals() as stop, spot_watcher(cfg.checkpoint.spot, stop, save_request):
            code = run_torchrun(cfg, job, stop, save_request)
        return outcome(cfg, jdir, code, (stop.reason or "stop requested") if stop.is_set() else None)
    except (DistributedError, errors.MemfitError) as err:
        if not isinstance(err, Preempted):
            _mark_failed(cfg, jdir)
        raise


def _mark_failed(cfg: MemfitConfig, jdir: Path) -> None:
    """If rank 0 died without closing its MLflow run (killed), close it as FAILED from here."""
    run_file = jdir / RUN_ID_FILE
    if not run_file.is_file() or (jdir / REPORT_FILE).is_file():
        return
    try:
        from memfit.tracking import make_tracker

        tracker = make_tracker(cfg.tracking)
        tracker.start_run(cfg.run.name, run_id=run_file.read_text().strip())
        tracker.end_run("FAILED")
    except Exception as err:  # noqa: BLE001 - the training error matters more than this one
        log.warning("could not mark the MLflow run failed: %s", err)
