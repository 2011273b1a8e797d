"""Retraining tasks: gather the newest data and the champion; report what the eval gate decided."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from memfit.config import MemfitConfig
from memfit.release.retraining import gather, retrain_config
from memfit.reports import RunSummary


@task(name="newest-data-and-champion", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def prepare_retrain_task(config: MemfitConfig, data_uri: str | None) -> MemfitConfig:
    inputs = gather(config, data_uri)
    run_config = retrain_config(config, inputs)
    start = (f"champion version {inputs.champion_version}" if inputs.champion_version
             else "the base model (no champion yet)")
    create_markdown_artifact(key="retrain-inputs", description="What this retraining run starts from",
                             markdown="\n".join([
        "# Retraining inputs", "", "| what | value |", "|---|---|",
        f"| data | `{inputs.data_key}` (sha256 `{inputs.data_sha256[:16]}…`) |",
        f"| starting model | {start} |",
        f"| training checkpoints | `{run_config.checkpoint.uri}` |",
    ]))
    return run_config


@task(name="eval-gate-verdict", cache_policy=NO_CACHE)
def report_gate_task(summary: RunSummary) -> bool:
    passed = bool(summary.gate_passed)
    verdict = (f"promoted: `{summary.registered_model}` is now version {summary.model_version}" if passed
               else "**gate failed**: the champion is unchanged")
    create_markdown_artifact(key="retrain-gate", description="Eval gate of this retraining run", markdown="\n".join([
        "# Eval gate", "", verdict, "", f"Why: {summary.gate_reason}", "",
        f"Validation perplexity: {summary.final_val_perplexity:.4f}; MLflow run `{summary.mlflow_run_id}`.",
    ]))
    if not passed:
        get_run_logger().warning("eval gate failed (%s): champion unchanged", summary.gate_reason)
    return passed
