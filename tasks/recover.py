"""Phase 4 task: find, download and verify the newest training checkpoint of this run."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from memfit import phases
from memfit.config import MemfitConfig
from memfit.reports import ResumePoint


# Retries cover transient store errors while listing or downloading; verification failures are final.
@task(name="recover-training-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      timeout_seconds=3600)
def recover_task(config: MemfitConfig) -> ResumePoint:
    return phases.recover_training_checkpoint(config)
