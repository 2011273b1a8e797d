"""`memfit serve`: register the finetune, retrain (cron schedule) and export deployments and serve them."""

from __future__ import annotations

from typing import Any

from prefect import serve
from prefect.client.schemas.schedules import CronSchedule

from memfit.config import MemfitConfig

DESCRIPTIONS = {
    "finetune": "Fine-tune a causal LM: probe, plan, recover, train, evaluate and export (manual runs).",
    "retrain": "Scheduled retraining: newest data, from the champion, promoted only if the eval gate passes.",
    "export": "Export a training checkpoint (local or S3) to a verified SafeTensors folder and ONNX file.",
}


def build_deployments(cfg: MemfitConfig, names: tuple[str, ...] = ("finetune", "retrain", "export")) -> list[Any]:
    """RunnerDeployments whose default parameters are `cfg`; the UI renders the config as a typed form."""
    from flows.finetune import finetune

    deployments = [finetune.to_deployment(
        "finetune", parameters={"config": cfg.model_dump(mode="json")}, description=DESCRIPTIONS["finetune"],
        tags=["memfit"], enforce_parameter_schema=True)]
    if "retrain" in names:
        from flows.retrain import retrain

        schedules = []
        if cfg.deploy.retrain_cron:
            schedules = [CronSchedule(cron=cfg.deploy.retrain_cron, timezone=cfg.deploy.timezone)]
        deployments.append(retrain.to_deployment(
            "retrain", parameters={"config": cfg.model_dump(mode="json")}, schedules=schedules,
            description=DESCRIPTIONS["retrain"], tags=["memfit"], enforce_parameter_schema=True))
    if "export" in names:
        from flows.export import export

        deployments.append(export.to_deployment(
            "export", description=DESCRIPTIONS["export"], tags=["memfit"], enforce_parameter_schema=True))
    return deployments


def serve_deployments(cfg: MemfitConfig, limit: int | None = None) -> None:
    """Register the deployments with the Prefect API (PREFECT_API_URL) and run their flow runs here."""
    serve(*build_deployments(cfg), limit=limit, print_starting_message=True, query_seconds=cfg.deploy.poll_seconds)
