"""Checks that fail in seconds, before Prefect starts or a model loads: inputs, outputs, stores, tracking."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memfit.config import DataConfig, MemfitConfig, ModelConfig
from memfit.datafiles import HUB_PREFIX, SUPPORTED_SUFFIXES, blank_data, data_files, missing_data, saved_dataset_dir
from memfit.errors import ConfigError, DataError, ModelLoadError
from memfit.files import probe_writable

__all__ = ["SUPPORTED_SUFFIXES", "data_files", "preflight"]

# A hub id is "name" or "org/name"; anything else that does not exist locally is a missing folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_SNIFF_BYTES = 1 << 16  # enough of each file to tell "has text" from "blank", without reading a corpus


def check_data_source(data: DataConfig) -> None:
    """data.path exists and some file under it holds more than whitespace (the loader checks the rest)."""
    if data.path is None or data.path.startswith(HUB_PREFIX):
        return  # a hub dataset is checked when it loads (preflight stays offline)
    path = Path(data.path).expanduser()
    if not path.exists():
        raise missing_data(path)
    if saved_dataset_dir(path):
        return
    for f in data_files(path):
        try:
            with f.open("rb") as fh:
                head = fh.read(_SNIFF_BYTES)
        except OSError as err:
            raise DataError(f"data.path: cannot read {f} ({err.strerror or err}); check its permissions") from None
        if head.strip():
            return
        if len(head) == _SNIFF_BYTES:
            return  # 64 KiB of whitespace and more to come: let the loader decide
    raise blank_data(path)


def resolve_model_source(name_or_path: str, need_config: bool) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it a local folder); raises for missing or odd local paths."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model.name_or_path: {path} is a file; point it at a model folder "
                                 "(the output of save_pretrained) or a hub id")
        if need_config and not (path / "config.json").is_file():
            raise ModelLoadError(f"model.name_or_path: folder {path} has no config.json; point it at a "
                                 "Hugging Face model folder (the output of save_pretrained)")
        return str(path), True
    looks_local = name_or_path.startswith(("/", "./", "../", "~", ".\\")) or not _HUB_ID.match(name_or_path)
    if looks_local:
        full = str(path.absolute())
        shown = name_or_path if full == name_or_path else f"{name_or_path} ({full})"
        raise ModelLoadError(f"model.name_or_path: folder {shown} not found; check the path, or give a "
                             "hub id like 'org/name'")
    return name_or_path, False


def check_model_source(model: ModelConfig) -> None:
    if model.name_or_path:
        resolve_model_source(model.name_or_path, need_config=True)


def check_writable_dir(path: str | Path, field: str) -> None:
    folder = Path(path)
    try:
        probe_writable(folder)
    except OSError as err:
        raise ConfigError(f"{field}: cannot write to {folder} ({err.strerror or err}); choose a writable folder "
                          f"with --set {field}=PATH") from None


def open_checkpoint_store(cfg: MemfitConfig) -> Any:
    """The store at checkpoint.uri, with the S3 settings of the config (credentials: boto3's own chain)."""
    from memfit.storage import is_remote, open_store

    ck = cfg.checkpoint
    if is_remote(ck.uri):
        return open_store(ck.uri, endpoint_url=ck.endpoint_url, region=ck.region,
                          multipart_threshold_mb=ck.multipart_threshold_mb)
    for name in ("endpoint_url", "region"):
        if getattr(ck, name) is not None:
            raise ConfigError(f"checkpoint.{name} only applies to s3:// uris, not checkpoint.uri={ck.uri!r}")
    return open_store(ck.uri)


def check_data_records(data: DataConfig) -> None:
    """Every record has its fields (named by file, record number and field) and a given chat template exists and
    can mark assistant turns; what needs the model's tokenizer (overlong, unknown roles) is checked when packing."""
    if data.path is None and data.chat_template is None:
        return  # the synthetic corpus: nothing to read (and no torch import to pay for)
    from memfit.data.formats import load_texts
    from memfit.data.templates import check_template_source

    if data.path is not None and not data.path.startswith(HUB_PREFIX):
        load_texts(data)
    check_template_source(data)


def preflight(cfg: MemfitConfig) -> None:
    """Fail in seconds, before any model is built, on inputs that are missing and outputs that cannot be written."""
    check_data_source(cfg.data)
    check_data_records(cfg.data)
    check_model_source(cfg.model)
    check_writable_dir(cfg.run.work_dir, "run.work_dir")
    check_writable_dir(cfg.export.dir, "export.dir")
    # S3 too: a missing bucket, bad credentials or a down endpoint fail here, in seconds, not after the probe.
    open_checkpoint_store(cfg).check_writable()
    from memfit.tracking import check_tracking

    check_tracking(cfg.tracking)  # an unreachable MLflow server fails here, naming the URI, not after training
    if cfg.export.uri:
        from memfit.storage import open_store

        open_store(cfg.export.uri).check_writable()
