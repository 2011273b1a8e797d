"""The packed-data cache: hit when nothing that shapes the blocks changed, miss when anything did."""

from __future__ import annotations

import pytest
import torch

from memfit import config
from memfit.data.cache import cache_key, cached_data
from memfit.data.formats import data_digest, load_texts
from memfit.models.loading import train_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = load_texts(config.DataConfig(synthetic_docs=200))
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok")), texts


def test_second_call_reads_the_cache(tmp_path, tok, monkeypatch):
    tokenizer, texts = tok
    cfg = config.load(None, [f"run.work_dir={tmp_path}", "data.seq_len=32", "data.synthetic_docs=200"])
    first = cached_data(cfg, texts, data_digest(texts), tokenizer)
    import memfit.data.cache as dc

    monkeypatch.setattr(dc, "prepare_data", lambda *a, **k: pytest.fail("cache miss"))
    second = cached_data(cfg, texts, data_digest(texts), tokenizer)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert second.digest == first.digest


def test_key_changes_with_what_shapes_the_blocks(tmp_path, tok):
    tokenizer, texts = tok
    base = config.load(None, ["data.seq_len=32"])
    k = cache_key(base, data_digest(texts), tokenizer)
    assert k == cache_key(config.load(None, ["data.seq_len=32", "train.lr=0.1"]), data_digest(texts), tokenizer)
    assert k != cache_key(config.load(None, ["data.seq_len=64"]), data_digest(texts), tokenizer)
    assert k != cache_key(base, data_digest(texts[:-1]), tokenizer)
    other = train_tokenizer(texts[:50], 280, tmp_path / "tok2")
    assert k != cache_key(base, data_digest(texts), other)
