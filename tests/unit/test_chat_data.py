"""Chat and instruction data: formats, templates, token-by-token loss masks, packing isolation, bad input."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from chat_support import TEMPLATE_SPECIALS, bpe_tokenizer, conversation_texts, messages_jsonl

from memfit import config
from memfit.config import DataConfig
from memfit.data.formats import Corpus, load_texts
from memfit.data.masking import IGNORE, encode_examples
from memfit.data.packing import pack_padded, pack_padding_free
from memfit.data.prepare import prepare_data
from memfit.data.synthetic import synthetic_prompt_completions, write_jsonl, write_parquet
from memfit.data.templates import BUILTIN_TEMPLATES
from memfit.errors import DataError
from memfit.memory.techniques.loss import blocks_batch

pytestmark = pytest.mark.unit

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "what is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "count from one."},
    {"role": "assistant", "content": "one two three."},
]
ANSWERS = ["2 plus 3 is 5.", "one two three."]
END = {"chatml": "<|im_end|>", "llama-3": "<|eot_id|>", "memfit-preset": "<|endoftext|>"}
# Llama 3's own template has no {% generation %} markers (the built-in llama-3 has them).
LLAMA3_WITHOUT_MARKERS = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
                          "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}")


@pytest.fixture(scope="module")
def texts():
    return conversation_texts()


def _tokenizer(texts, name):
    tok = bpe_tokenizer(texts, TEMPLATE_SPECIALS[name])
    tok.chat_template = BUILTIN_TEMPLATES[name]
    return tok


def _encode(tok, examples, fmt, train_on):
    corpus = Corpus(["unused"] * len(examples), fmt, examples, [("conv.jsonl", i + 1) for i in range(len(examples))])
    return encode_examples(corpus, tok, DataConfig(format=fmt, train_on=train_on))


def _runs(ids, labels):
    """The trained tokens, as contiguous runs."""
    runs, current = [], []
    for i, lab in zip(ids, labels, strict=True):
        if lab == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(i)
    return runs + ([current] if current else [])


@pytest.mark.parametrize("name", ["chatml", "llama-3", "memfit-preset"])
def test_assistant_tokens_are_trained_and_nothing_else(texts, name):
    tok = _tokenizer(texts, name)
    [(ids, labels)] = _encode(tok, [{"messages": CONVERSATION}], "messages", "assistant")
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    # Token by token: each label is its input id (trained) or -100; the trained runs are exactly the answers with
    # the template's end marker, and everything else (system, user turns, role headers) is untrained.
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels, strict=True))
    assert [tok.decode(r) for r in _runs(ids, labels)] == [a + END[name] for a in ANSWERS]
    rest = tok.apply_chat_template(CONVERSATION, tokenize=False)
    for answer in ANSWERS:
        rest = rest.replace(answer + END[name], "", 1)
    assert tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE]) == rest


@pytest.mark.parametrize("name", ["chatml", "memfit-preset"])
def test_completion_on_messages_trains_the_last_answer_only(texts, name):
    tok = _tokenizer(texts, name)
    [(ids, labels)] = _encode(tok, [{"messages": CONVERSATION}], "messages", "completion")
    assert [tok.decode(r) for r in _runs(ids, labels)] == [ANSWERS[-1] + END[name]]
    [(ids_all, labels_all)] = _encode(tok, [{"messages": CONVERSATION}], "messages", "all")
    assert ids_all == ids and labels_all == ids


def test_prompt_completion_trains_the_completion_and_eos(texts):
    tok = bpe_tokenizer(texts)
    example = {"prompt": "Q: what is 2 plus 3?\nA:", "completion": " 2 plus 3 is 5."}
    [(ids, labels)] = _encode(tok, [example], "prompt_completion", "completion")
    assert [tok.decode(r) for r in _runs(ids, labels)] == [" 2 plus 3 is 5.<|endoftext|>"]
    assert tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE]) == example["prompt"]


def test_template_without_generation_markers_trains_the_same_tokens_as_with_them(texts):
    tok = bpe_tokenizer(texts, TEMPLATE_SPECIALS["llama-3"])
    tok.chat_template = LLAMA3_WITHOUT_MARKERS  # answers found turn by turn (tests/unit/test_turn_masks.py)
    [(ids, labels)] = _encode(tok, [{"messages": CONVERSATION}], "messages", "assistant")
    assert (ids, labels) == _encode(_tokenizer(texts, "llama-3"), [{"messages": CONVERSATION}], "messages",
                                    "assistant")[0]
    assert [tok.decode(r) for r in _runs(ids, labels)] == [a + END["llama-3"] for a in ANSWERS]


def test_model_without_template_and_messages_data_says_how_to_supply_one(texts):
    with pytest.raises(DataError, match=r"data\.chat_template: .*no chat template"):
        _encode(bpe_tokenizer(texts), [{"messages": CONVERSATION}], "messages", "all")


def test_unknown_role_names_the_file_record_and_field(texts):
    tok = _tokenizer(texts, "chatml")
    bad = [{"messages": CONVERSATION}, {"messages": [{"role": "tool", "content": "{}"}]}]
    with pytest.raises(DataError, match=r"conv\.jsonl record 2: field 'messages'.*unknown role tool"):
        _encode(tok, bad, "messages", "assistant")


# --- formats ---------------------------------------------------------------------------------------------

def test_formats_are_recognised_with_a_reason(tmp_path, caplog):
    pc = synthetic_prompt_completions(5, 0)
    write_parquet(pc, tmp_path / "pc.parquet")
    (tmp_path / "pc.csv").write_text("prompt,completion\n" + "".join(f'"{r["prompt"]}","{r["completion"]}"\n'
                                                                    for r in pc))
    (tmp_path / "pc.json").write_text(json.dumps(pc))
    messages_jsonl(tmp_path / "chat.jsonl", 4)
    with caplog.at_level(logging.INFO, logger="memfit.data"):
        for name in ("pc.parquet", "pc.csv", "pc.json"):
            corpus = load_texts(DataConfig(path=str(tmp_path / name)))
            assert corpus.format == "prompt_completion" and corpus.examples == pc, name
        chat = load_texts(DataConfig(path=str(tmp_path / "chat.jsonl")))
    assert chat.format == "messages" and len(chat.examples) == 4
    assert chat.examples[0]["messages"][0]["role"] in ("system", "user")
    assert "format messages recognised" in caplog.text and "have a 'messages' field" in caplog.text
    assert "format prompt_completion recognised" in caplog.text


def test_saved_dataset_and_load_dataset_ids_read_locally(tmp_path, monkeypatch):
    import datasets

    pc = synthetic_prompt_completions(6, 1)
    datasets.Dataset.from_list(pc).save_to_disk(str(tmp_path / "saved"))
    assert load_texts(DataConfig(path=str(tmp_path / "saved"))).examples == pc
    datasets.DatasetDict({"train": datasets.Dataset.from_list(pc[:3]),
                          "test": datasets.Dataset.from_list(pc[3:])}).save_to_disk(str(tmp_path / "dict"))
    assert load_texts(DataConfig(path=str(tmp_path / "dict"), split="test")).examples == pc[3:]
    # hf:NAME goes through datasets.load_dataset: offline here, on a local data folder given as the name.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_parquet(pc, tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    assert load_texts(DataConfig(path=f"hf:{tmp_path / 'hub'}")).examples == pc
    with pytest.raises(DataError, match=r"^data\.split: dataset .* has no split 'test' .*; set data\.split"):
        load_texts(DataConfig(path=f"hf:{tmp_path / 'hub'}", split="test"))


@pytest.mark.parametrize(("records", "needles"), [
    ([{"messages": CONVERSATION}, {"text": "no messages"}], ["chat.jsonl record 2", "'messages'", "missing"]),
    ([{"messages": []}], ["chat.jsonl record 1", "empty conversation"]),
    ([{"messages": [{"role": "user"}]}], ["record 1", "'messages[0].content'"]),
], ids=["no-field", "empty-conversation", "no-content"])
def test_bad_records_name_the_file_record_and_field(tmp_path, records, needles):
    write_jsonl(records, tmp_path / "chat.jsonl")
    with pytest.raises(DataError) as info:
        load_texts(DataConfig(path=str(tmp_path / "chat.jsonl"), format="messages"))
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_unreadable_parquet_names_the_file(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"could not read the \.parquet data at .*broken\.parquet"):
        load_texts(DataConfig(path=str(tmp_path / "broken.parquet")))


# --- packing ---------------------------------------------------------------------------------------------

def _tiny_model(arch: str, impl: str):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    cfg = (LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, **ids) if arch == "llama" else
           GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_examples_do_not_see_each_other(arch, impl):
    model = _tiny_model(arch, impl)
    gen = torch.Generator().manual_seed(1)
    examples = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (9, 5, 7)]
    encoded = [(e, list(e)) for e in examples]
    rows, members = pack_padding_free(encoded, seq_len=24, pad_id=0)
    assert members == [[0, 2, 1]]  # one row, longest first; 3 tokens of padding at the end
    fields = {k: rows[k] for k in ("labels", "position_ids")}
    with torch.no_grad():
        packed = model(**blocks_batch(rows["input_ids"], slice(0, 1), None, fields, impl))
        start, weighted, n_trained = 0, 0.0, 0
        for i in members[0]:
            ids = torch.tensor([examples[i]])
            alone = model(input_ids=ids, labels=ids)
            n = ids.shape[1]
            torch.testing.assert_close(packed.logits[:, start:start + n], alone.logits, atol=1e-5, rtol=1e-5)
            weighted, n_trained, start = weighted + float(alone.loss) * (n - 1), n_trained + n - 1, start + n
        # The row's loss is the token-weighted mean of each example's loss alone: nothing crosses a boundary.
        assert float(packed.loss) == pytest.approx(weighted / n_trained, rel=1e-5)
        # The same row without the packing fields attends across examples: the check above can fail.
        leaky = model(input_ids=rows["input_ids"]).logits
    assert not torch.allclose(leaky[:, 9:16], packed.logits[:, 9:16], atol=1e-3)


def test_padded_rows_are_cut_to_the_batch_longest_and_masked():
    encoded = [([5, 6, 7], [5, 6, 7]), ([8, 9], [IGNORE, 9])]
    rows, _ = pack_padded(encoded, seq_len=10, pad_id=0)
    fields = {k: rows[k] for k in ("labels", "attention_mask")}
    batch = blocks_batch(rows["input_ids"], slice(0, 2), None, fields, padding_mask=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [IGNORE, 9, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    # Where the loss does not read it (every dense model) the mask stays behind: the padding is on the right.
    assert set(blocks_batch(rows["input_ids"], slice(0, 2), None, fields)) == {"input_ids", "labels"}


@pytest.mark.parametrize("policy", ["truncate", "drop", "error"])
def test_overlong_examples(tmp_path, texts, policy):
    tok = _tokenizer(texts, "memfit-preset")
    long_turn = {"role": "assistant", "content": " ".join(["one two three"] * 100)}
    convs = [CONVERSATION] * 30 + [CONVERSATION[:2] + [long_turn]] + [CONVERSATION] * 5
    write_jsonl([{"messages": m} for m in convs], tmp_path / "chat.jsonl")
    cfg = config.load(None, [f"data.path={tmp_path / 'chat.jsonl'}", "data.packing=padding_free", "data.seq_len=128",
                             f"data.overlong={policy}", "data.train_on=assistant"])
    if policy == "error":
        with pytest.raises(DataError, match=r"data\.overlong: .*chat\.jsonl record 31: field 'messages'"):
            prepare_data(cfg, tok)
        return
    bundle = prepare_data(cfg, tok)
    assert bundle.stats["truncated" if policy == "truncate" else "dropped"] == 1
    pos = torch.cat([bundle.train_fields["position_ids"], bundle.val_fields["position_ids"]])
    labels = torch.cat([bundle.train_fields["labels"], bundle.val_fields["labels"]])
    segments = (pos == 0).cumsum(-1)
    kept = sum(int(((segments[r] == s) & (labels[r] != IGNORE)).any()) for r in range(len(pos))
               for s in segments[r].unique())
    assert kept == (36 if policy == "truncate" else 35)  # every kept conversation whole in one row
    assert bool((pos == 127).any()) == (policy == "truncate")  # the truncated one fills a row
    assert 0 < bundle.trained_share() < 0.6
