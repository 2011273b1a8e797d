"""The fine-tune flow: five phases, one task each, in the order a run needs them."""

from __future__ import annotations

from prefect import flow
from prefect.states import Cancelled, Failed

from flows.recovery import ends_in_named_states
from memfit.config import MemfitConfig
from memfit.config.form import RunForm
from memfit.errors import OnnxExportFailed
from memfit.phases import absolute_uri
from memfit.reports import RunSummary
from memfit.runtime.recovery import BUDGET_SPENT, DUPLICATE
from memfit.tracking import scrub
from tasks.attempt import attempt_task
from tasks.export import export_task
from tasks.probe import probe_task
from tasks.recover import recover_task
from tasks.setup import setup_task
from tasks.train import train_task


@flow(name="memfit-finetune", flow_run_name="{config.run.name}", log_prints=True, validate_parameters=True,
      persist_result=True)
@ends_in_named_states  # under a deployment: Preempted / MemoryLimit, the states the restart automations follow
def finetune(form: RunForm = RunForm(), config: MemfitConfig = MemfitConfig()) -> RunSummary:  # noqa: B008
    """Fine-tune a causal LM: probe, recover, plan, train, evaluate and export. The form's fields (model, data,
    steps, ...) come first in the UI; empty ones keep the config's values (the full tree, below them)."""
    config = form.apply(config)
    # Recovery: this flow run's attempt of its logical run (tags, name); a spent restart budget ends it here.
    attempt = attempt_task(config)
    if attempt.duplicate_of:
        return Cancelled(name=DUPLICATE, message=attempt.reason)
    if not attempt.proceed:
        return Failed(name=BUDGET_SPENT, message=attempt.reason)
    # Phase 1: environment check + baseline OOM probe (a real plain step against the budget).
    probe = probe_task(config)
    # Phase 4 before phases 2 and 3: training starts from what recovery finds (the newest verified training
    # checkpoint), and a resume on the same device reuses the plan that checkpoint saved.
    resume = recover_task(config)
    # Phase 2: optimisation stack: the gradient-checkpointing policy and precision that fit (or the saved plan).
    plan = setup_task(config, probe, resume)
    # Phase 3: checkpointed training with MLflow metrics (skipped when the run already finished).
    trained = train_task(config, plan, resume, probe, attempt)
    # Phase 5: evaluation + verified SafeTensors and ONNX exports.
    exported = export_task(config, trained)
    summary = RunSummary(
        status="completed", run_name=config.run.name, mlflow_run_id=trained.mlflow_run_id,
        tracking_uri=scrub(config.tracking.resolved_uri()), checkpoint_uri=absolute_uri(config.checkpoint.uri),
        safetensors_dir=exported.safetensors_dir, onnx_path=exported.onnx_path, steps=trained.steps,
        initial_val_loss=trained.initial_val_loss, final_val_loss=exported.final_val_loss,
        final_val_perplexity=exported.final_val_perplexity, onnx_max_abs_diff=exported.onnx_max_abs_diff,
        plan=plan, baseline=probe.baseline, export_uri=exported.export_uri, onnx_error=exported.onnx_error,
        **_registry_fields(exported.registry),
    )
    if summary.onnx_error:  # the rest is done and recorded; the flow run fails so the UI and automations see it
        raise OnnxExportFailed(summary.onnx_error, summary)
    return summary


def _registry_fields(outcome: dict | None) -> dict:
    if not outcome:
        return {}
    return {"registered_model": f"{outcome['model_name']}@{outcome['alias']}" if outcome.get("version") else None,
            "model_version": outcome.get("version"), "gate_passed": outcome["gate_passed"],
            "gate_reason": outcome["gate_reason"]}
