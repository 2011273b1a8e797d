"""Checks that fail in seconds, before Prefect starts or a model loads: inputs, outputs, stores, tracking."""

from __future__ import annotations

from pathlib import Path

from memfit.config import DataConfig, MemfitConfig, ModelConfig
from memfit.data.files import HUB_PREFIX, blank_data, data_files, missing_data, saved_dataset_dir
from memfit.errors import ConfigError, DataError
from memfit.files import probe_writable
from memfit.models.source import resolve_model_source
from memfit.storage import open_checkpoint_store

__all__ = ["preflight"]

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


def check_data_records(data: DataConfig, work_dir: str | None = None) -> None:
    """Every record has its fields (named by file, record number and field) and a given chat template exists and
    can mark assistant turns; what needs the model's tokenizer (overlong, unknown roles) is checked when packing."""
    if data.path is None and data.chat_template is None:
        return  # the synthetic corpus: nothing to read (and no torch import to pay for)
    from memfit.data.formats import load_texts
    from memfit.data.templates import check_template_source

    if data.path is not None and not data.path.startswith(HUB_PREFIX):
        if work_dir is None:
            load_texts(data)
        else:  # once per data version: bytes read and checked before are known by their fingerprint
            from memfit.data.source import DataSource

            source = DataSource(data, work_dir)
            source.digest()
            source.release()
    check_template_source(data)


def preflight(cfg: MemfitConfig) -> None:
    """Fail in seconds, before any model is built, on inputs that are missing and outputs that cannot be written."""
    check_data_source(cfg.data)
    check_data_records(cfg.data, cfg.run.work_dir)
    check_model_source(cfg.model)
    check_writable_dir(cfg.run.work_dir, "run.work_dir")
    check_writable_dir(cfg.export.dir, "export.dir")
    if cfg.export.adapter and cfg.lora.enabled is False:
        raise ConfigError("export.adapter: this run trains all weights (lora.enabled is false), so there is no "
                          "adapter to export; set lora.enabled=true (or auto) or drop export.adapter")
    if "gguf" in cfg.export.enabled_formats():  # no converter, an unknown family, a missing package: now, not later
        from memfit.release.gguf import check_gguf_export

        check_gguf_export(_model_config(cfg.model), cfg.export.gguf_quants, cfg.export.gguf_converter)
    if "gguf-adapter" in cfg.export.enabled_formats():  # no adapter, a QLoRA base, no converter: before training
        from memfit.release.gguf_adapter import check_gguf_adapter_export

        check_gguf_adapter_export(cfg.export, cfg.lora, cfg.export.gguf_converter)
    # S3 too: a missing bucket, bad credentials or a down endpoint fail here, in seconds, not after the probe.
    open_checkpoint_store(cfg).check_writable()
    from memfit.tracking import check_tracking

    check_tracking(cfg.tracking)  # an unreachable MLflow server fails here, naming the URI, not after training
    if cfg.eval.tasks or cfg.eval.sets:  # an unknown task, a missing data file, a record without a reference
        from memfit.evaluation.sets import check_sets
        from memfit.evaluation.tasks import check_tasks

        check_tasks(cfg.eval)
        check_sets(cfg.eval.sets)
    if cfg.export.uri:
        from memfit.storage import open_store

        open_store(cfg.export.uri).check_writable()


def _model_config(model: ModelConfig) -> dict | None:
    """The config.json of the model a run trains: the preset's family, or a local folder's; None for a hub id
    (phase 5 checks the downloaded config)."""
    import json

    if model.name_or_path is None:
        return {"tiny-llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                "tiny-gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}}[model.preset]
    config = Path(model.name_or_path) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None
