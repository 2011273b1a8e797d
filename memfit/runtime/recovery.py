"""Unattended recovery's rules: a logical run's attempts, their causes, the restart budget and the backoff."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from memfit.reports import AttemptReport

# Final states a memfit flow run ends in, by name (Prefect emits `prefect.flow-run.<name>` for each): the
# restart automations listen for the first three; the others end a logical run.
PREEMPTED = "Preempted"  # SIGTERM or a spot notice: a training checkpoint was committed first (exit 75)
MEMORY_LIMIT = "MemoryLimit"  # stopped at the memory limit with recovery.on_memory_limit: leaner (exit 76)
CRASHED = "Crashed"  # Prefect's: the process died, or the zombie automation marked a silent run
BUDGET_SPENT = "RestartBudgetSpent"
DUPLICATE = "DuplicateRestart"  # a second live flow run of one logical run (two restarts of one end): ends at once
RESTARTABLE = (CRASHED, PREEMPTED, MEMORY_LIMIT)
# The zombie automation's message: the cause "vanished" is read back from it.
SILENT_MESSAGE = "memfit: no heartbeat for {seconds} s: the machine is gone"
# A draining machine (flows/draining.py) ends a run that outlived its drain deadline Preempted with this.
DRAIN_DEADLINE_MESSAGE = ("stopped by the machine's drain ({reason}): still running {seconds:.0f} s after the notice; "
                          "the newest training checkpoint stands")
# What Prefect's own runner sets when it shuts down with runs in flight (CancellationManager.cancel_all): a
# Cancelled no person asked for. A person's cancel (UI, CLI) ends "Flow run was cancelled successfully." instead.
RUNNER_SHUTDOWN_MESSAGE = "Runner is shutting down."

# Flow-run tags. A tag is how a state-change event says which automation applies (Prefect relates each tag).
TAG_MEMFIT = "memfit"
TAG_RECOVERY = "memfit-recovery"  # a deployment whose runs the restart automation follows
RUN_TAG_PREFIX = "memfit-run:"  # the logical run: attempts share it
ATTEMPT_TAG_PREFIX = "memfit-attempt:"


def run_key(run_name: str, checkpoint_uri: str) -> str:
    """The logical run's key: its name and where its training checkpoints live (a restart shares both)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-")[:60] or "run"
    return f"{slug}-{hashlib.sha256(checkpoint_uri.encode()).hexdigest()[:8]}"


def backoff_delays(base_s: int, cap_s: int) -> list[int]:
    """Delay before restart 1, 2, ... : base doubled each time up to the cap; the last one repeats."""
    delays, delay = [], max(0, base_s)
    while True:
        delays.append(min(delay, cap_s))
        if delay >= cap_s or delay == 0 or len(delays) >= 16:
            return delays
        delay *= 2


def backoff_wait(restart: int, base_s: int, cap_s: int, since_end_s: float) -> float:
    """Seconds restart number `restart` (1 = the first) must still wait, `since_end_s` after the previous attempt
    ended: base doubled per restart, capped; the automation's own delay and the start-up count towards it."""
    delays = backoff_delays(base_s, cap_s)
    return max(0.0, delays[min(restart, len(delays)) - 1] - since_end_s)


@dataclass(frozen=True)
class PastAttempt:
    """One earlier flow run of a logical run, as the orchestrator recorded it."""

    flow_run_id: str
    state_name: str
    state_type: str  # COMPLETED, FAILED, CRASHED, CANCELLED, RUNNING, ...
    message: str = ""
    start_time: float | None = None  # epoch seconds
    end_time: float | None = None


def cancelled_by_shutdown(attempt: PastAttempt) -> bool:
    """Cancelled by a runner shutting down (its machine went away), not by a person."""
    return attempt.state_type == "CANCELLED" and attempt.message.strip() == RUNNER_SHUTDOWN_MESSAGE


def restartable(attempt: PastAttempt) -> bool:
    """An end that recovery restarts: Crashed, Preempted, MemoryLimit, or a Cancelled no person asked for."""
    return attempt.state_name in RESTARTABLE or cancelled_by_shutdown(attempt)


def cause_of(attempt: PastAttempt) -> str:
    """preempted / vanished / crashed / memory_limit / runner_shutdown / cancelled / failed / completed / running."""
    if cancelled_by_shutdown(attempt):
        return "runner_shutdown"
    if attempt.state_name == PREEMPTED:
        return "preempted"
    if attempt.state_name == MEMORY_LIMIT:
        return "memory_limit"
    if attempt.state_type == "CRASHED":
        return "vanished" if "no heartbeat" in attempt.message else "crashed"
    return attempt.state_type.lower()


def decide_attempt(history: list[PastAttempt], max_restarts: int, key: str | None = None) -> AttemptReport:
    """This run's place in its logical run, from the earlier flow runs sharing its key (oldest first).

    A logical run is the attempts since the last one that ended for good (completed, failed on input, cancelled,
    budget spent). Each restartable end before this run is one restart used; past the budget the run must stop.
    """
    chain: list[PastAttempt] = []
    for past in history:
        if past.state_type in ("SCHEDULED", "PENDING", "RUNNING") and past.state_name not in RESTARTABLE:
            continue  # another live or queued run of this key: not an ended attempt
        if past.state_name == DUPLICATE:
            continue  # ended without running: neither an attempt nor the end of the logical run
        chain = [*chain, past] if restartable(past) else []
    if not chain:
        return AttemptReport(attempt=1, restarts_used=0, max_restarts=max_restarts, proceed=True,
                             run_key=key, reason="a fresh run")
    last = chain[-1]
    used, cause = len(chain), cause_of(last)
    if used > max_restarts:
        return AttemptReport(attempt=used + 1, restarts_used=used - 1, max_restarts=max_restarts, proceed=False,
                             cause=cause, previous_flow_run=last.flow_run_id, previous_end=last.end_time,
                             run_key=key, reason=f"restart budget spent: {max_restarts} of recovery.max_restarts="
                             f"{max_restarts} used; last cause: {cause} (flow run {last.flow_run_id})")
    return AttemptReport(attempt=used + 1, restarts_used=used, max_restarts=max_restarts, proceed=True,
                         cause=cause, previous_flow_run=last.flow_run_id, previous_end=last.end_time,
                         run_key=key, reason=f"restart {used} of {max_restarts} after the previous attempt {cause}")


AUTOMATION_KEY_PREFIX = "automation "  # Prefect's idempotency key of a flow run that an automation's action created


@dataclass(frozen=True)
class LiveRun:
    """A live (scheduled, pending, running) flow run of a deployment, as the duplicate rule needs it."""

    flow_run_id: str
    created: float  # epoch seconds
    parameters: dict[str, Any]
    idempotency_key: str | None  # "automation <id>, action <i>, invocation <id>" when an automation created it


def is_restart(run: LiveRun) -> bool:
    """Created by an automation's RunDeployment action (a restart), not by a person, a schedule or the API."""
    return (run.idempotency_key or "").startswith(AUTOMATION_KEY_PREFIX)


def duplicate_of(own: LiveRun, live: list[LiveRun]) -> str | None:
    """The restart this one duplicates, or None. Only restarts are compared: two restarts of one end (Preempted,
    then Cancelled by the shutting-down runner) with the same parameters are one too many, and the oldest goes on
    (ids break a tie), so that each, deciding alone, names the same one. A run a person, the API or a schedule
    created is never a duplicate, and never makes a restart one: a nightly schedule keeps runs with the same
    parameters waiting ahead of time."""
    if not is_restart(own):
        return None
    same = [(r.created, r.flow_run_id) for r in live
            if r.flow_run_id != own.flow_run_id and is_restart(r) and r.parameters == own.parameters]
    if not same:
        return None
    first = min([*same, (own.created, own.flow_run_id)])[1]
    return None if first == own.flow_run_id else first


def recovery_record(decision: dict[str, Any] | None, resumed_step: int | None, last_logged_step: int | None,
                    last_seen: float | None, now: float) -> tuple[dict[str, float], dict[str, str]]:
    """Metrics and tags for the MLflow run when an attempt resumes: the cause, the step resumed from, the steps
    trained after that checkpoint and lost (at least: metrics a vanished machine had not sent are unknown) and
    the seconds between the previous attempt's last sign of life and this resume."""
    attempt = int((decision or {}).get("attempt") or 0)
    cause = (decision or {}).get("cause") or "rerun"
    lost = max(0, (last_logged_step or 0) - (resumed_step or 0)) if last_logged_step is not None else 0
    metrics = {"recovery/resumed_from_step": float(resumed_step or 0), "recovery/steps_lost": float(lost)}
    if last_seen is not None:
        metrics["recovery/downtime_s"] = round(max(0.0, now - last_seen), 3)
    if attempt:
        metrics["recovery/attempt"] = float(attempt)
    label = f"memfit.recovery.{attempt}" if attempt else "memfit.recovery.rerun"
    detail = " ".join([f"cause={cause}", f"from_step={resumed_step or 0}", f"steps_lost={lost}",
                       *([f"downtime_s={metrics['recovery/downtime_s']:.1f}"] if last_seen is not None else []),
                       *([f"previous_flow_run={decision['previous_flow_run']}"]
                         if decision and decision.get("previous_flow_run") else [])])
    tags = {label: detail, "memfit.recovery.last_cause": cause}
    if attempt:
        tags["memfit.attempts"] = str(attempt)
    return metrics, tags
