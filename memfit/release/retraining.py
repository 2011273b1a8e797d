"""Scheduled retraining: the newest data file and the current champion decide the next run's config."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from memfit.config import MemfitConfig
from memfit.data.files import SUPPORTED_SUFFIXES
from memfit.errors import ConfigError, DataError
from memfit.files import sha256_file
from memfit.storage import open_store

log = logging.getLogger("memfit.retrain")


@dataclass(frozen=True)
class RetrainInputs:
    data_key: str
    data_path: str
    data_sha256: str
    champion_version: str | None
    champion_dir: str | None


def newest_data(data_uri: str, dest: Path) -> tuple[str, Path]:
    """Download the newest .txt/.jsonl under data_uri (by name: date-stamped names sort by time)."""
    store = open_store(data_uri)
    keys = sorted(k for k in store.list("") if k.endswith(SUPPORTED_SUFFIXES))
    if not keys:
        raise DataError(f"deploy.retrain_data_uri {data_uri}: no .txt or .jsonl files there; put dated files "
                        "such as 2026-11-30.jsonl under it")
    key = keys[-1]
    local = dest / key.replace("/", "__")
    local.parent.mkdir(parents=True, exist_ok=True)
    store.get_file(key, local)
    return key, local


def gather(cfg: MemfitConfig, data_uri: str | None) -> RetrainInputs:
    """The newest data and the champion's SafeTensors folder (None: no champion yet, start from the base)."""
    uri = data_uri or cfg.deploy.retrain_data_uri
    if not uri:
        raise ConfigError("deploy.retrain_data_uri: retraining needs a data location (a folder or "
                          "s3://bucket/prefix of .txt/.jsonl files); set it or pass data_uri")
    work = Path(cfg.run.work_dir) / "retrain"
    key, local = newest_data(uri, work / "data")
    champion_version = champion_dir = None
    if cfg.tracking.backend == "mlflow" and cfg.registry.enabled:
        from memfit.release.registry import current_champion, fetch_champion
        from memfit.tracking.sqlite_seed import open_client

        tracking_uri = cfg.tracking.resolved_uri()
        name = cfg.registry.model_name or cfg.run.name
        champion = current_champion(open_client(tracking_uri), name, cfg.registry.alias)
        if champion is not None:
            champion_version = champion.version
            champion_dir = str(fetch_champion(tracking_uri, name, work / "champion" / f"v{champion.version}",
                                              cfg.registry.alias))
    log.info("retraining on %s (newest under %s) from %s", key, uri,
             f"champion v{champion_version}" if champion_version else "the base model")
    return RetrainInputs(data_key=key, data_path=str(local), data_sha256=sha256_file(local),
                         champion_version=champion_version, champion_dir=champion_dir)


def retrain_config(cfg: MemfitConfig, inputs: RetrainInputs) -> MemfitConfig:
    """The run's config: new data, the champion as the starting model, its own checkpoints and export folder.

    The registered model name stays the base run's, so the gate compares against (and promotes) the same
    champion; the checkpoint location is keyed on data and champion, so rerunning the same retrain resumes.
    """
    tag = hashlib.sha256(f"{inputs.data_sha256}:{inputs.champion_version}".encode()).hexdigest()[:12]
    data = cfg.data.model_copy(update={"path": inputs.data_path})
    model = cfg.model
    if inputs.champion_dir:
        model = cfg.model.model_copy(update={"name_or_path": inputs.champion_dir})
    return cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-retrain-{tag[:6]}"}),
        "data": data,
        "model": model,
        "checkpoint": cfg.checkpoint.model_copy(update={"uri": f"{cfg.checkpoint.uri.rstrip('/')}/retrain-{tag}"}),
        "export": cfg.export.model_copy(update={"dir": str(Path(cfg.export.dir) / f"retrain-{tag}")}),
        "registry": cfg.registry.model_copy(update={"model_name": cfg.registry.model_name or cfg.run.name}),
    })
