"""GGUF without llama.cpp: the f16 file's metadata and tensors read back with the gguf package, the Ollama
Modelfile converted from each built-in chat template, and the one-line refusals (family, quant, formats list)."""

from __future__ import annotations

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


def test_the_f16_file_holds_the_tokenizer_template_and_llama_cpp_tensor_names(tmp_path):
    gguf = pytest.importorskip("gguf")
    from family_support import family_folder
    from transformers import AutoTokenizer

    from memfit.release.gguf import write_f16

    folder = family_folder(tmp_path, "llama")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHATML_TEMPLATE
    write_f16(folder, tmp_path / "m.gguf", tok, "tiny")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert "{% generation %}" not in fields["tokenizer.chat_template"]  # transformers-only tags removed
    assert fields["tokenizer.chat_template"].startswith("{%- for message in messages")
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 400
    tensors = {t.name: t.tensor_type.name for t in reader.tensors}
    assert tensors["blk.1.attn_q.weight"] == "F16" and tensors["blk.1.attn_norm.weight"] == "F32"
    assert len(tensors) == 2 + 9 * 2 + 1  # embeddings, output, output norm; 9 per block


def test_unsupported_families_quants_and_format_lists_fail_in_one_line():
    from memfit import config
    from memfit.errors import ConfigError
    from memfit.release.gguf import check_gguf_export

    with pytest.raises(ConfigError, match="but a mixture-of-experts model: llama.cpp's expert tensors") as err:
        check_gguf_export("qwen3_moe", ["f16"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no GGUF mapping"):
        check_gguf_export("bloom", ["f16"])
    check_gguf_export("gemma3_text", ["f16"])  # Gemma 3 is written (tests/integration/test_gguf_export.py)
    with pytest.raises(ConfigError, match="iq2_xs not available"):
        check_gguf_export("llama", ["iq2_xs"])
    cfg = config.load(None, ["export.formats=[safetensors,gguf]"])
    assert cfg.export.enabled_formats() == ["safetensors", "gguf"] and cfg.export.onnx is False
    assert config.load(None, ["export.onnx=false"]).export.enabled_formats() == ["safetensors"]
    assert config.load(None, ["export.adapter=true"]).export.enabled_formats() == ["safetensors", "onnx", "adapter"]
    with pytest.raises(ConfigError, match="contradicts export.formats"):
        config.load(None, ["export.formats=[safetensors,gguf]", "export.onnx=true"])
    with pytest.raises(ConfigError, match="safetensors is the export every other format is made from"):
        config.load(None, ["export.formats=[onnx]"])
