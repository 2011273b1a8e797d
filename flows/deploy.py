"""`memfit serve`: register the finetune, retrain (cron schedule) and export deployments and serve them."""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect.client.schemas.schedules import CronSchedule

from memfit.config import MemfitConfig
from memfit.runtime.recovery import TAG_RECOVERY

log = logging.getLogger("memfit.recovery")

DESCRIPTIONS = {
    "finetune": "Fine-tune a causal LM: probe, recover, plan, train, evaluate and export (manual runs).",
    "retrain": "Scheduled retraining: newest data, from the champion, promoted only if the eval gate passes.",
    "export": "Export a training checkpoint (local or S3) to a verified SafeTensors folder and ONNX file.",
}


def build_deployments(cfg: MemfitConfig, names: tuple[str, ...] = ("finetune", "retrain", "export")) -> list[Any]:
    """RunnerDeployments whose default parameters are `cfg`; the UI renders the config as a typed form."""
    # Tags a flow run is created with are what the recovery automations see (flows/recovery.py).
    tags = ["memfit", TAG_RECOVERY] if cfg.recovery.enabled else ["memfit"]
    from flows.finetune import finetune

    deployments = [finetune.to_deployment(
        "finetune", parameters={"config": cfg.model_dump(mode="json")}, description=DESCRIPTIONS["finetune"],
        tags=tags, enforce_parameter_schema=True)]
    if "retrain" in names:
        from flows.retrain import retrain

        schedules = []
        if cfg.deploy.retrain_cron:
            schedules = [CronSchedule(cron=cfg.deploy.retrain_cron, timezone=cfg.deploy.timezone)]
        deployments.append(retrain.to_deployment(
            "retrain", parameters={"config": cfg.model_dump(mode="json")}, schedules=schedules,
            description=DESCRIPTIONS["retrain"], tags=tags, enforce_parameter_schema=True))
    if "export" in names:
        from flows.export import export

        deployments.append(export.to_deployment(
            "export", description=DESCRIPTIONS["export"], tags=["memfit"], enforce_parameter_schema=True))
    return deployments


def serve_deployments(cfg: MemfitConfig, limit: int | None = None) -> None:
    """Register the deployments with the Prefect API (PREFECT_API_URL) and run their flow runs here; with recovery
    on, the runs send heartbeats and the automations that restart them are applied first."""
    if cfg.recovery.enabled:
        from flows.recovery import apply_automations

        # The flow runs this process starts inherit it: Prefect's engine sends a heartbeat this often.
        os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(cfg.recovery.heartbeat_seconds))
        for row in apply_automations(cfg):
            log.info("recovery automation %s: %s", row["applied"], row["name"])
    # prefect.serve's runner, except on SIGTERM (flows/draining.py): its flow runs end Preempted, not Cancelled.
    from flows.draining import serve_draining

    serve_draining(build_deployments(cfg), limit=limit, query_seconds=cfg.deploy.poll_seconds,
                   drain_seconds=cfg.checkpoint.grace_seconds + 30, spot_cfg=cfg.checkpoint.spot)
