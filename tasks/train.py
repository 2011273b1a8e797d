"""Phase 3 task: checkpointed training with metrics in MLflow, one run per training slot."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from memfit import phases
from memfit.config import MemfitConfig
from memfit.memory.planner.monitor import event_sink
from memfit.reports import AttemptReport, PlanReport, ProbeReport, ResumePoint, TrainReport
from tasks.slots import training_slot


def emit_memory_event(event: dict[str, Any]) -> None:
    """A memory warning or limit from the monitor as a Prefect event an automation can trigger on.

    Event names: memfit.memory.warning, memfit.memory.limit; the resource is the memfit run, related to
    the flow run and task run it happened in; the payload holds the figures.
    """
    from prefect import runtime
    from prefect.events import emit_event

    related = []
    if runtime.flow_run.id:
        related.append({"prefect.resource.id": f"prefect.flow-run.{runtime.flow_run.id}",
                        "prefect.resource.role": "flow-run", "prefect.resource.name": str(runtime.flow_run.name)})
    if runtime.task_run.id:
        related.append({"prefect.resource.id": f"prefect.task-run.{runtime.task_run.id}",
                        "prefect.resource.role": "task-run"})
    emit_event(event=event["event"],
               resource={"prefect.resource.id": f"memfit.run.{event['run_name']}",
                         "prefect.resource.name": str(event["run_name"]),
                         "memfit.mlflow-run-id": str(event.get("mlflow_run_id") or "")},
               related=related, payload=event)


# No retries here: a retry would restart from the resume point computed before this attempt;
# rerunning the flow recovers from the newest training checkpoint instead.
@task(name="train", cache_policy=NO_CACHE, persist_result=True)
def train_task(config: MemfitConfig, plan: PlanReport, resume: ResumePoint, probe: ProbeReport,
               attempt: AttemptReport | None = None) -> TrainReport:
    if resume.finished:
        return phases.train(config, plan, resume, probe, attempt)
    # Held for the whole of training: a second run on this machine waits (and says so) instead of sharing the
    # GPU. A run killed while holding it never blocks the next one (tasks/slots.py says how, per mode).
    with training_slot(config), event_sink(emit_memory_event):
        return phases.train(config, plan, resume, probe, attempt)
