"""What MODEL names (a registry version, a training checkpoint, an export folder), as a verified local folder."""

# MODEL: `models:/NAME@ALIAS`, `models:/NAME/N`, a training checkpoint or an export folder; each resolved to a local,
# checksum-verified SafeTensors folder (and the ONNX file beside it, if any).

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import ModelLoadError

log = logging.getLogger("memfit.server")
MODELS_URI = re.compile(r"^models:/(?P<name>[^@/]+)(?:@(?P<alias>[A-Za-z_][A-Za-z0-9_-]*)|/(?P<version>\d+))$")
ONNX_NAME = "model.onnx"


@dataclass(frozen=True)
class ModelFiles:
    """A model on local disk, ready to load; `model_id` is what responses carry in their `model` field."""

    hf_dir: Path
    onnx_path: Path | None
    name: str  # what clients ask for
    model_id: str  # the name and its version: NAME/vN for a registry version
    version: str | None = None
    gguf_dir: Path | None = None  # the export's gguf/ folder (memfit-gguf.json in it), when it has one


def verify_export(hf_dir: Path, onnx_path: Path | None = None) -> None:
    """Every file the export records (memfit-export.json, and the ONNX file's .memfit.json) matches its sha256."""
    from memfit.files import sha256_file
    from memfit.release.formats import MANIFEST_NAME, ONNX_METADATA_SUFFIX

    records = [(hf_dir, hf_dir / MANIFEST_NAME)]
    if onnx_path is not None:
        records.append((onnx_path.parent, onnx_path.with_name(onnx_path.name + ONNX_METADATA_SUFFIX)))
    for folder, record in records:
        try:
            files = json.loads(record.read_text())["files"]
        except (OSError, ValueError, KeyError) as err:
            raise ModelLoadError(f"{record}: no readable export record ({err}); serve a folder written by memfit "
                                 "export (it holds the checksums the server checks)") from None
        for rel, meta in files.items():
            path = folder / rel
            if not path.is_file() or sha256_file(path) != meta["sha256"]:
                raise ModelLoadError(f"{path} does not match the sha256 in its export record {record.name}: "
                                     "the export is incomplete or altered")


def export_folder(path: Path) -> ModelFiles:
    """An export folder (OUT with OUT/hf and OUT/model.onnx) or the SafeTensors folder itself."""
    from memfit.release.formats import MANIFEST_NAME

    hf = path / "hf" if (path / "hf" / MANIFEST_NAME).is_file() else path
    if not (hf / MANIFEST_NAME).is_file():
        raise ModelLoadError(f"{path}: not an export folder (no {MANIFEST_NAME} in it or in {path / 'hf'}); "
                             "give models:/NAME@ALIAS, a training checkpoint or the --out folder of memfit export")
    onnx = hf.parent / ONNX_NAME
    return ModelFiles(hf_dir=hf, onnx_path=onnx if onnx.is_file() else None, name=hf.parent.name if hf != path
                      else path.name, model_id=str(path), gguf_dir=gguf_folder(hf.parent / "gguf"))


def gguf_folder(path: Path) -> Path | None:
    from memfit.release.gguf_export import MANIFEST_NAME

    return path if (path / MANIFEST_NAME).is_file() else None


def is_checkpoint(uri: str) -> bool:
    """A training checkpoint: s3://, a step-NNNNNNNN folder, or a root holding such folders."""
    if uri.startswith("s3://"):
        return True
    p = Path(uri)
    return (p / "manifest.json").is_file() or (p.is_dir() and any(p.glob("step-*")))


def export_checkpoint_once(uri: str, cache_dir: Path, onnx: bool) -> ModelFiles:
    """A training checkpoint exported (verified) into the cache once; later starts reuse that export."""
    from memfit.release.from_checkpoint import export_checkpoint

    out = cache_dir / "checkpoints" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if not (out / "hf").is_dir() or (onnx and not (out / ONNX_NAME).is_file()):
        log.info("exporting training checkpoint %s to %s before serving it", uri, out)
        export_checkpoint(uri, out, onnx=onnx)
    files = export_folder(out)
    return ModelFiles(files.hf_dir, files.onnx_path, name=Path(uri.rstrip("/")).name, model_id=uri)


class RegistrySource:
    """`models:/NAME@ALIAS` (followed) or `models:/NAME/N` (fixed) in one MLflow tracking store."""

    def __init__(self, uri: str, tracking_uri: str, cache_dir: Path):
        m = MODELS_URI.match(uri)
        if not m:
            raise ModelLoadError(f"{uri}: not a registry URI; write models:/NAME@ALIAS or models:/NAME/VERSION")
        from mlflow import MlflowClient

        self.uri, self.name, self.alias, self.fixed = uri, m["name"], m["alias"], m["version"]
        self.tracking_uri, self.cache_dir = tracking_uri, cache_dir
        # Bound to this store: `models:/` otherwise resolves through the process-wide registry URI.
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    @property
    def follows(self) -> bool:
        return self.alias is not None

    def current_version(self) -> str:
        """The version the alias points at now (the fixed one for models:/NAME/N); ModelLoadError if none."""
        from mlflow.exceptions import MlflowException

        try:
            if self.alias is None:
                return str(self.client.get_model_version(self.name, self.fixed).version)
            return str(self.client.get_model_version_by_alias(self.name, self.alias).version)
        except MlflowException as err:
            what = f"alias {self.alias!r}" if self.alias else f"version {self.fixed}"
            raise ModelLoadError(f"{self.uri}: no registered model {self.name!r} with {what} in {self.tracking_uri} "
                                 f"({str(err).splitlines()[0][:200]}); check the name, the alias and "
                                 "tracking.uri") from None
        except Exception as err:  # noqa: BLE001 - transport errors (connection refused, DNS)
            raise ModelLoadError(f"{self.uri}: the registry at {self.tracking_uri} cannot be read "
                                 f"({type(err).__name__}: {str(err)[:200]})") from None

    def fetch(self, version: str) -> ModelFiles:
        """Version `version` downloaded to the cache (once) and verified against its export record."""
        from mlflow.artifacts import download_artifacts

        dest = self.cache_dir / "registry" / self.name / f"v{version}"
        if not (dest / "model" / "artifacts" / "hf").is_dir():
            tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
            try:
                mv = self.client.get_model_version(self.name, version)
                source = self.client.get_model_version_download_uri(self.name, version)
                local = Path(download_artifacts(artifact_uri=source, dst_path=str(tmp / "dl"),
                                                tracking_uri=self.tracking_uri))
                local.rename(tmp / "model")
                shutil.rmtree(tmp / "dl", ignore_errors=True)
                self._fetch_onnx(mv.run_id, tmp / "onnx")
                self._fetch_artifacts(mv.run_id, "export/gguf", tmp / "gguf")
                if dest.exists():
                    shutil.rmtree(dest)
                tmp.rename(dest)  # complete downloads only: a later start reuses this folder
            except ModelLoadError:
                raise
            except Exception as err:  # noqa: BLE001 - MlflowException and transport errors alike
                raise ModelLoadError(f"models:/{self.name}/{version}: download failed ({str(err)[:300]})") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        onnx = dest / "onnx" / ONNX_NAME
        hf = dest / "model" / "artifacts" / "hf"
        files = ModelFiles(hf, onnx if onnx.is_file() else None, name=self.name, model_id=f"{self.name}/v{version}",
                           version=version, gguf_dir=gguf_folder(dest / "gguf"))
        verify_export(files.hf_dir, files.onnx_path)
        return files

    def _fetch_onnx(self, run_id: str | None, dest: Path) -> None:
        # The registered model holds the SafeTensors folder; the ONNX file is an artifact of the same run.
        from mlflow.artifacts import download_artifacts

        if not run_id:
            return
        try:
            got = Path(download_artifacts(run_id=run_id, artifact_path="export/onnx", dst_path=str(dest.parent / "r"),
                                          tracking_uri=self.tracking_uri))
            if (got / ONNX_NAME).is_file():
                got.rename(dest)
        except Exception:  # noqa: BLE001 - a run exported without ONNX: the transformers backend serves it
            return
        finally:
            shutil.rmtree(dest.parent / "r", ignore_errors=True)

    def _fetch_artifacts(self, run_id: str | None, path: str, dest: Path) -> None:
        """A folder of the version's run (e.g. export/gguf), when it has one."""
        from mlflow.artifacts import download_artifacts

        if not run_id:
            return
        try:
            Path(download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(dest.parent / "a"),
                                    tracking_uri=self.tracking_uri)).rename(dest)
        except Exception:  # noqa: BLE001 - a run exported without it: the other backends serve it
            return
        finally:
            shutil.rmtree(dest.parent / "a", ignore_errors=True)


def resolve(model: str, tracking_uri: str, cache_dir: Path,
            want_onnx: bool) -> tuple[ModelFiles, RegistrySource | None]:
    """MODEL → its files now, and the registry source to follow (None for a folder or a checkpoint)."""
    if model.startswith("models:/"):
        source = RegistrySource(model, tracking_uri, cache_dir)
        return source.fetch(source.current_version()), source
    if is_checkpoint(model):
        return export_checkpoint_once(model, cache_dir, onnx=want_onnx), None
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"{model}: no such folder, and not models:/NAME@ALIAS or s3://; give a registry URI, "
                             "a training checkpoint or an export folder")
    files = export_folder(path)
    verify_export(files.hf_dir, files.onnx_path)
    return files, None
