"""Data prepared once per data version: fingerprints, the digest kept on disk, bad records named, rows memory-mapped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from chat_support import bpe_tokenizer

from memfit import config
from memfit.data.cache import cached_data
from memfit.data.formats import data_digest, load_texts
from memfit.data.source import DataSource, source_fingerprint
from memfit.data.synthetic import synthetic_corpus, write_jsonl
from memfit.errors import DataError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(synthetic_corpus(200, 3))


def _cfg(tmp_path, path, *sets):
    return config.load(None, [f"data.path={path}", f"run.work_dir={tmp_path / 'work'}", "data.seq_len=32", *sets])


def test_fingerprint_follows_the_bytes_not_the_clock(tmp_path):
    f = write_jsonl([{"text": d} for d in synthetic_corpus(50, 1)], tmp_path / "a.jsonl")
    data = config.DataConfig(path=str(f))
    before = source_fingerprint(data)
    f.touch()
    assert source_fingerprint(data) == before
    f.write_text(f.read_text() + '{"text": "one more"}\n')
    assert source_fingerprint(data) != before
    assert source_fingerprint(data.model_copy(update={"text_field": "body"})) != source_fingerprint(data)


def test_digest_is_the_readers_and_is_kept_for_the_next_process(tmp_path, monkeypatch):
    f = write_jsonl([{"text": d} for d in synthetic_corpus(80, 2)] + [{"text": "  "}], tmp_path / "a.jsonl")
    cfg = _cfg(tmp_path, f)
    assert DataSource(cfg.data, cfg.run.work_dir).digest() == data_digest(load_texts(cfg.data))
    import memfit.data.arrow_text as at

    monkeypatch.setattr(at, "scan_text", lambda *a, **k: pytest.fail("records read again"))
    again = DataSource(cfg.data, cfg.run.work_dir)
    assert again.digest() == data_digest(load_texts(cfg.data)) and again.known()["examples"] == 80


@pytest.mark.parametrize("lines, where", [
    ('{"text": "a b c"}\n\n{"text": "d e"}\n{"other": 1}\n', "record 4"),  # 1-based line, blank lines counted
    ('{"text": "a"}\n{"text": 3}\n', "record 2"),
])
def test_a_bad_record_is_named_by_file_and_line_as_before(tmp_path, lines, where):
    f = tmp_path / "bad.jsonl"
    f.write_text(lines)
    cfg = _cfg(tmp_path, f)
    with pytest.raises(DataError) as old:
        load_texts(cfg.data)
    with pytest.raises(DataError) as new:
        DataSource(cfg.data, cfg.run.work_dir).digest()
    assert str(new.value) == str(old.value)
    assert str(f) in str(new.value) and where in str(new.value) and "data.text_field" in str(new.value)


def test_phases_reuse_the_prepared_rows_without_reading_a_record(tmp_path, tok, monkeypatch, caplog):
    f = write_jsonl([{"text": d} for d in synthetic_corpus(300, 5)], tmp_path / "a.jsonl")
    cfg = _cfg(tmp_path, f, "data.num_proc=2")
    with caplog.at_level(logging.INFO, logger="memfit.data"):
        first = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)
        import memfit.data.arrow_text as at
        import memfit.data.formats as formats

        monkeypatch.setattr(at, "scan_text", lambda *a, **k: pytest.fail("records scanned again"))
        monkeypatch.setattr(formats, "load_texts", lambda *a, **k: pytest.fail("records read again"))
        later = [cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok) for _ in range(4)]
    said = [r.getMessage() for r in caplog.records]
    assert sum("data: prepared in" in m for m in said) == 1
    assert sum("prepared rows reused" in m for m in said) == 4
    assert sum("recognised" in m for m in said) == 1
    for bundle in later:
        assert torch.equal(bundle.train, first.train) and torch.equal(bundle.val, first.val)
    # The rows are a memory map of the file, not a copy in the trainer's memory.
    maps = Path("/proc/self/maps").read_text()
    assert "train.npy" in maps and "val.npy" in maps


def test_a_changed_file_is_prepared_again(tmp_path, tok):
    f = write_jsonl([{"text": d} for d in synthetic_corpus(300, 5)], tmp_path / "a.jsonl")
    cfg = _cfg(tmp_path, f)
    first = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)
    write_jsonl([{"text": d} for d in synthetic_corpus(300, 6)], f)
    second = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)
    assert second.digest != first.digest and not torch.equal(second.train[:4], first.train[:4])


def test_a_new_machine_downloads_the_rows_from_the_checkpoint_store(tmp_path, tok, monkeypatch, caplog):
    from memfit.data import shared
    from memfit.storage import LocalStore

    store = LocalStore(tmp_path / "bucket")  # stands for the remote store a run's machines share
    monkeypatch.setattr(shared, "shared_store", lambda cfg: store)
    f = write_jsonl([{"text": d} for d in synthetic_corpus(300, 5)], tmp_path / "a.jsonl")
    first = cached_data(_cfg(tmp_path, f), DataSource(_cfg(tmp_path, f).data, tmp_path / "work"), None, tok)
    assert any(k.endswith("/meta.json") for k in store.list("data-cache/"))
    other = config.load(None, [f"data.path={f}", f"run.work_dir={tmp_path / 'machine2'}", "data.seq_len=32"])
    import memfit.data.cache as dc

    monkeypatch.setattr(dc, "_prepare_into", lambda *a, **k: pytest.fail("prepared again on the new machine"))
    with caplog.at_level(logging.INFO, logger="memfit.data"):
        second = cached_data(other, DataSource(other.data, other.run.work_dir), None, tok)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert any("reused from the checkpoint store" in r.getMessage() for r in caplog.records)


def test_tokenising_workers_never_signal_the_run(tmp_path, tok):
    """A run listens for SIGTERM through a wakeup pipe (runtime/termination.py) that forked workers inherit: a
    worker stopped because the preparation failed (a bad record met mid-way) must not write there, or the run
    reads it as its own stop."""
    import os
    import signal
    import time

    from memfit.data.arrow_text import _tokenise_to

    def texts():
        yield synthetic_corpus(50, 1)
        time.sleep(0.5)  # the workers are up and idle
        raise DataError("data.text_field: a.jsonl record 7: field 'text' is missing")

    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    seen: list[int] = []
    old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    try:
        with pytest.raises(DataError, match="record 7"):
            _tokenise_to(tmp_path / "t.bin", texts(), tok, 2)
        time.sleep(0.5)
        try:
            written = os.read(r, 64)
        except BlockingIOError:
            written = b""
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGTERM, old_handler)
        os.close(r)
        os.close(w)
    assert written == b"" and seen == []


def _worker_signals(_: int) -> tuple[bool, int]:
    import signal

    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.set_wakeup_fd(-1)


def test_a_worker_dies_on_sigterm_and_writes_to_no_inherited_pipe():
    import multiprocessing
    import os
    import signal

    from memfit.data.workers import quiet_signals

    r, w = os.pipe()
    os.set_blocking(w, False)
    old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    try:
        with multiprocessing.get_context("fork").Pool(1, initializer=quiet_signals) as pool:
            assert pool.apply(_worker_signals, (0,)) == (True, -1)
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGTERM, old_handler)
        os.close(r)
        os.close(w)


def test_a_hub_dataset_is_read_every_time_its_name_may_hide_a_new_version(tmp_path):
    source = DataSource(config.DataConfig(path="hf:someone/corpus"), tmp_path)
    source.remember("d" * 64, "text", 3)
    assert source.known() is None
