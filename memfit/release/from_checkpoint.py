"""From trained weights to delivered exports: any training checkpoint → verified SafeTensors, ONNX, adapter, GGUF."""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from memfit.checkpoints import CheckpointManager, LoadedCheckpoint
from memfit.errors import CheckpointError, ConfigError, ExportError, MemfitError, StorageError

# download_export was defined here until the upload moved to uploads.py; callers still import it from here.
from memfit.release.uploads import download_export as download_export
from memfit.release.uploads import upload_export

log = logging.getLogger("memfit.exporting")

HF_DIR = "hf"
ONNX_FILE = "model.onnx"
_STEP = re.compile(r"(?:^|/)(step-\d{8})/?$")


@dataclass
class ExportFiles:
    """A verified export on local disk."""

    dir: str
    safetensors_dir: str | None  # None: ONNX only (`memfit export --onnx-only`)
    safetensors_max_abs_diff: float | None
    onnx_path: str | None = None
    onnx_max_abs_diff: float | None = None
    onnx_opset: int | None = None
    # The absolute bound (onnx_atol + onnx_rtol x max |logit|) at the shape where the difference was largest.
    onnx_atol: float | None = None
    onnx_parity: list[dict[str, Any]] | None = None  # memfit.release.parity.ShapeParity per verification shape
    onnx_criteria: dict[str, float] | None = None
    onnx_error: str | None = None  # why the ONNX export failed; the SafeTensors export is still valid
    adapter_dir: str | None = None  # the verified peft folder (adapter.py), uploaded with the rest
    gguf_dir: str | None = None  # the verified GGUF folder (gguf_export.py), uploaded with the rest
    gguf_adapter_dir: str | None = None  # the verified gguf-adapter folder (gguf_adapter.py), uploaded with the rest
    uploaded_uri: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- reading a training checkpoint ------------------------------------------------------------------
def resolve_checkpoint(uri: str, dest: Path) -> LoadedCheckpoint:
    """`…/step-NNNNNNNN` → that checkpoint; a checkpoint root → its newest verified one. Downloaded, verified."""
    from memfit.storage import open_store

    uri = uri.rstrip("/") or uri
    m = _STEP.search(uri)
    prefix = m.group(1) if m else None
    root = uri[: -len(prefix)].rstrip("/") if prefix else uri
    if prefix and not root:
        root = "."
    if "://" not in root and not Path(root).is_dir():
        raise CheckpointError(f"training checkpoint {uri} not found: {Path(root).absolute()} is not a folder; "
                              "give a checkpoint root (checkpoint.uri) or one of its step-NNNNNNNN folders")
    manager = CheckpointManager(open_store(root))
    try:
        try:
            infos = manager.list()
        except StorageError as err:
            raise CheckpointError(f"training checkpoint {uri}: cannot list {root} ({err})") from None
        if prefix:
            info = next((i for i in infos if i.prefix == prefix), None)
            if info is None:
                raise CheckpointError(f"training checkpoint {uri} not found or incomplete (no valid manifest.json); "
                                      f"`memfit checkpoints ls {root}` lists the complete ones")
            return manager.load(info, dest / prefix)  # CheckpointError names the file that fails
        if not infos:
            raise CheckpointError(f"no complete training checkpoint under {uri} (no step-NNNNNNNN folder with a "
                                  "manifest.json); check the URI with `memfit checkpoints ls`")
        loaded = manager.latest(dest)
        if loaded is None:
            raise CheckpointError(f"no training checkpoint under {uri} verifies: all {len(infos)} fail their "
                                  "checksums (see the warnings above)")
        return loaded
    finally:
        manager.close()


def config_from_checkpoint(loaded: LoadedCheckpoint, uri: str, overrides: list[str] | None = None) -> Any:
    """The run's config, as saved in the training checkpoint (they are self-describing), then `overrides`."""
    from memfit.config import apply_overrides, from_dict

    try:
        data = yaml.safe_load(loaded.config_yaml) or {}
    except yaml.YAMLError as err:
        raise CheckpointError(f"{uri}: config.yaml of the training checkpoint is not valid YAML ({err})") from None
    source = f"{loaded.info.uri}/config.yaml"
    apply_overrides(data, overrides)
    return from_dict(data, source=source + (" + --set " + " ".join(overrides) if overrides else ""))


def checkpoint_plan(loaded: LoadedCheckpoint) -> Any:
    """The PlanReport the checkpoint's run trained with (state.json "plan"), or None for one written before plans
    were saved (its config.yaml holds the planned settings)."""
    from memfit.reports import PlanReport

    saved = loaded.state.get("plan")
    if saved is None:
        return None
    try:
        return PlanReport.model_validate(saved)
    except ValueError as err:
        raise CheckpointError(f"training checkpoint {loaded.info.uri}: its saved plan does not read "
                              f"({str(err).splitlines()[0]})") from None


def trained_quantize(lora_cfg: Any, loaded: LoadedCheckpoint) -> str:
    """The frozen base's quantization the run trained its adapters on: its plan's, else its saved config's
    (`lora_cfg`, the checkpoint's lora section)."""
    plan = checkpoint_plan(loaded)
    if plan is None:
        return lora_cfg.quantize
    return plan.quantize if plan.lora else "none"


def model_for_checkpoint(cfg: Any, work_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the architecture the checkpoint was trained on (a preset is rebuilt in work_dir)."""
    from memfit.data.formats import data_digest, load_texts
    from memfit.models.loading import load_model_and_tokenizer

    if cfg.model.name_or_path:
        model, tok, _ = load_model_and_tokenizer(cfg, [], "")
        return model, tok
    # A preset's tokenizer is trained on the run's data: rebuild it from the same texts and seed.
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"work_dir": str(work_dir)})})
    try:
        texts = load_texts(cfg.data)
    except MemfitError as err:
        raise type(err)(f"{err} (the checkpoint's model is preset {cfg.model.preset}, whose tokenizer is "
                        "rebuilt from the training data)") from None
    model, tok, _ = load_model_and_tokenizer(cfg, texts, data_digest(texts))
    return model, tok


# -- exporting ----------------------------------------------------------------------------------------
def parity_criteria(export_cfg: Any) -> Any:
    """memfit.release.parity.ParityCriteria from ExportConfig's onnx_* fields."""
    from memfit.release.parity import ParityCriteria

    return ParityCriteria(rtol=export_cfg.onnx_rtol, atol=export_cfg.onnx_atol, min_top1=export_cfg.onnx_min_top1,
                          max_kl=export_cfg.onnx_max_kl)


def export_model(model: Any, tokenizer: Any, out_dir: str | Path, *, onnx: bool = True, safetensors: bool = True,
                 criteria: Any = None, opset: int | None = None,
                 metadata: dict[str, Any] | None = None, dtype: str = "fp32") -> ExportFiles:
    """SafeTensors folder (out_dir/hf) then ONNX (out_dir/model.onnx), each verified.

    A SafeTensors failure raises; an ONNX failure is recorded in `onnx_error` and returned, because the
    SafeTensors export is complete and valid without it (the caller decides how loudly to fail).
    """
    import torch

    from memfit.release.formats import export_onnx, export_safetensors
    from memfit.release.parity import ParityCriteria

    out = Path(out_dir).absolute()
    # export.dtype: the SafeTensors weights' dtype; ONNX and its parity check stay fp32.
    model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    files = ExportFiles(dir=str(out), safetensors_dir=None, safetensors_max_abs_diff=None)
    if safetensors:
        st = export_safetensors(model, tokenizer, out / HF_DIR, metadata=metadata)
        files.safetensors_dir, files.safetensors_max_abs_diff = st.dir, st.max_abs_diff
    model.to(dtype=torch.float32)
    if not onnx:
        return files
    criteria = criteria or ParityCriteria()
    try:
        res = export_onnx(model.cpu(), out / ONNX_FILE, criteria=criteria, opset=opset, metadata=metadata)
    except ExportError as err:
        files.onnx_error = str(err).replace("\n", " ")  # one line, even for the exporter's own log
        log.error("%s", files.onnx_error)
        return files
    worst = max(res.per_shape, key=lambda p: p.max_abs_diff)
    files.onnx_path, files.onnx_max_abs_diff, files.onnx_opset = res.path, res.max_abs_diff, res.opset
    files.onnx_atol = criteria.tolerance(worst.max_abs_logit)
    files.onnx_parity = [p.to_dict() for p in res.per_shape]
    files.onnx_criteria = asdict(criteria)
    return files


def onnx_redo_command(checkpoint_uri: str, out_dir: str) -> str:
    """The command that redoes only the ONNX export of a training checkpoint (the SafeTensors folder stays)."""
    return f"memfit export {checkpoint_uri} --out {out_dir} --onnx-only"


def export_checkpoint(uri: str, out_dir: str | Path, *, onnx: bool = True, onnx_only: bool = False,
                      upload_uri: str | None = None, overrides: list[str] | None = None,
                      adapter: bool = False, gguf: bool = False,
                      gguf_quants: list[str] | None = None, gguf_adapter: bool = False) -> dict[str, Any]:
    """`memfit export`: any training checkpoint (local or S3) → verified exports in out_dir (and upload_uri).

    `onnx_only` redoes just out_dir/model.onnx and leaves out_dir/hf alone; `overrides` (`export.onnx_rtol=…`)
    change the checkpoint's saved config for this export. An ONNX failure raises ExportError.
    """
    from memfit.runtime.env import pin_threads

    if onnx_only and gguf:
        raise ConfigError("--onnx-only exports only model.onnx; GGUF is made from the SafeTensors folder: drop one")
    if onnx_only and (upload_uri or not onnx):
        raise ConfigError("--onnx-only exports only model.onnx: it cannot be combined with --no-onnx or --upload "
                          "(an upload needs the whole export; run without --onnx-only)")
    with tempfile.TemporaryDirectory(prefix="memfit-export-") as tmp:
        loaded = resolve_checkpoint(uri, Path(tmp) / "checkpoint")
        cfg = config_from_checkpoint(loaded, uri, overrides)
        pin_threads(cfg.train.num_threads)
        if adapter or gguf_adapter:
            _check_adapter_export(cfg, loaded, "--adapter" if adapter else "--format gguf-adapter")
        if gguf_adapter:  # the QLoRA base, the base GGUF, the converter: before minutes of export work
            from memfit.release.gguf_adapter import check_gguf_adapter_export

            check_gguf_adapter_export(cfg.export, cfg.lora, cfg.export.gguf_converter)
        model, tokenizer = model_for_checkpoint(cfg, Path(tmp) / "work")
        quants = list(gguf_quants or cfg.export.gguf_quants)
        if gguf:  # before minutes of export work: the converter and its families, the quant types, the packages
            from memfit.release.gguf import check_gguf_export

            check_gguf_export({**model.config.to_dict(), "architectures": [type(model).__name__]}, quants,
                              cfg.export.gguf_converter)
        try:
            from memfit.models.lora import adapted_from_state, merge_lora

            quantize = trained_quantize(cfg.lora, loaded)
            model = adapted_from_state(model, cfg.lora, loaded.model_state, f"training checkpoint {loaded.info.uri}",
                                       quantize)
        except RuntimeError as err:
            raise CheckpointError(f"training checkpoint {loaded.info.uri} does not fit the model of its own "
                                  f"config.yaml ({str(err).splitlines()[0]})") from None
        if adapter:
            from memfit.release.adapter import ADAPTER_DIR, write_adapter

            adapter_dir = write_adapter(model, tokenizer, Path(out_dir) / ADAPTER_DIR, cfg.model.name_or_path,
                                        quantize)
        if gguf_adapter:  # llama.cpp's converter reads a peft folder: the adapter's, else one in the temp dir
            from memfit.release.adapter import write_adapter
            from memfit.release.gguf_adapter import PeftSource

            peft = PeftSource(str(adapter_dir if adapter else write_adapter(
                model, tokenizer, Path(tmp) / "peft", cfg.model.name_or_path, quantize)), cfg.model.name_or_path,
                quantize)
        model = merge_lora(model)
        metadata = {"source_checkpoint": loaded.info.uri, "step": loaded.step,
                    "mlflow_run_id": loaded.state.get("mlflow_run_id"),
                    "model_source": cfg.model.name_or_path or f"preset:{cfg.model.preset}"}
        files = export_model(model, tokenizer, out_dir, onnx=onnx, safetensors=not onnx_only,
                             criteria=parity_criteria(cfg.export), opset=cfg.export.opset, metadata=metadata,
                             dtype=cfg.export.dtype)
        gguf_report = None
        if gguf:
            from memfit.release.gguf_export import GGUF_DIR, export_gguf

            gguf_report = export_gguf(files.safetensors_dir, Path(out_dir) / GGUF_DIR, quants,
                                      prompts=cfg.eval.prompts, min_top1=cfg.export.gguf_min_top1.model_dump(),
                                      max_new_tokens=cfg.eval.max_new_tokens, name=cfg.run.name,
                                      converter=cfg.export.gguf_converter).to_dict()
            files.gguf_dir = gguf_report["dir"]
        gguf_adapter_report = None
        if gguf_adapter:
            from memfit.release.gguf_adapter import ADAPTER_GGUF_DIR, export_gguf_adapter

            gguf_adapter_report = export_gguf_adapter(
                peft, files.safetensors_dir, Path(out_dir) / ADAPTER_GGUF_DIR, quants, prompts=cfg.eval.prompts,
                min_top1=cfg.export.gguf_min_top1.model_dump(), max_new_tokens=cfg.eval.max_new_tokens,
                base_gguf=cfg.export.gguf_adapter_base, converter=cfg.export.gguf_converter)
            files.gguf_adapter_dir = gguf_adapter_report.dir
            gguf_adapter_report = {**gguf_adapter_report.to_dict(), "summary": gguf_adapter_report.summary()}
        verified = None
        if adapter:  # base + adapter through peft against the merged model, before anything is uploaded
            from memfit.release.adapter import verify_adapter

            verified = verify_adapter(adapter_dir, model, cfg.model.name_or_path, quantize,
                                      parity_criteria(cfg.export)).to_dict()
            files.adapter_dir = verified["dir"]
    if files.onnx_error:
        kept = f" The verified SafeTensors export is kept at {files.safetensors_dir}." if files.safetensors_dir else ""
        raise ExportError(f"{files.onnx_error}{kept} Redo only the ONNX with "
                          f"`{onnx_redo_command(uri, files.dir)}` (add --set export.onnx_<field>=… to change a "
                          "parity limit).")
    if upload_uri:
        files.uploaded_uri = upload_export(files, upload_uri, metadata)
    return {"checkpoint": loaded.info.uri, "step": loaded.step, "run_name": cfg.run.name, **files.to_dict(),
            "metadata": metadata, "adapter": verified, "gguf": gguf_report, "gguf_adapter": gguf_adapter_report}


def export_lines(report: dict[str, Any]) -> list[str]:
    """`memfit export`'s summary: one line per format written, with its verification figures."""
    lines = [f"exported step {report['step']} of {report['checkpoint']}"]
    if report["safetensors_dir"]:
        lines.append(f"SafeTensors: {report['safetensors_dir']} "
                     f"(reloaded, max |diff| {report['safetensors_max_abs_diff']:.2e})")
    if report["onnx_path"]:
        parity, c = report["onnx_parity"], report["onnx_criteria"]
        shapes = ", ".join(f"{p['batch']}x{p['seq']}" for p in parity)
        agree, positions = sum(p["top1_agree"] for p in parity), sum(p["positions"] for p in parity)
        lines.append(f"ONNX: {report['onnx_path']} (opset {report['onnx_opset']}); parity max |onnxruntime - "
                     f"PyTorch| = {report['onnx_max_abs_diff']:.3e} over shapes {shapes}, "
                     f"{max(p['relative'] for p in parity):.2g} of max |logit| (limit {c['rtol']:g}), "
                     f"max KL {max(p['max_kl'] for p in parity):.2g} (limit {c['max_kl']:g}), "
                     f"top-1 {agree}/{positions} (min {c['min_top1']:.0%}): within")
    if report["adapter"]:
        from memfit.release.adapter import base_statement

        a = report["adapter"]
        lines.append(f"adapter: {a['dir']} on the {base_statement(a['base_quantization'])} {a['base']}; "
                     f"peft-loaded vs merged max |diff| {a['max_abs_diff']:.2e}, top-1 {a['top1_agree']:.0%}")
    for f in (report["gguf"] or {}).get("files", []):
        lines.append(f"GGUF {f['quant']}: {f['file']} ({f['bytes'] / 2**20:.1f} MiB); llama.cpp vs transformers: "
                     f"greedy {f['greedy_equal']}/{f['prompts']} prompts equal, top-1 {f['top1_agree']:.1%}, max KL "
                     f"{f['max_kl']:.2g}")
    if report["gguf"]:
        lines.append(f"Modelfile: {report['gguf']['modelfile']}")
    if report.get("gguf_adapter"):
        g = report["gguf_adapter"]
        lines.append(f"GGUF adapter: {g['adapter']} on {', '.join(Path(f['file']).name for f in g['files'])}; "
                     f"llama.cpp vs the merged model: {g['summary']}")
        lines.append(f"Modelfile: {g['modelfile']}")
    if report["uploaded_uri"]:
        lines.append(f"uploaded: {report['uploaded_uri']} (manifest.json last)")
    return lines


def _check_adapter_export(cfg: Any, loaded: LoadedCheckpoint, flag: str = "--adapter") -> None:
    """--adapter (and --format gguf-adapter) needs a LoRA checkpoint and a base that outlives the export (not a
    preset rebuilt in a temp dir)."""
    from memfit.models.lora import is_lora_state

    if not is_lora_state(loaded.model_state):
        raise ConfigError(f"{flag}: training checkpoint {loaded.info.uri} holds all weights (a full fine-tune), "
                          f"not LoRA adapters; export without {flag}")
    if not cfg.model.name_or_path:
        raise ConfigError(f"{flag}: the checkpoint's base is preset {cfg.model.preset}, rebuilt in a temporary "
                          "folder, so the adapter would name a base that is gone; pass --set model.name_or_path="
                          "FOLDER of that base (the run's run.work_dir/presets/...) or use export.adapter in the run")
