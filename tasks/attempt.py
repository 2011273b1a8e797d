"""Recovery task: which attempt of its logical run this flow run is; its tags and name say so in Prefect."""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import runtime, task
from prefect.cache_policies import NO_CACHE

from memfit.config import MemfitConfig
from memfit.phases import absolute_uri
from memfit.reports import AttemptReport
from memfit.runtime import recovery as rules

log = logging.getLogger("memfit.recovery")


@task(name="recovery-attempt", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def attempt_task(config: MemfitConfig) -> AttemptReport:
    key = rules.run_key(config.run.name, absolute_uri(config.checkpoint.uri))
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    flow_run_id = runtime.flow_run.id
    with get_client(sync_client=True) as client:
        own = client.read_flow_run(flow_run_id) if flow_run_id else None
        deployment_id = own.deployment_id if own else None
        if not deployment_id:
            # `memfit run`, a subflow: no automation restarts it (the exit code and the caller decide).
            return AttemptReport(max_restarts=config.recovery.max_restarts, run_key=key,
                                 reason="not a deployment run")
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[rules.RUN_TAG_PREFIX + key]),
                                          deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200)
        history = [rules.PastAttempt(
            flow_run_id=str(r.id), state_name=r.state.name if r.state else "", message=(r.state.message or "")
            if r.state else "", state_type=r.state.type.value if r.state else "",
            start_time=r.start_time.timestamp() if r.start_time else None,
            end_time=(r.end_time or (r.state.timestamp if r.state else None)).timestamp()
            if (r.end_time or r.state) else None) for r in runs if str(r.id) != str(flow_run_id)]
        decision = rules.decide_attempt(history, config.recovery.max_restarts, key)
        duplicate = _created_earlier(client, own)
        if duplicate is not None:
            decision = decision.model_copy(update={
                "proceed": False, "duplicate_of": duplicate,
                "reason": f"a duplicate restart: flow run {duplicate}, created first with the same parameters, is "
                          "this run's next attempt (two restarts of one end: e.g. Preempted, then Cancelled by a "
                          "shutting-down runner)"})
        if decision.attempt > 1 and decision.proceed and not config.recovery.enabled:
            decision = decision.model_copy(update={"proceed": False, "reason": "recovery.enabled is false: "
                                                   f"not restarted after the previous attempt {decision.cause}"})
        tags = {t for t in own.tags if not t.startswith((rules.RUN_TAG_PREFIX, rules.ATTEMPT_TAG_PREFIX))}
        tags |= {rules.TAG_MEMFIT, rules.RUN_TAG_PREFIX + key, f"{rules.ATTEMPT_TAG_PREFIX}{decision.attempt}"}
        name = config.run.name if decision.attempt == 1 else f"{config.run.name}-attempt-{decision.attempt}"
        name = f"{name}-duplicate" if decision.duplicate_of else name
        client.update_flow_run(flow_run_id, name=name, tags=sorted(tags))
    log.info("recovery: attempt %d of run %s (%s)", decision.attempt, key, decision.reason)
    if decision.duplicate_of:
        return decision
    if decision.proceed and decision.attempt > 1 and decision.previous_end is not None:
        rec = config.recovery
        wait = rules.backoff_wait(decision.attempt - 1, rec.backoff_seconds, rec.max_backoff_seconds,
                                  time.time() - decision.previous_end)
        if wait > 0:  # repeated restarts wait longer: a crash loop costs little (the first wait was the automation's)
            log.info("recovery: waiting %.0f s before restart %d (recovery.backoff_seconds doubled per restart)",
                     wait, decision.attempt - 1)
            time.sleep(wait)
    return decision


def _created_earlier(client: Any, own: Any) -> str | None:
    """The restart created first, live, with this run's parameters, when this run is a later restart of the same
    end (memfit.runtime.recovery.duplicate_of says which runs count)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    def live_run(r: Any) -> rules.LiveRun:
        return rules.LiveRun(flow_run_id=str(r.id), created=r.created.timestamp() if r.created else 0.0,
                             parameters=r.parameters, idempotency_key=r.idempotency_key)

    if not rules.is_restart(live_run(own)):
        return None
    live = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[own.deployment_id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED", "PENDING", "RUNNING"]))), limit=200)
    return rules.duplicate_of(live_run(own), [live_run(r) for r in live])
