"""Phase 3 task: checkpointed training with metrics in MLflow, one run per training slot."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from memfit import pipeline
from memfit.config import MemfitConfig
from memfit.reports import PlanReport, ProbeReport, ResumePoint, TrainReport
from tasks.slots import ensure_training_slots


# No retries here: a retry would restart from the resume point computed before this attempt;
# rerunning the flow recovers from the newest training checkpoint instead.
@task(name="train", cache_policy=NO_CACHE, persist_result=True)
def train_task(config: MemfitConfig, plan: PlanReport, resume: ResumePoint, probe: ProbeReport) -> TrainReport:
    if resume.finished:
        return pipeline.train(config, plan, resume, probe)
    ensure_training_slots(config.deploy.concurrency_key, config.deploy.training_slots)
    # Held for the whole of training: a second run on this machine waits instead of sharing the GPU.
    # A short lease (renewed in the background while training runs): after a SIGKILL (spot reclaim past
    # the grace) the dead run's slot frees in about a minute, not Prefect's default 5, so the rerun resumes.
    with concurrency(config.deploy.concurrency_key, occupy=1, lease_duration=60):
        return pipeline.train(config, plan, resume, probe)
