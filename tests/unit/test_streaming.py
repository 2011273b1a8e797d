"""data.streaming: the prepared path's blocks read as a stream, a seeded windowed order, resumable at any block."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_support import bpe_tokenizer, messages_jsonl

from memfit.config import DataConfig
from memfit.data.formats import load_texts
from memfit.data.packing import tokenize_and_pack
from memfit.data.streaming import BlockStream
from memfit.errors import CheckpointError, DataError


def _texts(n: int, tag: str) -> list[str]:
    return [f"{tag} record {i}: " + " ".join(f"w{(i * 7 + k) % 23}" for k in range(3 + i % 11)) for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A folder of a .jsonl, a .txt (paragraphs), a .parquet and a .csv file: sources in sorted order, a blank."""
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("stream")
    a, b, c, d = _texts(300, "a"), _texts(200, "b"), _texts(250, "c"), _texts(120, "d")
    with (root / "a.jsonl").open("w") as f:
        for i, t in enumerate(a):
            f.write(json.dumps({"text": t if i != 5 else "   "}) + "\n")
    (root / "b.txt").write_text("\n\n".join(b) + "\n")
    pq.write_table(pa.table({"text": c}), root / "c.parquet")
    pa.csv.write_csv(pa.table({"id": list(range(len(d))), "text": d}), root / "d.csv")
    return root, [t for i, t in enumerate(a) if i != 5] + b + c + d


@pytest.fixture(scope="module")
def tok(corpus):
    return bpe_tokenizer(corpus[1])


def _data(root: Path | str, **kw: object) -> DataConfig:
    return DataConfig(path=str(root), streaming=True, seq_len=32, **kw)


def test_streamed_blocks_are_the_prepared_paths_blocks_in_stream_order(corpus, tok):
    root, _ = corpus
    stream = BlockStream(_data(root), tok, 0, "fp")
    blocks, end = stream.read(stream.start, 10**9)
    assert end is None
    prepared = tokenize_and_pack(list(load_texts(DataConfig(path=str(root)))), tok, 32)  # before its split
    assert torch.equal(torch.from_numpy(np.stack(blocks)), prepared)


def test_a_saved_dataset_streams_the_blocks_it_prepares(corpus, tok, tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": corpus[1][:400]}).save_to_disk(str(tmp_path / "saved"))
    stream = BlockStream(_data(tmp_path / "saved"), tok, 0, "fp")
    blocks, pos = stream.read(stream.start, 50)
    rest, end = stream.read(pos, 10**9)
    prepared = tokenize_and_pack(list(load_texts(DataConfig(path=str(tmp_path / "saved")))), tok, 32)
    assert end is None and torch.equal(torch.from_numpy(np.stack(blocks + rest)), prepared)


def test_a_position_mid_stream_continues_with_the_next_block(corpus, tok):
    root, _ = corpus
    stream = BlockStream(_data(root), tok, 0, "fp")
    every, _ = stream.read(stream.start, 10**9)
    for n in (1, 7, 40, len(every) - 1):  # inside a batch of records, across sources, at the last block
        head, pos = stream.read(stream.start, n)
        assert pos is not None and len(head) == n
        rest, end = stream.read(json.loads(json.dumps(pos)), 10**9)  # as a checkpoint's state.json keeps it
        assert end is None and all((x == y).all() for x, y in zip(head + rest, every, strict=True))


def test_training_order_is_windowed_seeded_and_resumes_at_any_block(corpus, tok):
    root, _ = corpus
    data = _data(root, shuffle_buffer=16)
    ref = BlockStream(data, tok, 3, "fp")
    every = ref.read(ref.start, 10**9)[0]
    n = len(every)
    straight = ref.next_blocks(2 * n + 5)  # two epochs and a bit
    # Each epoch is a permutation of the blocks, each window of 16 consecutive blocks permuted within itself.
    first = straight[:n]
    assert sorted(map(tuple, first.tolist())) == sorted(tuple(b.tolist()) for b in every)
    assert torch.equal(first[:16].sort(0).values, torch.from_numpy(np.stack(every[:16])).sort(0).values)
    assert not torch.equal(first, straight[n:2 * n])  # another epoch, another order
    for cut in (3, 16, 21, n, n + 9):
        a = BlockStream(data, tok, 3, "fp")
        got = [a.next_blocks(cut)]
        b = BlockStream(data, tok, 3, "fp")
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        got.append(b.next_blocks(2 * n + 5 - cut))
        assert torch.equal(torch.cat(got), straight), cut
    c = BlockStream(data, tok, 4, "fp")
    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
        c.load_state_dict(ref.state_dict())


def test_bad_combinations_and_formats_are_one_clear_line(tmp_path, tok):
    for kw in ({"packing": "padding_free"}, {"train_on": "completion"}, {"path": None}):
        with pytest.raises(ValueError, match="data.streaming: true streams plain text blocks"):
            DataConfig(**{"path": str(tmp_path), "streaming": True, **kw})
    assert DataConfig(path="hf:someone/corpus", streaming=True).streaming  # hub names stream (read when trained)
    chats = messages_jsonl(tmp_path / "chat.jsonl", 5)
    stream = BlockStream(DataConfig(path=str(chats), streaming=True, seq_len=16), tok, 0, "fp")
    with pytest.raises(DataError, match=r"chat.jsonl holds messages records; only plain text streams"):
        stream.read(stream.start, 1)
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(json.dumps({"body": "words"}) + "\n")
    stream = BlockStream(DataConfig(path=str(bodies), streaming=True, seq_len=16, format="text"), tok, 0, "fp")
    with pytest.raises(DataError, match=r"^data.text_field: the records of .*bodies.jsonl have no 'text' field "
                       r"\(fields: body\); set data.text_field"):
        stream.read(stream.start, 1)
    holes = tmp_path / "holes.jsonl"
    holes.write_text("".join(json.dumps({"text": None if i == 2 else f"t {i}"}) + "\n" for i in range(5)))
    stream = BlockStream(DataConfig(path=str(holes), streaming=True, seq_len=16), tok, 0, "fp")
    with pytest.raises(DataError, match=r"holes.jsonl, record 3: 'text' is missing"):
        stream.read(stream.start, 1)


def test_the_run_identity_names_streaming_only_when_it_is_on(tmp_path):
    """Checkpoints saved before data.streaming existed still resume; a streamed run resumes only as one."""
    from memfit.config import MemfitConfig
    from memfit.run_context import run_identity

    plain = run_identity(MemfitConfig())["data"]
    assert "streaming" not in plain and "shuffle_buffer" not in plain
    streamed = run_identity(MemfitConfig(data={"path": str(tmp_path), "streaming": True, "shuffle_buffer": 8}))
    assert streamed["data"]["streaming"] is True and streamed["data"]["shuffle_buffer"] == 8


# -- hf:NAME: datasets.load_dataset(NAME, split, streaming=True), offline on a local folder given as the name ----------
@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A folder of two .jsonl shards: load_dataset streams it as one source (split train), the hub's way."""
    root = tmp_path_factory.mktemp("hub")
    for name, texts in (("part-0.jsonl", _texts(260, "h")), ("part-1.jsonl", _texts(190, "i"))):
        (root / name).write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return root


@pytest.fixture
def offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_an_hf_name_streams_the_blocks_of_its_files_given_as_a_path(hub, tok, offline):
    hf = BlockStream(_data(f"hf:{hub}"), tok, 0, "fp")
    assert [where for where, *_ in hf.sources] == [f"hf:{hub}"]  # one source, whatever its shards
    streamed, end = hf.read(hf.start, 10**9)
    local = BlockStream(_data(hub), tok, 0, "fp")
    assert end is None and len(streamed) > 40
    assert torch.equal(torch.from_numpy(np.stack(streamed)),
                       torch.from_numpy(np.stack(local.read(local.start, 10**9)[0])))


def test_an_hf_revision_pins_what_is_read_streamed_or_prepared(hub, tok, offline, monkeypatch):
    """hf:NAME@REVISION passes the revision to load_dataset (a local folder ignores it, so a spy reads it)."""
    import datasets

    from memfit.data.files import hub_name
    from memfit.data.source import source_fingerprint

    assert hub_name("hf:org/corpus@v1.2") == ("org/corpus", "v1.2")
    assert hub_name("hf:org/corpus") == ("org/corpus", None)
    assert hub_name("hf:/data/me@work/corpus") == ("/data/me@work/corpus", None)  # an @ inside a path is a path
    seen, real = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda name, **kw: seen.append((name, kw)) or real(name, **kw))
    pinned = BlockStream(_data(f"hf:{hub}@3f2a9c1"), tok, 0, "fp")
    streamed = pinned.read(pinned.start, 10**9)[0]
    assert len(streamed) > 40
    assert load_texts(DataConfig(path=f"hf:{hub}@3f2a9c1")).format == "text"
    assert [(name, kw.get("revision"), bool(kw.get("streaming"))) for name, kw in seen] == [
        (str(hub), "3f2a9c1", True), (str(hub), "3f2a9c1", False)]
    assert source_fingerprint(_data(f"hf:{hub}@3f2a9c1")) != source_fingerprint(_data(f"hf:{hub}@main"))


def test_an_hf_stream_resumes_at_the_exact_block(hub, tok, offline, monkeypatch):
    monkeypatch.setattr("memfit.data.streaming.BATCH", 32)  # positions of many batches (datasets' state_dict)
    data = _data(f"hf:{hub}", shuffle_buffer=16)
    ref = BlockStream(data, tok, 5, "fp")
    every = ref.read(ref.start, 10**9)[0]
    n = len(every)
    records = []
    for k in (9, 100, 200, n - 1):  # in the first batch of records, the first shard, the second, the last block
        head, pos = ref.read(ref.start, k)
        assert pos is not None
        records.append(pos["record"])
        rest, end = ref.read(json.loads(json.dumps(pos)), 10**9)  # as a checkpoint's state.json keeps it
        assert end is None and all((x == y).all() for x, y in zip(head + rest, every, strict=True)), k
    assert records[0] == 0 and 0 < records[1] < 260 < records[2]  # resumed from datasets' state in each shard
    straight = ref.next_blocks(n + 7)
    a = BlockStream(data, tok, 5, "fp")
    first = a.next_blocks(n - 21)  # the training order, cut in a late window
    b = BlockStream(data, tok, 5, "fp")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(torch.cat([first, b.next_blocks(28)]), straight)


def test_an_hf_name_without_the_split_or_the_text_field_is_one_line(hub, tok, offline, tmp_path):
    def error(**kw: object) -> str:
        stream = BlockStream(_data(**kw), tok, 0, "fp")
        with pytest.raises(DataError) as err:
            stream.read(stream.start, 1)
        assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert re.fullmatch(rf"data\.split: dataset '{hub}' \(data\.path hf:{hub}\) has no split 'validation' "
                        r"\(Bad split: validation\. Available splits: \['train'\]\); set data\.split to one of its "
                        r"splits", error(root=f"hf:{hub}", split="validation"))
    (tmp_path / "bodies").mkdir()
    (tmp_path / "bodies" / "x.jsonl").write_text(json.dumps({"id": 1, "body": "some words"}) + "\n")
    assert error(root=f"hf:{tmp_path / 'bodies'}") == (
        f"data.text_field: the records of hf:{tmp_path / 'bodies'} have no 'text' field (fields: id, body); set "
        "data.text_field to the field holding the text")
    assert error(root=f"hf:{tmp_path / 'nowhere'}").startswith(
        f"data.path: could not load dataset '{tmp_path / 'nowhere'}' split 'train' with datasets.load_dataset (")
