"""export.uri without training: every format's files go up before manifest.json; download_export refuses a missing,
truncated or altered file in one line, fetches one format alone, and a failed upload leaves no manifest; a QLoRA
adapter's tag and summary line name its 4-bit base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests_support import record_puts

from memfit.errors import ExportError, StorageError
from memfit.release.from_checkpoint import ExportFiles
from memfit.release.uploads import EXPORT_MANIFEST, download_export, format_of, upload_export
from memfit.storage import LocalStore

pytestmark = pytest.mark.unit
META = {"mlflow_run_id": "abc123", "source_checkpoint": "runs/x/checkpoints/step-00000004", "step": 4}


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _export(root: Path, *, gguf: bool = True, quantization: str = "nf4") -> ExportFiles:
    """An export folder shaped as phase 5 writes one (small stand-in files): hf/, model.onnx, adapter/, gguf/."""
    _write(root / "hf" / "model.safetensors", b"w" * 3000)
    _write(root / "hf" / "config.json", "{}")
    _write(root / "hf" / "memfit-export.json", "{}")
    _write(root / "model.onnx", b"o" * 500)
    _write(root / "model.onnx.memfit.json", "{}")
    _write(root / "adapter" / "adapter_model.safetensors", b"a" * 700)
    _write(root / "adapter" / "adapter_config.json", '{"base_model_name_or_path": "/models/base"}')
    _write(root / "adapter" / "tokenizer.json", "{}")
    _write(root / "adapter" / "memfit-adapter.json", json.dumps(
        {"base_model": "/models/base", "base_sha256": "f" * 64, "base_quantization": quantization, "files": {}}))
    files = ExportFiles(dir=str(root), safetensors_dir=str(root / "hf"), safetensors_max_abs_diff=0.0,
                        onnx_path=str(root / "model.onnx"), onnx_max_abs_diff=1e-7, onnx_opset=18,
                        adapter_dir=str(root / "adapter"))
    if gguf:
        _write(root / "gguf" / "model-f16.gguf", b"g" * 900)
        _write(root / "gguf" / "Modelfile", "FROM ./model-f16.gguf\n")
        _write(root / "gguf" / "memfit-gguf.json", json.dumps({"verification": {"files": [{"quant": "f16"}]}}))
        files.gguf_dir = str(root / "gguf")
    return files


@pytest.fixture()
def put_order(monkeypatch):
    """The keys the local store is asked to write, in order."""
    return record_puts(monkeypatch, LocalStore)


def test_every_format_goes_up_and_the_manifest_last(tmp_path, put_order):
    files = _export(tmp_path / "export")
    uri = upload_export(files, str(tmp_path / "store" / "abc123"), META)
    assert uri == (tmp_path / "store" / "abc123").as_uri() and put_order[-1] == EXPORT_MANIFEST
    manifest = json.loads((tmp_path / "store" / "abc123" / EXPORT_MANIFEST).read_text())
    assert set(put_order[:-1]) == set(manifest["files"])
    formats = {k: rec["format"] for k, rec in manifest["files"].items()}
    assert formats == {"hf/config.json": "safetensors", "hf/model.safetensors": "safetensors",
                       "hf/memfit-export.json": "safetensors",
                       "model.onnx": "onnx", "model.onnx.memfit.json": "onnx",
                       "adapter/adapter_config.json": "adapter", "adapter/adapter_model.safetensors": "adapter",
                       "adapter/tokenizer.json": "adapter", "adapter/memfit-adapter.json": "adapter",
                       "gguf/model-f16.gguf": "gguf", "gguf/Modelfile": "gguf", "gguf/memfit-gguf.json": "gguf"}
    assert all(formats[k] == format_of(k) for k in formats)
    rec = manifest["files"]["adapter/adapter_model.safetensors"]
    assert rec["bytes"] == 700 and len(rec["sha256"]) == 64
    assert manifest["source_run"] == "abc123" and manifest["source_checkpoint"] == META["source_checkpoint"]
    # A QLoRA adapter's entry states the 4-bit base it must be loaded on.
    adapter = manifest["formats"]["adapter"]
    assert adapter["base_quantization"] == "nf4" and adapter["base"] == "4-bit NF4 base (bitsandbytes)"
    assert adapter["base_model"] == "/models/base" and manifest["formats"]["gguf"]["quants"] == ["f16"]
    # Each folder's own record last within it, as it was written locally.
    assert put_order[:3] == ["hf/config.json", "hf/model.safetensors", "hf/memfit-export.json"]
    assert put_order.index("adapter/memfit-adapter.json") > put_order.index("adapter/adapter_model.safetensors")


def test_download_verifies_every_file_and_fetches_one_format_alone(tmp_path):
    files = _export(tmp_path / "export", gguf=False, quantization="none")
    upload_export(files, str(tmp_path / "store"), META)
    every = download_export(str(tmp_path / "store"), tmp_path / "all")
    for key in json.loads((tmp_path / "store" / EXPORT_MANIFEST).read_text())["files"]:
        assert (every / key).read_bytes() == (tmp_path / "export" / key).read_bytes()
    only = download_export(str(tmp_path / "store"), tmp_path / "only", formats=["adapter"])
    assert sorted(p.relative_to(only).as_posix() for p in only.rglob("*") if p.is_file()) == [
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/memfit-adapter.json",
        "adapter/tokenizer.json"]
    with pytest.raises(ExportError, match=r"holds no gguf export \(it holds safetensors, onnx, adapter\)"):
        download_export(str(tmp_path / "store"), tmp_path / "x", formats=["gguf"])
    with pytest.raises(ExportError, match="unknown export format"):
        download_export(str(tmp_path / "store"), tmp_path / "x", formats=["pickle"])
    with pytest.raises(ExportError, match="exists and is not empty"):
        download_export(str(tmp_path / "store"), every)
    with pytest.raises(ExportError, match="holds no complete export"):
        download_export(str(tmp_path / "nothing"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage", ["truncated", "altered", "missing"])
def test_a_damaged_file_is_refused_in_one_line_naming_it(tmp_path, damage):
    upload_export(_export(tmp_path / "export"), str(tmp_path / "store"), META)
    target = tmp_path / "store" / "adapter" / "adapter_model.safetensors"
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[:-10])
    elif damage == "altered":
        target.write_bytes(data[:100] + b"X" + data[101:])
    else:
        target.unlink()
    want = {"truncated": "690 bytes, the export manifest says 700", "altered": "sha256 does not match",
            "missing": "cannot download"}[damage]
    with pytest.raises(ExportError, match=want) as err:
        download_export(str(tmp_path / "store"), tmp_path / "dl")
    assert "adapter/adapter_model.safetensors" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "dl").exists()  # nothing half-downloaded is left to be mistaken for the export
    # The formats not damaged still come down alone.
    assert (download_export(str(tmp_path / "store"), tmp_path / "hf", formats=["safetensors"]) / "hf").is_dir()


def test_a_failed_upload_leaves_no_manifest_even_over_an_earlier_one(tmp_path, monkeypatch):
    files = _export(tmp_path / "export")
    store = tmp_path / "store"
    upload_export(files, str(store), META)
    assert (store / EXPORT_MANIFEST).is_file()
    original = LocalStore.put_file

    def failing(self, path, key, **kw):
        if key == "gguf/model-f16.gguf":
            raise StorageError(f"cannot upload {key!r}: no space left on device")
        return original(self, path, key, **kw)

    monkeypatch.setattr(LocalStore, "put_file", failing)
    with pytest.raises(ExportError, match=r"failed at gguf/model-f16\.gguf .*no manifest\.json was written") as err:
        upload_export(files, str(store), META)
    assert "\n" not in str(err.value) and not (store / EXPORT_MANIFEST).exists()
    with pytest.raises(ExportError, match="holds no complete export"):
        download_export(str(store), tmp_path / "dl")


def test_a_manifest_naming_a_path_outside_the_folder_is_refused(tmp_path):
    upload_export(_export(tmp_path / "export", gguf=False), str(tmp_path / "store"), META)
    path = tmp_path / "store" / EXPORT_MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"]["../escaped"] = manifest["files"].pop("hf/config.json")
    path.write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"\.\./escaped: cannot download"):
        download_export(str(tmp_path / "store"), tmp_path / "dl" / "inner")
    assert not (tmp_path / "dl" / "escaped").exists()


def test_manifests_written_before_per_file_formats_still_select_by_key(tmp_path):
    upload_export(_export(tmp_path / "export", gguf=False), str(tmp_path / "store"), META)
    path = tmp_path / "store" / EXPORT_MANIFEST
    manifest = json.loads(path.read_text())
    for rec in manifest["files"].values():
        del rec["format"]
    path.write_text(json.dumps(manifest))
    got = download_export(str(tmp_path / "store"), tmp_path / "dl", formats=["onnx"])
    assert sorted(p.name for p in got.iterdir()) == ["model.onnx", "model.onnx.memfit.json"]


@pytest.mark.parametrize(("quantization", "base"), [("nf4", "4-bit NF4 base (bitsandbytes)"),
                                                     ("none", "unquantized base")])
def test_the_adapter_tag_and_summary_line_name_the_base_it_needs(quantization, base):
    from memfit.release.adapter import AdapterExport
    from memfit.release.from_checkpoint import export_lines
    from memfit.release.publish import format_tags

    adapter = AdapterExport(dir="/x/adapter", base="/models/base", base_sha256=None, base_quantization=quantization,
                            max_abs_diff=2e-7, max_kl=1e-12, top1_agree=1.0)
    files = ExportFiles(dir="/x", safetensors_dir="/x/hf", safetensors_max_abs_diff=0.0)
    assert format_tags(files, adapter, None)["memfit.format.adapter"] == (
        f"peft on its {base} vs merged: max |diff| 2.00e-07, top-1 100.0%")
    report = {"step": 4, "checkpoint": "ckpt/step-00000004", **files.to_dict(), "adapter": adapter.to_dict(),
              "gguf": None}
    assert f"adapter: /x/adapter on the {base} /models/base; peft-loaded" in export_lines(report)[2]
