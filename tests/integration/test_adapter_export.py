"""A LoRA run's adapter alone: a peft folder that peft loads onto its base and that then equals the merged export;
checksums, tokenizer and chat template inside; a tampered adapter fails the check in one line; export.uri on S3 holds
it under the run id, manifest last, and download_export brings it back verified (a corrupted object is refused)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tests_support import record_puts

from memfit import phases

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LORA = {"lora.enabled": "true", "lora.r": 8, "train.max_steps": 10, "train.lr": 3e-3, "export.adapter": True,
        "memory.policy": "full"}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _record_s3_writes(monkeypatch) -> list[str]:
    """The keys the S3 store is asked to write, in order (the upload runs in this process)."""
    from memfit.storage.s3 import S3Store

    return record_puts(monkeypatch, S3Store)


def test_the_adapter_loads_onto_its_base_with_peft_and_equals_the_merged_export(tiny_config, tmp_path, s3_bucket,
                                                                               s3_client, monkeypatch):
    from mlflow import MlflowClient
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.errors import ExportError
    from memfit.files import sha256_file
    from memfit.release.adapter import base_digest, verify_adapter
    from memfit.release.parity import ParityCriteria

    _, bucket = s3_bucket
    cfg = tiny_config(**LORA, **{"export.uri": f"s3://{bucket}/exports"})
    written = _record_s3_writes(monkeypatch)
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    assert plan.lora is True
    exported = phases.evaluate_and_release(cfg, phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe))
    folder = Path(exported.adapter["dir"])
    assert folder == Path(cfg.export.dir).absolute() / "adapter"

    manifest = json.loads((folder / "memfit-adapter.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert all(sha256_file(folder / n) == rec["sha256"] for n, rec in manifest["files"].items())
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == manifest["base_model"] and Path(base).is_dir()  # the preset's folder the run loaded
    assert manifest["base_sha256"] == base_digest(base) and manifest["base_quantization"] == "none"

    # The oracle: peft's own loading, as vLLM / TGI users do it, against the merged SafeTensors export.
    tok = AutoTokenizer.from_pretrained(folder)
    hf_tok = AutoTokenizer.from_pretrained(exported.safetensors_dir)
    assert tok.chat_template and tok.chat_template == hf_tok.chat_template
    ids = tok("one two three four five six", return_tensors="pt")["input_ids"]
    plain = AutoModelForCausalLM.from_pretrained(base)
    base_logits = _logits(plain, ids)
    adapted = PeftModel.from_pretrained(plain, str(folder)).eval()
    merged = AutoModelForCausalLM.from_pretrained(exported.safetensors_dir).eval()
    want, got = _logits(merged, ids), _logits(adapted, ids)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 + 5e-4 * scale
    assert float((base_logits - want).abs().max()) > 100 * float((got - want).abs().max())  # the adapter matters

    client = MlflowClient(cfg.tracking.resolved_uri())
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.data.metrics["adapter_max_abs_diff"] == exported.adapter["max_abs_diff"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "export/adapter")}
    assert "export/adapter/adapter_model.safetensors" in logged

    # export.uri: the adapter folder beside hf/ under the run id, every file before manifest.json.
    from memfit.release.uploads import download_export, read_manifest

    assert exported.export_uri == f"s3://{bucket}/exports/{run.info.run_id}"
    uploaded = read_manifest(exported.export_uri)
    adapter_keys = {f"adapter/{n}" for n in manifest["files"]} | {"adapter/memfit-adapter.json"}
    assert adapter_keys <= set(uploaded["files"]) and "hf/model.safetensors" in uploaded["files"]
    assert all(uploaded["files"][k]["format"] == "adapter" for k in adapter_keys)
    assert uploaded["source_run"] == run.info.run_id and uploaded["formats"]["adapter"]["base_model"] == base
    assert written[-1] == "manifest.json" and set(written[:-1]) == set(uploaded["files"])
    stored = {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="exports/")["Contents"]}
    assert {f"exports/{run.info.run_id}/{k}" for k in uploaded["files"]} <= stored
    # Downloaded alone, verified, and loaded by peft onto a fresh base: the merged export's logits again.
    fetched = download_export(exported.export_uri, tmp_path / "fetched", formats=["adapter"])
    assert sorted(p.name for p in fetched.iterdir()) == ["adapter"]
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(fetched / "adapter")).eval()
    assert float((_logits(again, ids) - want).abs().max()) <= 1e-4 + 5e-4 * scale
    assert verify_adapter(fetched / "adapter", merged, base, "none", ParityCriteria()).top1_agree == 1.0
    # An object changed in the bucket after the upload is refused, in one line naming it.
    key = f"exports/{run.info.run_id}/adapter/adapter_model.safetensors"
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(ExportError, match=r"adapter/adapter_model\.safetensors: sha256 does not match") as err:
        download_export(exported.export_uri, tmp_path / "corrupt")
    assert "\n" not in str(err.value) and not (tmp_path / "corrupt").exists()

    # An adapter that drifted from what was merged (here: scaled) is caught, in one line.
    tampered = tmp_path / "tampered"
    shutil.copytree(folder, tampered)
    weights = load_file(str(tampered / "adapter_model.safetensors"))
    scaled = {k: v * 1.5 if "lora_B" in k else v for k, v in weights.items()}
    save_file(scaled, str(tampered / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match="the adapter on its base") as err:
        verify_adapter(tampered, merged, base, "none", ParityCriteria())
    assert "\n" not in str(err.value)

    # The same adapter from the training checkpoint alone (`memfit export CKPT --adapter`), its base named.
    from memfit.errors import ConfigError
    from memfit.release.from_checkpoint import export_checkpoint

    with pytest.raises(ConfigError, match="--adapter: the checkpoint's base is preset tiny-llama"):
        export_checkpoint(cfg.checkpoint.uri, tmp_path / "again", onnx=False, adapter=True)
    again = export_checkpoint(cfg.checkpoint.uri, tmp_path / "again", onnx=False, adapter=True,
                              overrides=[f"model.name_or_path={base}"])
    assert again["adapter"]["top1_agree"] == 1.0 and again["adapter"]["base"] == base
    first, second = (load_file(str(Path(d) / "adapter_model.safetensors")) for d in (folder, again["adapter"]["dir"]))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_export_adapter_without_lora_stops_before_training(tiny_config):
    from memfit.errors import ConfigError
    from memfit.preflight import preflight

    with pytest.raises(ConfigError, match="export.adapter: this run trains all weights"):
        preflight(tiny_config(**{"export.adapter": True, "lora.enabled": "false"}))
