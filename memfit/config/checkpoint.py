"""The checkpoint and monitor sections: training checkpoints (where, how often, S3), spot notices, memory readings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from memfit.config.release import Section as _Section


class SpotWatcherConfig(_Section):
    """Polling the cloud's instance metadata for a spot interruption notice (AWS gives 2 minutes)."""

    enabled: bool | None = Field(
        None, description="Watch for a spot interruption notice and stop as on SIGTERM (finish the step, save, "
        "exit 75). null: $MEMFIT_SPOT_WATCHER (true/false), else off.")
    metadata_url: str | None = Field(
        None, description="Base URL of the instance metadata service, with or without /latest. "
        "null: $MEMFIT_SPOT_METADATA_URL, else AWS IMDS http://169.254.169.254/latest/.")
    poll_seconds: float = Field(5.0, gt=0.0, le=60.0, description="Seconds between polls (AWS suggests 5).")
    timeout_seconds: float = Field(1.0, gt=0.0, le=30.0, description="Timeout of each metadata request.")
    imdsv2: bool = Field(True, description="Take an IMDSv2 session token (PUT api/token) first; without one "
                         "(PUT refused) the watcher falls back to IMDSv1 GETs.")
    on_rebalance: Literal["save", "stop", "ignore"] = Field(
        "save", description="A rebalance recommendation (higher interruption risk, before any notice): save a "
        "training checkpoint now and go on, stop as on a notice, or only log it.")

    @field_validator("metadata_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://169.254.169.254/latest/")
        return v


class MonitorConfig(_Section):
    """Memory readings while training, a warning before the limit, and an optional clean stop at it."""

    enabled: bool = Field(True, description="Record memory (MLflow metrics memory/*, the progress line) and warn.")
    every_steps: int = Field(10, ge=1, description="Read memory at the first step and every N optimizer steps.")
    warn_fraction: float = Field(0.9, gt=0.0, le=1.0, description="Warn once (log, MLflow tag, Prefect event) when "
                                 "the peak passes this fraction of the budget (memory.budget_gb, else the "
                                 "device's memory).")
    stop_at_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="Stop cleanly with a training checkpoint (exit code 76) when the peak "
        "passes this fraction of the budget; unset: never stop.")
    track_tensors: bool = Field(True, description="CPU: count live tensor bytes (the figure the probe reports, "
                                "compared with memory.budget_gb) on the steps monitor.count_every_steps says; off: "
                                "RSS growth since the start.")
    count_every_steps: int = Field(
        100, ge=1, description="CPU with track_tensors: count live tensor bytes on steps 1 and 2 and every N steps "
        "(counting runs the step through a Python dispatch mode, ≈ 1.2-1.6x slower); readings in between report "
        "the last counted peak (the same shapes reach the same peak each step).")


class CheckpointConfig(_Section):
    uri: str = Field("runs/checkpoints", description="Where training checkpoints go: a local folder "
                     "or s3://bucket/prefix.")
    every_steps: int = Field(50, ge=1, description="Save a training checkpoint every N optimizer steps.")
    keep_last: int = Field(2, ge=1, description="Complete training checkpoints to keep.")
    resume: bool = Field(True, description="Resume from the newest complete training checkpoint at uri.")
    grace_seconds: float = Field(
        30.0, gt=0, description="Time a preemption notice leaves to save (Kubernetes "
        "terminationGracePeriodSeconds, 120 s on AWS spot); a warning says when a save took longer.")
    endpoint_url: str | None = Field(
        None, description="s3:// only: an S3-compatible endpoint (MinIO, Ceph, moto). null: $AWS_ENDPOINT_URL_S3 "
        "or $AWS_ENDPOINT_URL, else AWS. Credentials never go in the config: boto3 reads AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance/pod role.")
    region: str | None = Field(None, description="s3:// only: the bucket's region. null: $AWS_REGION, "
                               "$AWS_DEFAULT_REGION or the profile.")
    multipart_threshold_mb: int = Field(64, ge=5, le=5120, description="s3:// only: files larger than this "
                                        "go up in parts of this size, each part retried on its own.")
    on_busy: Literal["wait", "skip"] = Field(
        "wait", description="A periodic save due while the previous one is still uploading: wait for it "
        "(training stalls) or skip this one; either is logged. Final and preemption saves always wait.")
    upload_attempts: int = Field(
        3, ge=1, le=20, description="Attempts of a whole save (upload, then manifest) on top of botocore's "
        "per-request retries (which ride out ~15 s): an S3 outage longer than that is retried with backoff.")
    retry_backoff_seconds: float = Field(5.0, ge=0.0, le=600.0,
                                         description="Wait before the 2nd save attempt; doubles each time.")
    spot: SpotWatcherConfig = Field(default_factory=SpotWatcherConfig)

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://minio:9000")
        if "@" in v.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("must not hold credentials (user:secret@host); set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY in the environment instead")
        return v
