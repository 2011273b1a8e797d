"""A LoRA run's adapter as GGUF (export.formats gguf-adapter): llama.cpp's convert_lora_to_gguf.py writes it beside
the base as GGUF, llama.cpp (llama-cpp-python, lora_path) on that base gives the merged model's greedy tokens while the
base alone does not, the Modelfile says FROM the base and ADAPTER the adapter; the figures in MLflow; a base GGUF the
user already has; a wrong adapter caught in one line; a full fine-tune asking for it refused before training.
Skipped where llama-cpp-python is not installed (it builds llama.cpp from source: `pip install 'memfit[gguf]'`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tests_support import cli_in_process, tiny_overrides

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
FORMATS = "[safetensors,adapter,gguf-adapter]"


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    """llama.cpp's converter: the one installed (memfit gguf-converter install, $MEMFIT_GGUF_CONVERTER), else taken
    from the pinned sdist ($MEMFIT_LLAMA_CPP_SDIST, else pip's download) into a temporary folder."""
    from memfit.errors import ConfigError, ExportError
    from memfit.release import gguf_converter

    try:
        conv = gguf_converter.find()
    except ConfigError:
        try:
            conv = gguf_converter.install(tmp_path_factory.mktemp("converter") / "conv",
                                          sdist=os.environ.get("MEMFIT_LLAMA_CPP_SDIST"))
        except ExportError as err:
            pytest.skip(str(err))
    saved = os.environ.get(gguf_converter.ENV_DIR)
    os.environ[gguf_converter.ENV_DIR] = str(conv.dir)  # preflight and phase 5 find it as a user's setting would
    yield conv
    if saved is None:
        os.environ.pop(gguf_converter.ENV_DIR, None)
    else:
        os.environ[gguf_converter.ENV_DIR] = saved


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, converter):
    """One tiny LoRA run (configs/tiny.yaml, shortened; a high learning rate so the adapter changes greedy tokens)
    exporting SafeTensors, the peft adapter and the GGUF adapter on an f16 and a q8_0 base, with MLflow."""
    from memfit import config, phases

    root = tmp_path_factory.mktemp("gguf-adapter")
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, None, **{
        "lora.enabled": "true", "lora.r": 8, "train.lr": 2e-2, "train.max_steps": 12, "checkpoint.every_steps": 12,
        "train.warmup_steps": 2, "data.synthetic_docs": 400, "export.formats": FORMATS, "memory.policy": "full",
        "export.gguf_quants": "[f16,q8_0]", "train.num_threads": 1, "tracking.system_metrics": False,
        "export.uri": str(root / "exports")}))
    probe = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, probe)
    assert plan.lora is True
    result = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), probe)
    return cfg, phases.evaluate_and_release(cfg, result)


def _greedy(hf_dir: Path, gguf: Path, lora: Path | None, prompt: str, n: int = 8) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens on the merged export, and llama.cpp's own sampler at top-k 1 on the base GGUF
    (with the adapter when `lora`): not memfit's verification loop, an independent oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.release.llama_loader import open_gguf

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    want = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    llm = open_gguf(str(gguf), lora_path=str(lora) if lora else None, n_ctx=128, verbose=False, seed=0,
                n_threads=1)
    got = []
    try:
        for token in llm.generate(ids[0].tolist(), top_k=1, temp=0.0):
            if token == llm.token_eos() or len(got) == n:
                break
            got.append(int(token))
    finally:
        llm.close()
    return want[: len(got)] if len(got) < n else want, got


def test_the_adapter_gguf_on_its_base_computes_the_merged_model_in_llama_cpp(lora_run, converter):
    from mlflow import MlflowClient

    from memfit.files import sha256_file
    from memfit.release.modelfile import check_paths, parse_modelfile

    cfg, exported = lora_run
    folder = Path(exported.gguf_adapter["dir"])
    assert folder == Path(cfg.export.dir).absolute() / "gguf-adapter"
    manifest = json.loads((folder / "memfit-gguf-adapter.json").read_text())
    assert set(manifest["files"]) == {"adapter-f16.gguf", "base-f16.gguf", "base-q8_0.gguf", "Modelfile"}
    assert sorted(p.name for p in folder.iterdir()) == sorted([*manifest["files"], "memfit-gguf-adapter.json"])
    assert all(sha256_file(folder / n) == rec["sha256"] for n, rec in manifest["files"].items())
    assert manifest["converter"] == {**converter.record(), "converter": "llama.cpp convert_lora_to_gguf.py, "
                                     "convert_hf_to_gguf.py (the base)"} and manifest["base_gguf"] is None
    assert manifest["base_model"] == exported.adapter["base"]  # the base folder the run trained on
    assert manifest["files"]["adapter-f16.gguf"]["bytes"] < manifest["files"]["base-f16.gguf"]["bytes"] / 5

    # The figures: f16 base + adapter gives transformers' greedy tokens on every prompt, q8_0 within its bound;
    # the base alone does not: the adapter visibly applies.
    figures = {f["quant"]: f for f in exported.gguf_adapter["files"]}
    alone = exported.gguf_adapter["without_adapter"]
    assert figures["f16"]["greedy_equal"] == figures["f16"]["prompts"] == len(cfg.eval.prompts)
    assert figures["f16"]["top1_agree"] == 1.0 and figures["q8_0"]["top1_agree"] >= cfg.export.gguf_min_top1.q8_0
    assert alone["greedy_equal"] < alone["prompts"] and alone["top1_agree"] < 0.9
    assert alone["max_kl"] > 100 * figures["f16"]["max_kl"]
    assert manifest["verification"]["files"] == exported.gguf_adapter["files"]

    # As a user runs it: llama.cpp's sampler with --lora equals transformers' merged model; without, it differs.
    hf = Path(exported.safetensors_dir)
    differs = 0
    for prompt in cfg.eval.prompts[:2]:
        want, got = _greedy(hf, folder / "base-f16.gguf", folder / "adapter-f16.gguf", prompt)
        assert got == want, prompt
        differs += _greedy(hf, folder / "base-f16.gguf", None, prompt)[1] != want
    assert differs >= 1

    modelfile = parse_modelfile((folder / "Modelfile").read_text())
    assert modelfile[:2] == [("FROM", "./base-q8_0.gguf"), ("ADAPTER", "./adapter-f16.gguf")]
    check_paths(modelfile, folder)

    client = MlflowClient(cfg.tracking.resolved_uri())
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.data.metrics["gguf_adapter_f16_top1_agree"] == 1.0
    assert run.data.metrics["gguf_adapter_base_only_top1_agree"] == alone["top1_agree"]
    assert run.data.tags["memfit.formats"] == "safetensors,adapter,gguf-adapter"
    assert "f16 base + adapter: greedy" in run.data.tags["memfit.format.gguf-adapter"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "export/gguf-adapter")}
    assert {"export/gguf-adapter/adapter-f16.gguf", "export/gguf-adapter/Modelfile"} <= logged

    # export.uri holds the folder beside hf/ and adapter/, its manifest among the files, listed before manifest.json.
    from memfit.release.uploads import read_manifest

    uploaded = read_manifest(exported.export_uri)
    keys = {f"gguf-adapter/{n}" for n in [*manifest["files"], "memfit-gguf-adapter.json"]}
    assert {k for k, rec in uploaded["files"].items() if rec["format"] == "gguf-adapter"} == keys
    assert uploaded["formats"]["gguf-adapter"]["base_quants"] == ["f16", "q8_0"]


def test_memfit_export_puts_the_adapter_on_a_base_gguf_the_user_has_and_a_wrong_adapter_is_caught(lora_run,
                                                                                                     tmp_path):
    from safetensors.torch import load_file, save_file

    from memfit.errors import ExportError
    from memfit.files import sha256_file
    from memfit.release.gguf_adapter import PeftSource, export_gguf_adapter
    from memfit.release.modelfile import check_paths, parse_modelfile

    cfg, exported = lora_run
    mine = tmp_path / "models" / "my-base.Q8_0.gguf"  # the base a user already serves, elsewhere
    mine.parent.mkdir()
    shutil.copy(Path(exported.gguf_adapter["dir"]) / "base-q8_0.gguf", mine)
    base = exported.adapter["base"]
    out = tmp_path / "out"
    result = cli_in_process("export", cfg.checkpoint.uri, "--out", out, "--format", "gguf-adapter",
                            "--set", f"model.name_or_path={base}", "--set", f"export.gguf_adapter_base={mine}")
    assert result.exit_code == 0, result.output
    assert "GGUF adapter: " in result.output and "q8_0 base + adapter: greedy" in result.output
    folder = out / "gguf-adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "adapter-f16.gguf", "memfit-gguf-adapter.json"]
    manifest = json.loads((folder / "memfit-gguf-adapter.json").read_text())
    assert manifest["base_gguf"] == {"path": str(mine), "sha256": sha256_file(mine)}
    assert manifest["converter"]["converter"] == "llama.cpp convert_lora_to_gguf.py"  # no base converted
    (figures,) = manifest["verification"]["files"]
    assert figures["quant"] == "q8_0" and figures["top1_agree"] >= cfg.export.gguf_min_top1.q8_0
    modelfile = parse_modelfile((folder / "Modelfile").read_text())
    assert modelfile[:2] == [("FROM", str(mine)), ("ADAPTER", "./adapter-f16.gguf")]
    check_paths(modelfile, folder)
    kwargs = {"prompts": cfg.eval.prompts, "min_top1": cfg.export.gguf_min_top1.model_dump(), "max_new_tokens": 8,
              "base_gguf": str(mine)}
    peft = PeftSource(exported.adapter["dir"], base, "none")

    # An adapter that is not what was merged (its B matrices doubled) fails the check, in one line, nothing written.
    tampered = tmp_path / "tampered"
    shutil.copytree(exported.adapter["dir"], tampered)
    weights = load_file(str(tampered / "adapter_model.safetensors"))
    doubled = {k: v * 2 if "lora_B" in k else v for k, v in weights.items()}
    save_file(doubled, str(tampered / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match=r"gguf-adapter: adapter-f16\.gguf on my-base\.Q8_0\.gguf: top-1 "
                                          r"agreement with the merged model") as err:
        export_gguf_adapter(PeftSource(str(tampered), peft.base, "none"), exported.safetensors_dir,
                            tmp_path / "bad", ["f16"], **kwargs)
    assert "\n" not in str(err.value) and not (tmp_path / "bad").exists()


def test_a_full_fine_tune_asking_for_a_gguf_adapter_is_refused_before_training(tmp_path):
    result = cli_in_process("run", str(REPO / "configs" / "tiny.yaml"), *[a for s in tiny_overrides(tmp_path, None, **{
        "export.formats": "[safetensors,gguf-adapter]", "lora.enabled": "false"}) for a in ("--set", s)])
    assert result.exit_code == 2, result.output
    last = [ln for ln in result.output.splitlines() if ln.strip()][-1]
    assert last.startswith("error: export.formats gguf-adapter: this run trains all weights"), last
    assert not (tmp_path / "checkpoints").exists()
