"""A verified export to export.uri and back: every format's files first, manifest.json (format, size, sha256) last."""

from __future__ import annotations

import datetime as _dt
import json
import logging
from pathlib import Path
from typing import Any

import memfit
from memfit.errors import ExportError, StorageError
from memfit.files import commit_folder, file_record, sha256_file, staged_folder

log = logging.getLogger("memfit.exporting")

EXPORT_MANIFEST = "manifest.json"  # written last: a prefix without it holds no complete export
EXPORT_FORMAT = "memfit-export/1"
FORMATS = ("safetensors", "onnx", "adapter", "gguf", "gguf-adapter")
# Where each format's files sit, in the export folder and under the upload's prefix.
FOLDERS = {"hf": "safetensors", "adapter": "adapter", "gguf": "gguf", "gguf-adapter": "gguf-adapter"}
FORMAT_MANIFESTS = {"safetensors": "memfit-export.json", "adapter": "memfit-adapter.json", "gguf": "memfit-gguf.json",
                    "gguf-adapter": "memfit-gguf-adapter.json"}


def format_of(key: str) -> str:
    """The export format a stored file belongs to, from its key (manifests before 2026-12-04 do not say)."""
    top = key.split("/", 1)[0]
    if top in FOLDERS and "/" in key:
        return FOLDERS[top]
    return "onnx" if top.startswith("model.onnx") else "other"


def export_parts(files: Any) -> dict[str, tuple[str, Path]]:
    """Store key → (format, local file) for every verified file of an ExportFiles, format by format."""
    parts = _folder_parts("hf", files.safetensors_dir)
    if files.onnx_path:
        onnx = Path(files.onnx_path)
        for p in (onnx, onnx.with_name(onnx.name + ".data"), onnx.with_name(onnx.name + ".memfit.json")):
            if p.is_file():
                parts[p.relative_to(files.dir).as_posix()] = ("onnx", p)
    return {**parts, **_folder_parts("adapter", files.adapter_dir), **_folder_parts("gguf", files.gguf_dir),
            **_folder_parts("gguf-adapter", files.gguf_adapter_dir)}


def _folder_parts(prefix: str, folder: str | None) -> dict[str, tuple[str, Path]]:
    if not folder:
        return {}
    found = sorted((p for p in Path(folder).rglob("*") if p.is_file()),
                   key=lambda p: (p.name == FORMAT_MANIFESTS.get(FOLDERS[prefix]), p.as_posix()))
    return {f"{prefix}/{p.relative_to(folder).as_posix()}": (FOLDERS[prefix], p) for p in found}


def format_summary(files: Any) -> dict[str, dict[str, Any]]:
    """Per format in the upload: where it sits and what a user must know to use it (the adapter's base and its
    quantization: a QLoRA adapter only matches its base loaded in 4-bit NF4)."""
    out: dict[str, dict[str, Any]] = {}
    if files.safetensors_dir:
        out["safetensors"] = {"dir": "hf", "reloaded_max_abs_diff": files.safetensors_max_abs_diff}
    if files.onnx_path:
        out["onnx"] = {"file": Path(files.onnx_path).name, "opset": files.onnx_opset,
                       "max_abs_diff": files.onnx_max_abs_diff}
    if files.adapter_dir:
        from memfit.release.adapter import base_statement

        doc = json.loads((Path(files.adapter_dir) / FORMAT_MANIFESTS["adapter"]).read_text())
        out["adapter"] = {"dir": "adapter", "base_model": doc["base_model"], "base_sha256": doc["base_sha256"],
                          "base_quantization": doc["base_quantization"],
                          "base": base_statement(doc["base_quantization"])}
    if files.gguf_dir:
        doc = json.loads((Path(files.gguf_dir) / FORMAT_MANIFESTS["gguf"]).read_text())
        out["gguf"] = {"dir": "gguf", "quants": [f["quant"] for f in doc["verification"]["files"]]}
    if files.gguf_adapter_dir:  # the base GGUF a user brought stays theirs: named, not uploaded
        doc = json.loads((Path(files.gguf_adapter_dir) / FORMAT_MANIFESTS["gguf-adapter"]).read_text())
        out["gguf-adapter"] = {"dir": "gguf-adapter", "base_model": doc["base_model"], "base_gguf": doc["base_gguf"],
                               "base_quants": [f["quant"] for f in doc["verification"]["files"]]}
    return out


def upload_export(files: Any, uri: str, metadata: dict[str, Any] | None = None) -> str:
    """Upload every verified format of an ExportFiles to `uri` (a folder or s3://…), then manifest.json, which
    commits it: a failed upload leaves no manifest, so nothing reads a half-written export as complete."""
    from memfit.storage import open_store

    store = open_store(uri)
    # An interrupted re-upload must not look complete: the old manifest goes first.
    store.delete(EXPORT_MANIFEST)
    records = {}
    for key, (fmt, path) in export_parts(files).items():
        records[key] = {"format": fmt, **file_record(path)}  # hashed before it leaves: what the reader must get
        try:
            store.put_file(path, key)
        except StorageError as err:
            raise ExportError(f"uploading the export to {store.uri} failed at {key} ({err}); no {EXPORT_MANIFEST} "
                              "was written, so nothing takes that prefix for a complete export: upload again") from None
    meta = metadata or {}
    manifest = {"format": EXPORT_FORMAT, "memfit_version": memfit.__version__,
                "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "source_run": meta.get("mlflow_run_id"), "source_checkpoint": meta.get("source_checkpoint"),
                "onnx_max_abs_diff": files.onnx_max_abs_diff, "metadata": meta,
                "formats": format_summary(files), "files": records}
    store.put_bytes(EXPORT_MANIFEST, json.dumps(manifest, indent=2, default=str).encode())
    log.info("export uploaded to %s (%s: %d files, manifest last)", store.uri, ", ".join(manifest["formats"]),
             len(records))
    return store.uri


def read_manifest(uri: str, store: Any = None) -> dict[str, Any]:
    """An uploaded export's manifest.json; ExportError when there is none (no complete export) or it is foreign."""
    from memfit.storage import KeyNotFound, open_store

    try:
        manifest = json.loads((store or open_store(uri)).get_bytes(EXPORT_MANIFEST))
    except KeyNotFound:
        raise ExportError(f"{uri} holds no complete export (no {EXPORT_MANIFEST})") from None
    except json.JSONDecodeError as err:
        raise ExportError(f"{uri}/{EXPORT_MANIFEST} is not valid JSON ({err})") from None
    if manifest.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{uri}/{EXPORT_MANIFEST}: unknown format {manifest.get('format')!r}")
    return manifest


def download_export(uri: str, dest: str | Path, formats: list[str] | None = None) -> Path:
    """Download an uploaded export, or only `formats` of it, into `dest` (a new or empty folder), checking every
    file's size and sha256 against the manifest; the folder appears only when all of them pass.

    A missing, truncated or altered file is an ExportError of one line naming it.
    """
    from memfit.storage import open_store
    from memfit.storage.base import check_key

    uri = uri.rstrip("/")
    store, dest = open_store(uri), Path(dest).absolute()
    manifest = read_manifest(uri, store)
    wanted = _select(uri, manifest["files"], formats)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"{dest} exists and is not empty: download an export into a new or empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(dest) as staged:
        for key, rec in wanted.items():
            try:
                check_key(key)  # a tampered manifest must not write outside dest
                store.get_file(key, staged / key)
            except StorageError as err:
                raise ExportError(f"{uri}/{key}: cannot download ({str(err).splitlines()[0]})") from None
            size = (staged / key).stat().st_size
            if size != int(rec["bytes"]):
                raise ExportError(f"{uri}/{key}: {size} bytes, the export manifest says {rec['bytes']} (truncated "
                                  "or replaced after the upload); refusing the export")
            if sha256_file(staged / key) != rec["sha256"]:
                raise ExportError(f"{uri}/{key}: sha256 does not match the export manifest (altered after the "
                                  "upload); refusing the export")
        commit_folder(staged, dest)
    log.info("export %s downloaded to %s (%d files verified)", uri, dest, len(wanted))
    return dest


def _select(uri: str, files: dict[str, dict[str, Any]], formats: list[str] | None) -> dict[str, dict[str, Any]]:
    held = {k: rec.get("format") or format_of(k) for k, rec in files.items()}
    if formats is None:
        return dict(files)
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ExportError(f"unknown export format(s) {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    present = [f for f in FORMATS if f in held.values()]
    missing = [f for f in formats if f not in present]
    if missing:
        raise ExportError(f"{uri} holds no {', '.join(missing)} export (it holds {', '.join(present) or 'nothing'})")
    return {k: rec for k, rec in files.items() if held[k] in formats}
