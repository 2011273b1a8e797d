"""Scheduled retraining: newest data, fine-tuned from the champion, promoted only if the eval gate passes."""

from __future__ import annotations

from prefect import flow
from prefect.states import Cancelled, Failed

from flows.finetune import finetune
from flows.recovery import ends_in_named_states
from memfit.config import MemfitConfig
from memfit.reports import RunSummary
from memfit.runtime.recovery import BUDGET_SPENT, DUPLICATE
from tasks.attempt import attempt_task
from tasks.retrain import prepare_retrain_task, report_gate_task


@flow(name="memfit-retrain", flow_run_name="{config.run.name}-retrain", log_prints=True,
      validate_parameters=True, persist_result=True)
@ends_in_named_states  # Preempted / MemoryLimit, the states the restart automations follow
def retrain(config: MemfitConfig = MemfitConfig(), data_uri: str | None = None) -> RunSummary:  # noqa: B008
    """Fine-tune the current champion (or the base model) on the newest data; promote only on a passed gate."""
    # Recovery: this flow run's attempt of its logical run; a spent restart budget ends it here.
    attempt = attempt_task(config)
    if attempt.duplicate_of:
        return Cancelled(name=DUPLICATE, message=attempt.reason)
    if not attempt.proceed:
        return Failed(name=BUDGET_SPENT, message=attempt.reason)
    # The newest data file and the current champion decide this run's config.
    run_config = prepare_retrain_task(config, data_uri)
    # The five phases, as a subflow; phase 5's eval gate registers and promotes, or leaves the champion.
    summary = finetune(config=run_config)
    # The verdict, visible in Prefect (artifact, warning) as it is in MLflow (memfit.gate tag).
    report_gate_task(summary)
    return summary
