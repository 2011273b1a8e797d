"""`memfit export`: any training checkpoint (local or S3) → verified exports; bad checkpoints fail clearly."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests_support import cli_in_process

from memfit.errors import CheckpointError, ExportError

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short tiny run without tracking: its training checkpoints are what `memfit export` reads."""
    from tests_support import tiny_overrides

    from memfit import config, phases

    root = tmp_path_factory.mktemp("trained")
    from memfit.reports import PlanReport

    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, None, **{
        "tracking.backend": "null", "train.max_steps": 4, "checkpoint.every_steps": 2, "data.synthetic_docs": 300}))
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="no recompute")
    phases.train(cfg, plan, phases.recover_training_checkpoint(cfg))
    return root / "checkpoints"


def _copy(ckpts: Path, dest: Path) -> Path:
    shutil.copytree(ckpts, dest)
    return dest


def test_cli_exports_a_training_checkpoint(trained, tmp_path):
    """Must show: the folder loads with from_pretrained and the printed ONNX parity is within the threshold."""
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "export", str(trained), "--out", str(out), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("ONNX: "))
    printed = float(re.search(r"parity max \|onnxruntime - PyTorch\| = ([0-9.e+-]+)", line).group(1))
    assert printed == pytest.approx(report["onnx_max_abs_diff"], rel=1e-3) and printed <= 1e-4
    assert "(limit 0.0005)" in line and line.endswith(": within") and len(report["onnx_parity"]) >= 3
    assert report["step"] == 4 and report["checkpoint"].endswith("step-00000004")

    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert model.config.use_cache is True
    assert json.loads((out / "hf" / "config.json").read_text())["use_cache"] is True
    # The exported weights are the checkpoint's, not the preset's random init.
    from safetensors.torch import load_file

    ckpt = load_file(str(trained / "step-00000004" / "model.safetensors"))
    name = "model.embed_tokens.weight"
    assert torch.equal(model.state_dict()[name], ckpt[name])
    ids = torch.tensor([tok.encode("one two three four")])
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    got = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input_ids": ids.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-4
    meta = json.loads((out / "model.onnx.memfit.json").read_text())
    from memfit import __version__
    from memfit.files import sha256_file

    assert meta["memfit_version"] == __version__ and meta["metadata"]["source_checkpoint"] == report["checkpoint"]
    assert meta["files"]["model.onnx"]["sha256"] == sha256_file(out / "model.onnx")
    assert meta["opset"] == report["onnx_opset"] and len(meta["parity"]) >= 3


def test_missing_checkpoint_is_a_clear_cli_error(tmp_path):
    res = cli_in_process("export", tmp_path / "no-such" / "step-00000002", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert "no-such" in res.stderr and "not found" in res.stderr
    assert not (tmp_path / "out").exists()


def test_corrupt_and_incomplete_checkpoints(trained, tmp_path):
    from memfit.release.from_checkpoint import export_checkpoint

    root = _copy(trained, tmp_path / "ckpts")
    newest = root / "step-00000004"
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (newest / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-00000004/model\.safetensors: sha256 does not match"):
        export_checkpoint(str(newest), tmp_path / "a", onnx=False)
    # The root falls back to the newest checkpoint that verifies, as resume does.
    report = export_checkpoint(str(root), tmp_path / "b", onnx=False)
    assert report["step"] == 2 and (tmp_path / "b" / "hf" / "model.safetensors").is_file()
    (root / "step-00000002" / "manifest.json").unlink()  # now step 2 is incomplete, step 4 corrupt
    with pytest.raises(CheckpointError, match="verifies"):
        export_checkpoint(str(root), tmp_path / "c", onnx=False)
    with pytest.raises(CheckpointError, match=r"step-00000002 not found or incomplete"):
        export_checkpoint(str(root / "step-00000002"), tmp_path / "d", onnx=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no complete training checkpoint"):
        export_checkpoint(str(empty), tmp_path / "e", onnx=False)
    assert not any((tmp_path / x).exists() for x in "acde")


def test_onnx_parity_failure_reports_the_difference_and_keeps_safetensors(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from memfit.release.from_checkpoint import export_checkpoint

    with pytest.raises(ExportError) as err:
        export_checkpoint(str(trained), tmp_path / "out", overrides=["export.onnx_rtol=0", "export.onnx_atol=1e-12"])
    msg = str(err.value)
    measured = float(re.search(r"max \|onnxruntime - PyTorch\| = ([0-9.e+-]+)", msg).group(1))
    assert measured > 1e-12 and "exceeds export.onnx_rtol = 0 (+ onnx_atol 1e-12" in msg
    assert f"SafeTensors export is kept at {tmp_path / 'out' / 'hf'}" in msg
    assert f"`memfit export {trained} --out {tmp_path / 'out'} --onnx-only`" in msg
    assert not (tmp_path / "out" / "model.onnx").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf").config.use_cache is True


def test_export_flow_from_s3_checkpoint_and_upload_to_s3(prefect_harness, trained, s3_bucket, s3_client, tmp_path):
    """The Prefect export flow (what a deployment runs) on a checkpoint in S3, uploading the export to S3."""
    from transformers import AutoModelForCausalLM

    from flows.export import export
    from memfit.release.from_checkpoint import download_export, export_checkpoint
    from memfit.storage import open_store

    _, bucket = s3_bucket
    store = open_store(f"s3://{bucket}/runs/tiny/checkpoints")
    for step in ("step-00000002", "step-00000004"):
        folder = trained / step
        for f in sorted(folder.iterdir(), key=lambda p: p.name == "manifest.json"):  # manifest last
            store.put_file(f, f"{step}/{f.name}")
    report = export(checkpoint_uri=f"s3://{bucket}/runs/tiny/checkpoints", out_dir=str(tmp_path / "out"), onnx=False,
                    upload_uri=f"s3://{bucket}/exports/tiny")
    assert report["checkpoint"] == f"s3://{bucket}/runs/tiny/checkpoints/step-00000004"
    assert report["uploaded_uri"] == f"s3://{bucket}/exports/tiny"
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="exports/tiny/")["Contents"]]
    assert "exports/tiny/manifest.json" in keys and "exports/tiny/hf/model.safetensors" in keys
    local = download_export(f"s3://{bucket}/exports/tiny", tmp_path / "downloaded")
    assert AutoModelForCausalLM.from_pretrained(local / "hf").config.use_cache is True
    # A missing step on S3 is named with its URI.
    with pytest.raises(CheckpointError, match=f"s3://{bucket}/runs/tiny/checkpoints/step-00000099"):
        export_checkpoint(f"s3://{bucket}/runs/tiny/checkpoints/step-00000099", tmp_path / "x", onnx=False)
