"""Tests of memfit.data: corpus, loaders, packing, split and the resumable batch order."""

from __future__ import annotations

import json
import random
import socket

import pytest
import torch

from memfit.config import DataConfig, MemfitConfig
from memfit.data.formats import data_digest, load_texts
from memfit.data.order import BatchOrder
from memfit.data.packing import split_blocks, tokenize_and_pack
from memfit.data.prepare import DataBundle, prepare_data
from memfit.data.synthetic import synthetic_corpus
from memfit.errors import CheckpointError, DataError

pytestmark = pytest.mark.unit


class CharTokenizer:
    """One id per character, eos 0: makes the packed layout checkable by hand."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False, verbose=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"tried to open a network connection: {args[1:]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# --- synthetic corpus -------------------------------------------------------------------------

def test_synthetic_corpus_is_seeded_and_leaves_global_rng_alone():
    state = random.getstate()
    a, b = synthetic_corpus(50, seed=7), synthetic_corpus(50, seed=7)
    assert random.getstate() == state
    assert a == b
    assert synthetic_corpus(50, seed=8) != a
    assert len(a) == 50
    assert all(doc.strip() and doc.isascii() for doc in a)


def test_synthetic_corpus_has_learnable_structure():
    text = " ".join(synthetic_corpus(200, seed=0))
    assert "plus" in text and " is " in text
    assert "one two three" in text or "two three four" in text
    # Closed vocabulary: a few dozen distinct words, which a tiny model learns quickly.
    assert len(set(text.replace(".", " ").split())) < 120


# --- digest -----------------------------------------------------------------------------------

def test_digest_is_stable_and_sensitive():
    texts = ["hello world", "second doc"]
    assert data_digest(texts) == data_digest(list(texts))
    # Pinned: a change here silently invalidates every cached preset and checkpoint data check.
    assert data_digest(["a", "b"]) == "cf6ab613e3942391f88ed698557e1680f160bd10e88c6b668c50360c10930e2b"
    assert data_digest(["ab", "c"]) != data_digest(["a", "bc"])
    assert data_digest(texts[::-1]) != data_digest(texts)
    assert len(data_digest([])) == 64


# --- loaders ----------------------------------------------------------------------------------

def test_load_texts_unset_path_gives_synthetic_corpus():
    cfg = DataConfig(synthetic_docs=12, seed=3)
    assert load_texts(cfg) == synthetic_corpus(12, 3)


def test_load_txt_paragraphs(tmp_path, no_network):
    f = tmp_path / "corpus.txt"
    f.write_text("first paragraph\nstill first\n\nsecond paragraph\n\n\n")
    texts = load_texts(DataConfig(path=str(f)))
    assert len(texts) == 2
    assert texts[0] == "first paragraph\nstill first"
    assert texts[1].strip() == "second paragraph"


def test_load_jsonl_with_custom_field(tmp_path, no_network):
    f = tmp_path / "corpus.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"doc {i}", "id": i}) for i in range(3)) + "\n")
    assert load_texts(DataConfig(path=str(f), text_field="body")) == ["doc 0", "doc 1", "doc 2"]


def test_load_folder_recursive_sorted_mixed(tmp_path, no_network):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("from a\n")
    (tmp_path / "b" / "c.jsonl").write_text('{"text": "from c1"}\n{"text": "from c2"}\n')
    (tmp_path / "b" / "d.txt").write_text("from d\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notes.md").write_text("ignored")
    texts = [t.strip() for t in load_texts(DataConfig(path=str(tmp_path)))]
    assert texts == ["from a", "from c1", "from c2", "from d"]


def test_loaders_leave_the_default_datasets_cache_alone(tmp_path, monkeypatch):
    import datasets

    default_cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", default_cache)
    f = tmp_path / "x.txt"
    f.write_text("some text\n")
    assert load_texts(DataConfig(path=str(f))) == ["some text\n"]
    assert not default_cache.exists()


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda d: d / "missing", ["data.path", "not found", "unset it"]),
        (lambda d: _write(d / "data.xlsx", "a,b\n"), ["data.path", "unsupported extension", ".jsonl"]),
        (lambda d: _write(d / "sub" / "x.md", "hi").parent, ["data.path", "no .txt or .jsonl"]),
        (lambda d: _write(d / "r.jsonl", '{"body": "x"}\n'), ["data.text_field", "'text'", "body"]),
        (lambda d: _write(d / "r.jsonl", '{"text": "x"}\n{"other": 1}\n'), ["data.text_field", "record 2"]),
        (lambda d: _write(d / "r.jsonl", '{"text": 3}\n'), ["data.text_field", "non-string"]),
        (lambda d: _write(d / "r.jsonl", '{"text": "x"\n'), ["data.path", "JSON"]),
        (lambda d: _write(d / "blank.txt", "\n   \n\n"), ["data.path", "no non-blank text"]),
    ],
    ids=["missing", "extension", "empty-folder", "no-field", "partial-field", "non-string", "bad-json",
         "blank"],
)
def test_load_errors_name_the_field(tmp_path, no_network, setup, expected):
    target = setup(tmp_path)
    with pytest.raises(DataError) as info:
        load_texts(DataConfig(path=str(target)))
    msg = str(info.value)
    for part in expected:
        assert part in msg, msg
    assert len(msg) < 400


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- packing and split ------------------------------------------------------------------------

def test_pack_appends_eos_and_drops_remainder():
    blocks = tokenize_and_pack(["abc", "de", "fghij"], CharTokenizer(), seq_len=3)
    a, b, c, d, e, f, g, h, i = (ord(x) for x in "abcdefghi")
    # abc|eos de|eos fghij|eos = 12 tokens -> 4 blocks, nothing dropped; check the eos positions.
    assert blocks.dtype == torch.long
    assert blocks.tolist() == [[a, b, c], [0, d, e], [0, f, g], [h, i, ord("j")]]
    blocks = tokenize_and_pack(["abc", "de", "fghij"], CharTokenizer(), seq_len=5)
    assert blocks.shape == (2, 5)  # 13 tokens -> 2 full blocks, 3 dropped


def test_pack_too_little_data_names_seq_len():
    with pytest.raises(DataError, match=r"data\.seq_len.*only 6 tokens"):
        tokenize_and_pack(["hello"], CharTokenizer(), seq_len=4)


def test_split_is_deterministic_disjoint_and_never_empty():
    blocks = torch.arange(40).view(20, 2)
    train, val = split_blocks(blocks, 0.2, seed=1)
    train2, val2 = split_blocks(blocks, 0.2, seed=1)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert (train.shape[0], val.shape[0]) == (16, 4)
    rows = sorted(r[0] for r in torch.cat([train, val]).tolist())
    assert rows == list(range(0, 40, 2))
    assert not torch.equal(split_blocks(blocks, 0.2, seed=2)[1], val)
    tr, va = split_blocks(torch.zeros(2, 3, dtype=torch.long), 0.01, seed=0)
    assert (tr.shape[0], va.shape[0]) == (1, 1)
    tr, va = split_blocks(torch.zeros(3, 3, dtype=torch.long), 0.49, seed=0)
    assert tr.shape[0] >= 1 and va.shape[0] >= 1


def test_prepare_data_bundle():
    cfg = MemfitConfig.model_validate({"data": {"seq_len": 8, "val_fraction": 0.25, "seed": 5,
                                                "synthetic_docs": 20}})
    bundle = prepare_data(cfg, CharTokenizer())
    assert isinstance(bundle, DataBundle)
    assert bundle.source == "synthetic(20, 5)"
    assert bundle.digest == data_digest(synthetic_corpus(20, 5))
    assert bundle.train.shape[1] == bundle.val.shape[1] == 8
    assert bundle.n_train_tokens == bundle.train.numel() and bundle.n_val_tokens == bundle.val.numel()
    assert bundle.val.shape[0] >= 1 and bundle.train.shape[0] > bundle.val.shape[0]


# --- batch order ------------------------------------------------------------------------------

def test_batch_order_covers_each_epoch_and_spans_the_boundary():
    order = BatchOrder(n_items=10, batch_size=4, seed=3)
    stream = [i for _ in range(5) for i in order.next_indices()]  # 20 items = exactly 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    expected += torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert stream == expected
    assert order.epoch == 2


def test_batch_order_resume_in_new_object_matches_uninterrupted():
    torch_state = torch.get_rng_state()
    reference = BatchOrder(n_items=10, batch_size=4, seed=11)
    uninterrupted = [reference.next_indices() for _ in range(9)]
    for cut in range(1, 9):  # cuts on both sides of epoch boundaries (batches 3 and 5 span them)
        first = BatchOrder(n_items=10, batch_size=4, seed=11)
        got = [first.next_indices() for _ in range(cut)]
        saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        resumed = BatchOrder(n_items=10, batch_size=4, seed=11)
        resumed.load_state_dict(saved)
        assert resumed.epoch == first.epoch
        got += [resumed.next_indices() for _ in range(9 - cut)]
        assert got == uninterrupted, f"cut at batch {cut}"
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_batch_order_state_is_plain_ints():
    order = BatchOrder(n_items=7, batch_size=3, seed=0)
    order.next_indices()
    state = order.state_dict()
    assert state == {"epoch": 0, "index": 3, "n_items": 7, "seed": 0, "batch_size": 3}
    assert all(type(v) is int for v in state.values())


@pytest.mark.parametrize("change", [{"n_items": 11}, {"seed": 12}])
def test_batch_order_rejects_changed_data(change):
    state = BatchOrder(n_items=10, batch_size=4, seed=11).state_dict() | change
    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
        BatchOrder(n_items=10, batch_size=4, seed=11).load_state_dict(state)


def test_batch_order_rejects_malformed_state():
    with pytest.raises(CheckpointError):
        BatchOrder(n_items=10, batch_size=4, seed=11).load_state_dict({"epoch": 0})
