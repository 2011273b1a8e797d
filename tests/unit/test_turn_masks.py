"""Answer-only labels with a model's own template (no generation markers): found turn by turn, equal to markers'."""

from __future__ import annotations

import pytest
from chat_support import bpe_tokenizer, conversation_texts
from shipped_templates import QWEN3_STYLE, SHIPPED

from memfit.config import DataConfig
from memfit.data.formats import Corpus
from memfit.data.masking import IGNORE, encode_examples
from memfit.data.synthetic import synthetic_conversations
from memfit.data.templates import check_template_source
from memfit.errors import DataError

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "Answer briefly."}
TURNS = [
    {"role": "user", "content": "what is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "count from one."},
    {"role": "assistant", "content": "  one two three.\n"},  # whitespace a template may trim
]


@pytest.fixture(scope="module")
def texts():
    return conversation_texts()


def _tok(texts, name, marked=False):
    shipped, with_markers, specials, _ = SHIPPED[name]
    tok = bpe_tokenizer(texts, specials)
    tok.chat_template = with_markers if marked else shipped
    return tok


def _encode(tok, conversations, train_on="assistant"):
    examples = [{"messages": m} for m in conversations]
    corpus = Corpus(["unused"] * len(examples), "messages", examples,
                    [("conv.jsonl", i + 1) for i in range(len(examples))])
    return encode_examples(corpus, tok, DataConfig(format="messages", train_on=train_on))


def _conversations(name):
    system = SHIPPED[name][3]
    generated = [c if system else [t for t in c if t["role"] != "system"] for c in synthetic_conversations(40, 5)]
    return [[SYSTEM, *TURNS] if system else TURNS, TURNS[:2], *generated]


@pytest.mark.parametrize("name", list(SHIPPED))
@pytest.mark.parametrize("train_on", ["assistant", "completion"])
def test_labels_without_markers_equal_the_same_template_with_markers(texts, name, train_on):
    conversations = _conversations(name)
    shipped = _encode(_tok(texts, name), conversations, train_on)
    marked = _encode(_tok(texts, name, marked=True), conversations, train_on)
    # Token by token, on every conversation: the same input ids and the same labels.
    assert [ids for ids, _ in shipped] == [ids for ids, _ in marked]
    for (_, labels), (_, expected) in zip(shipped, marked, strict=True):
        assert labels == expected
        assert IGNORE in labels and any(lab != IGNORE for lab in labels)  # answers trained, the prompt not


@pytest.mark.parametrize("name", ["smollm2-chatml", "llama-3", "gemma"])
def test_trained_tokens_are_the_answers_and_their_end_token(texts, name):
    tok = _tok(texts, name)
    [(ids, labels)] = _encode(tok, [TURNS])
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])
    end = {"smollm2-chatml": "<|im_end|>", "llama-3": "<|eot_id|>", "gemma": "<end_of_turn>"}[name]
    answers = [TURNS[1]["content"], TURNS[3]["content"]]
    if name != "smollm2-chatml":  # Llama 3 and Gemma trim the content
        answers = [a.strip() for a in answers]
    assert trained == "".join(a + end for a in answers)


def test_a_template_that_re_renders_an_earlier_answer_is_refused_naming_the_turn(texts):
    tok = bpe_tokenizer(texts, ["<|im_start|>", "<|im_end|>"])
    tok.chat_template = QWEN3_STYLE
    [(ids, labels)] = _encode(tok, [TURNS[:2]])  # one answer, after the last user turn: found
    assert tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]).endswith(
        "2 plus 3 is 5.<|im_end|>")
    with pytest.raises(DataError, match=r"^data\.chat_template: the tokenizer's chat template .*re-renders earlier "
                                        r"turns differently \(conv\.jsonl record 2, turn 2, .*generation"):
        _encode(tok, [TURNS[:2], TURNS])
    [(ids, labels)] = _encode(tok, [TURNS], "all")  # all tokens: no turn boundary needed
    assert labels == ids


def test_preflight_accepts_a_template_file_without_markers(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(SHIPPED["smollm2-chatml"][0])
    check_template_source(DataConfig(format="messages", train_on="assistant", chat_template=str(path)))
    with pytest.raises(DataError, match=r"data\.chat_template: .*missing\.jinja not found"):
        check_template_source(DataConfig(format="messages", chat_template=str(tmp_path / "missing.jinja")))
