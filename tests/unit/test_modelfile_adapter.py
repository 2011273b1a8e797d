"""The Modelfile of a GGUF LoRA adapter: FROM the base GGUF (in the folder or a user's own file), ADAPTER the
adapter beside it; the checker refuses an empty ADAPTER, an ADAPTER before FROM, and paths that are not there."""

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
