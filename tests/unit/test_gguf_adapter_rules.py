"""export.formats gguf-adapter without llama.cpp: the Modelfile (FROM the base GGUF, in the folder or a user's own
file, then ADAPTER; the checker refuses an empty ADAPTER, one before FROM, paths that are not there), the format's
place in the list, and the one-line refusals before training (no adapter, a QLoRA base, no base file, no converter)."""

from __future__ import annotations

import pytest

from memfit.data.templates import CHATML_TEMPLATE

pytestmark = pytest.mark.unit


def _text() -> str:
    from chat_support import bpe_tokenizer, conversation_texts

    from memfit.release.modelfile import modelfile_text

    tok = bpe_tokenizer(conversation_texts(60), specials=["<|im_start|>", "<|im_end|>"], vocab_size=320)
    tok.chat_template = CHATML_TEMPLATE
    return modelfile_text("base-q8_0.gguf", tok, 256)[0]


def test_the_adapter_follows_its_base_and_both_paths_must_exist(tmp_path):
    from memfit.release.modelfile import check_paths, parse_modelfile, with_adapter

    text = with_adapter(_text(), "base-q8_0.gguf", "adapter-f16.gguf")
    parsed = parse_modelfile(text)
    assert parsed[:2] == [("FROM", "./base-q8_0.gguf"), ("ADAPTER", "./adapter-f16.gguf")]
    assert [w for w, _ in parsed].count("FROM") == 1 and ("PARAMETER", 'stop "<|im_end|>"') in parsed
    assert any(w == "TEMPLATE" for w, _ in parsed)  # the run's chat template, not lost on the way
    with pytest.raises(ValueError, match=r"FROM \./base-q8_0\.gguf: no such file"):
        check_paths(parsed, tmp_path)
    (tmp_path / "base-q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"ADAPTER \./adapter-f16\.gguf: no such file"):
        check_paths(parsed, tmp_path)
    (tmp_path / "adapter-f16.gguf").write_bytes(b"GGUF")
    check_paths(parsed, tmp_path)

    # A base GGUF the user already has: FROM names it where it is, the adapter stays beside the Modelfile.
    mine = tmp_path / "elsewhere" / "my-base.Q4_K_M.gguf"
    mine.parent.mkdir()
    mine.write_bytes(b"GGUF")
    parsed = parse_modelfile(with_adapter(_text(), str(mine), "adapter-f16.gguf"))
    assert parsed[:2] == [("FROM", str(mine)), ("ADAPTER", "./adapter-f16.gguf")]
    check_paths(parsed, tmp_path)
    check_paths(parse_modelfile("FROM llama3.2\nADAPTER ./adapter-f16.gguf\n"), tmp_path)  # a model name


@pytest.mark.parametrize(("text", "problem"), [
    ("FROM ./base.gguf\nADAPTER\n", "line 2: ADAPTER needs the adapter's path"),
    ("ADAPTER ./adapter-f16.gguf\nFROM ./base.gguf\n", "starts with FROM"),
    ("FROM ./base.gguf\nADAPTERS ./adapter-f16.gguf\n", "unknown instruction")])
def test_the_checker_names_a_bad_adapter_line(text, problem):
    from memfit.release.modelfile import parse_modelfile

    with pytest.raises(ValueError, match=problem) as err:
        parse_modelfile(text)
    assert "\n" not in str(err.value)


def _cfg(tmp_path, **extra):
    from pathlib import Path

    from tests_support import tiny_overrides

    from memfit import config

    repo = Path(__file__).resolve().parents[2]
    return config.load(repo / "configs" / "tiny.yaml", tiny_overrides(tmp_path, None, **{
        "export.formats": "[safetensors,gguf-adapter]", **extra}))


def test_gguf_adapter_is_a_format_written_after_the_others(tmp_path):
    cfg = _cfg(tmp_path, **{"export.formats": "[gguf-adapter,safetensors,gguf,adapter]"})
    assert cfg.export.enabled_formats() == ["safetensors", "adapter", "gguf", "gguf-adapter"]
    assert cfg.export.adapter is True and cfg.export.gguf_adapter_base is None


@pytest.mark.parametrize(("extra", "problem"), [
    ({"lora.enabled": "false"}, "export.formats gguf-adapter: this run trains all weights"),
    ({"lora.enabled": "true", "lora.quantize": "nf4"}, r"a QLoRA adapter \(lora.quantize=nf4\)"),
    ({"lora.enabled": "true", "export.gguf_adapter_base": "/nowhere/base.Q8_0.gguf"},
     "export.gguf_adapter_base: /nowhere/base.Q8_0.gguf is not a file"),
    ({"lora.enabled": "true"}, "llama.cpp's converter is not installed at /nowhere/converter")])
def test_what_cannot_give_a_gguf_adapter_is_refused_in_one_line(tmp_path, monkeypatch, extra, problem):
    from memfit.errors import ConfigError
    from memfit.release.gguf_adapter import check_gguf_adapter_export

    if "/nowhere/converter" in problem:
        pytest.importorskip("llama_cpp")  # the package check comes first
    cfg = _cfg(tmp_path, **extra)
    with pytest.raises(ConfigError, match=problem) as err:
        check_gguf_adapter_export(cfg.export, cfg.lora, "/nowhere/converter")
    assert "\n" not in str(err.value)


def test_a_hub_base_is_read_from_the_local_snapshot_never_downloaded(tmp_path):
    from memfit.errors import ExportError
    from memfit.release.gguf_adapter import base_folder

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    assert base_folder("org/tiny", cache_dir=str(tmp_path / "hub")) == snap
    assert base_folder(str(snap)) == snap  # a folder is itself
    with pytest.raises(ExportError, match="gguf-adapter: base org/other is not in the local Hugging Face cache"):
        base_folder("org/other", cache_dir=str(tmp_path / "hub"))
