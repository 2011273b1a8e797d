"""Phase 3 task: checkpointed training with metrics in MLflow."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from memfit import pipeline
from memfit.config import MemfitConfig
from memfit.reports import PlanReport, ProbeReport, ResumePoint, TrainReport


# No retries here: a retry would restart from the resume point computed before this attempt;
# rerunning the flow recovers from the newest training checkpoint instead.
@task(name="train", cache_policy=NO_CACHE)
def train_task(config: MemfitConfig, plan: PlanReport, resume: ResumePoint, probe: ProbeReport) -> TrainReport:
    return pipeline.train(config, plan, resume, probe)
