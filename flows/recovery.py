"""Unattended recovery on Prefect: the automations that detect and restart runs, and the states runs end in."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import signal
import threading
import typing
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from memfit.config import MemfitConfig
from memfit.errors import ConfigError, MemoryLimitError, Preempted
from memfit.runtime import recovery as rules

log = logging.getLogger("memfit.recovery")
NAME_PREFIX = "memfit: "
SILENT_NAME = "memfit: mark silent runs crashed"
# Every parameter of the ended run, as it ran: the restart is the same run (its config, its data_uri).
SAME_PARAMETERS = {"__prefect_kind": "json",
                   "value": {"__prefect_kind": "jinja", "template": "{{ flow_run.parameters | tojson }}"}}


RESTART_NAME = "memfit: restart preempted or vanished runs"
SHUTDOWN_NAME = "memfit: restart runs a shutting-down runner cancelled"


def automations(cfg: MemfitConfig) -> list[Any]:
    """The automations recovery needs, from the config's recovery section (the server's are replaced by these)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, RunDeployment
    from prefect.events.schemas.automations import AutomationCore as Automation
    from prefect.events.schemas.automations import EventTrigger, Posture

    rec = cfg.recovery
    silent = Automation(
        name=SILENT_NAME,
        description=f"A memfit flow run with no heartbeat for {rec.silent_after_seconds} s is gone (its machine "
                    "vanished): mark it Crashed, so the restart automations pick it up.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            # Any later event of the run (a heartbeat, a final state) closes the window; none within it fires.
            expect={"prefect.flow-run.*"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.id": f"prefect.tag.{rules.TAG_MEMFIT}"},
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=rec.silent_after_seconds)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=rules.SILENT_MESSAGE.format(seconds=rec.silent_after_seconds))])
    # The flow run's tags as it was created (its deployment's) are what a state event relates: the server caches
    # them per run, so tags a run adds itself are not seen here. Backoff beyond the first delay is therefore the
    # restarted run's to wait (tasks/attempt.py), and recovery.enabled per run is checked there too.
    rerun = RunDeployment(source="inferred", parameters=SAME_PARAMETERS,
                          schedule_after=timedelta(seconds=rec.backoff_seconds))
    restart = Automation(
        name=RESTART_NAME,
        description="Start a memfit deployment run again with the same parameters when it ended Crashed, "
                    "Preempted or MemoryLimit; the new flow run checks the restart budget, waits out the backoff "
                    "and resumes from the newest verified training checkpoint.",
        trigger=EventTrigger(
            expect={f"prefect.flow-run.{name}" for name in rules.RESTARTABLE},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=[{"prefect.resource.id": f"prefect.tag.{rules.TAG_RECOVERY}"},
                           {"prefect.resource.role": "deployment"}],
            posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[rerun])
    # memfit's own runner never cancels on shutdown (flows/draining.py), but a runner or worker that is not
    # memfit's (a plain `prefect worker`, an older memfit) does, with this message: the machine went away, not a
    # person, so the run is restarted. A person's cancel carries another message and stays final.
    shutdown = Automation(
        name=SHUTDOWN_NAME,
        description="Start a memfit deployment run again when a runner shutting down cancelled it (state message "
                    f"{rules.RUNNER_SHUTDOWN_MESSAGE!r}); a Cancelled asked for by a person is final.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Cancelled"},
            match={"prefect.resource.id": "prefect.flow-run.*",
                   "prefect.state-message": rules.RUNNER_SHUTDOWN_MESSAGE},
            match_related=[{"prefect.resource.id": f"prefect.tag.{rules.TAG_RECOVERY}"},
                           {"prefect.resource.role": "deployment"}],
            posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[rerun])
    return [silent, restart, shutdown]


def apply_automations(cfg: MemfitConfig, dry_run: bool = False) -> list[dict[str, Any]]:
    """Create or update memfit's automations on the Prefect server (PREFECT_API_URL); other automations named
    "memfit: ..." (an earlier version's) are deleted. Idempotent: applying twice leaves one of each."""
    wanted = automations(cfg)
    rows = [{"name": a.name, "trigger": _describe_trigger(a.trigger), "action": _describe_actions(a.actions)}
            for a in wanted]
    if dry_run:
        return rows
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError("PREFECT_API_URL is not set: automations live on a Prefect server; set it to the "
                          "server's API (e.g. http://127.0.0.1:4200/api) or use --dry-run to see them")
    try:
        with get_client(sync_client=True) as client:
            existing = [a for a in client.read_automations() if a.name.startswith(NAME_PREFIX)]
            by_name: dict[str, list[Any]] = {}
            for a in existing:
                by_name.setdefault(a.name, []).append(a)
            for automation, row in zip(wanted, rows[:len(wanted)], strict=True):
                found = by_name.pop(automation.name, [])
                if found and _same(found[0], automation):
                    # Left alone: an update resets the server's trigger state, and with it the silence window of
                    # every run in flight (a second machine's `memfit serve` must not blind the first's runs).
                    row["id"], row["applied"] = str(found[0].id), "unchanged"
                elif found:
                    client.update_automation(found[0].id, automation)
                    row["id"], row["applied"] = str(found[0].id), "updated"
                    for extra in found[1:]:
                        client.delete_automation(extra.id)
                else:
                    row["id"], row["applied"] = str(client.create_automation(automation)), "created"
            for stale in (a for group in by_name.values() for a in group):
                client.delete_automation(stale.id)
                rows.append({"name": stale.name, "id": str(stale.id), "applied": "deleted"})
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - httpx, Prefect HTTP errors: one line naming the URL
        raise ConfigError(f"PREFECT_API_URL={url}: cannot apply automations ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); is the Prefect server up?") from None
    return rows


def _same(existing: Any, wanted: Any) -> bool:
    def norm(a: Any) -> str:
        return json.dumps({k: a.model_dump(mode="json")[k] for k in ("description", "enabled", "trigger", "actions")},
                          sort_keys=True, default=str)

    def canonical(text: str) -> Any:  # sets (expect, after, for_each) come back in any order
        def walk(x: Any) -> Any:
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            if isinstance(x, list):
                return sorted((walk(v) for v in x), key=lambda v: json.dumps(v, sort_keys=True))
            return x

        return walk(json.loads(text))

    return canonical(norm(existing)) == canonical(norm(wanted))


def _describe_trigger(trigger: Any) -> str:
    if str(trigger.posture.value) == "Proactive":
        return f"no {', '.join(sorted(trigger.expect))} within {int(trigger.within.total_seconds())} s after " \
               f"{', '.join(sorted(trigger.after))} (memfit runs)"
    message = trigger.match.root.get("prefect.state-message")
    return f"{' or '.join(sorted(trigger.expect))} of a deployment run tagged " + \
        " and ".join(m.get("prefect.resource.id", "").removeprefix("prefect.tag.")
                     for m in (r.model_dump() if hasattr(r, "model_dump") else dict(r)
                               for r in trigger.match_related) if m.get("prefect.resource.id")) + \
        (f" with state message {message!r}" if message else "")


def _describe_actions(actions: list[Any]) -> str:
    out = []
    for a in actions:
        if a.type == "run-deployment":
            out.append(f"run the same deployment with the same parameters after "
                       f"{int(a.schedule_after.total_seconds())} s (later restarts wait longer: the backoff)")
        else:
            out.append(f"set state {a.state.value}: {a.message}")
    return "; ".join(out)


def ends_in_named_states(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A flow run of a deployment ends a preemption or a memory-limit stop in a named state the UI shows and the
    restart automations trigger on (Preempted, MemoryLimit); elsewhere (memfit run) the error propagates as before
    and becomes exit 75 or 76."""

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _preempted_on_sigterm():
                return fn(*args, **kwargs)
        except (Preempted, MemoryLimitError) as err:
            state = named_final_state(signature.bind_partial(*args, **kwargs).arguments.get("config"), err)
            if state is None:
                raise
            log.warning("%s: %s", state.name, err)
            return state

    # Resolved types, not the strings of `from __future__ import annotations`: Prefect builds the parameter model
    # from the wrapper, whose module globals are this one's, not the flow's.
    wrapper.__annotations__ = typing.get_type_hints(fn)
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def _preempted_on_sigterm() -> Iterator[None]:
    """In a deployment run's process, a SIGTERM outside training (loading, restoring, evaluating) ends the run
    Preempted at once: nothing new to save, the newest training checkpoint stands. Training installs its own
    handler (finish the step, save) and puts this one back after. Seen without it: a SIGTERM while a restarted
    run restored its checkpoint was lost, and the runner's drain deadline ended the run Cancelled."""
    if not _deployment_run() or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Preempted(f"stopped by {signal.Signals(signum).name} outside training: nothing new to save, the "
                        "newest training checkpoint stands")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _deployment_run() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()  # this flow run's own deployment: a subflow has none (its parent ends named)
    return bool(ctx is not None and ctx.flow_run is not None and ctx.flow_run.deployment_id)


def named_final_state(cfg: MemfitConfig | None, err: Exception) -> Any:
    """Failed(name=Preempted / MemoryLimit) for a deployment run that recovery may restart; None otherwise."""
    from prefect.states import Failed

    if cfg is None or not _deployment_run():
        return None
    if isinstance(err, Preempted):
        return Failed(name=rules.PREEMPTED, message=f"{err} (recovery restarts it)" if cfg.recovery.enabled
                      else str(err))
    if cfg.recovery.enabled and cfg.recovery.on_memory_limit == "leaner":
        return Failed(name=rules.MEMORY_LIMIT, message=f"{err}; recovery restarts it with a leaner stack")
    return None


def run_status(cfg: MemfitConfig) -> dict[str, Any]:
    """A logical run's attempts (Prefect) and progress (its checkpoint store): what `memfit status` prints."""
    from memfit.checkpoints import CheckpointIndex
    from memfit.phases import absolute_uri
    from memfit.storage import open_checkpoint_store

    key = rules.run_key(cfg.run.name, absolute_uri(cfg.checkpoint.uri))
    complete = [c.step for c in CheckpointIndex(open_checkpoint_store(cfg)).list()]
    newest = max(complete, default=None)
    out: dict[str, Any] = {"run": cfg.run.name, "run_key": key, "checkpoint_uri": absolute_uri(cfg.checkpoint.uri),
                           "newest_checkpoint_step": newest, "max_steps": cfg.train.max_steps,
                           "steps_left": cfg.train.max_steps - (newest or 0), "max_restarts": cfg.recovery.max_restarts,
                           "attempts": []}
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        out["prefect"] = "PREFECT_API_URL is not set: no flow runs to show (memfit run alone keeps none)"
        return out
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[rules.RUN_TAG_PREFIX + key])),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200)
    except Exception as err:  # noqa: BLE001 - one line naming the URL
        raise ConfigError(f"PREFECT_API_URL={PREFECT_API_URL.value()}: cannot read flow runs "
                          f"({type(err).__name__}); is the Prefect server up?") from None
    restarts = 0
    for run in runs:
        attempt = next((t.removeprefix(rules.ATTEMPT_TAG_PREFIX) for t in run.tags
                        if t.startswith(rules.ATTEMPT_TAG_PREFIX)), "?")
        state = run.state
        past = rules.PastAttempt(str(run.id), state.name if state else "", state.type.value if state else "",
                                 (state.message or "") if state else "")
        restarts += rules.restartable(past)
        out["attempts"].append({
            "attempt": int(attempt) if attempt.isdigit() else attempt, "flow_run": str(run.id), "name": run.name,
            "state": past.state_name, "cause": rules.cause_of(past) if past.state_name else None,
            "started": run.start_time.isoformat() if run.start_time else None,
            "ended": run.end_time.isoformat() if run.end_time else None,
            "message": (past.message.splitlines() or [""])[0][:200]})
    out["restarts_used"] = restarts
    return out


def format_status(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']} ({status['run_key']}): newest training checkpoint at step "
             f"{status['newest_checkpoint_step']} of {status['max_steps']} ({status['steps_left']} left), "
             f"restarts {status.get('restarts_used', 0)} of {status['max_restarts']}",
             f"  checkpoints: {status['checkpoint_uri']}"]
    if status.get("prefect"):
        lines.append(f"  {status['prefect']}")
    for a in status["attempts"]:
        lines.append(f"  attempt {a['attempt']}: {a['state'] or '?':<18} cause {a['cause'] or '-':<12} "
                     f"{a['name']} ({a['flow_run']}) {a['started'] or ''} → {a['ended'] or ''}")
    return "\n".join(lines)
