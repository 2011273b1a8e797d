"""Records of every format prepared out of core: bad records named from a worker, nothing read whole."""

from __future__ import annotations

import pytest
from chat_support import TEMPLATE_SPECIALS, bpe_tokenizer, conversation_texts

from memfit import config
from memfit.data import arrow_examples, formats, source
from memfit.data.cache import cached_data
from memfit.data.source import DataSource
from memfit.data.synthetic import synthetic_conversations, synthetic_preference_pairs, write_jsonl
from memfit.data.templates import BUILTIN_TEMPLATES
from memfit.errors import DataError

pytestmark = pytest.mark.unit
_load_whole = formats.load_texts  # the in-memory reader, the oracle (never_whole makes the module's name refuse)


@pytest.fixture(scope="module")
def tok():
    t = bpe_tokenizer(conversation_texts(100), TEMPLATE_SPECIALS["chatml"])
    t.chat_template = BUILTIN_TEMPLATES["chatml"]
    return t


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 16 records, so a few hundred records make many worker jobs."""
    monkeypatch.setattr(arrow_examples, "SLICE", 16)


@pytest.fixture
def never_whole(monkeypatch):
    """The in-memory readers fail if anything calls them: the run must not hold the records."""
    def refuse(*_a, **_k):
        raise AssertionError("the records were read into memory whole")

    monkeypatch.setattr(formats, "load_texts", refuse)
    monkeypatch.setattr(source.DataSource, "corpus", refuse)


def _prepare(tmp_path, tok, path, *sets, objective="sft"):
    cfg = config.load(None, [f"data.path={path}", f"run.work_dir={tmp_path / 'work'}", "data.seq_len=256",
                             "data.num_proc=2", f"train.objective={objective}", *sets])
    return cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)


def _conversations(n):
    return [{"messages": m} for m in synthetic_conversations(n, 5)]


def test_a_bad_record_found_by_a_worker_is_named_by_file_and_line(tmp_path, tok, small_slices, never_whole):
    rows = _conversations(200)
    rows[57]["messages"][0]["role"] = "tool"  # the template knows no such role: found when encoding, in a worker
    long_answer = {"role": "assistant", "content": " ".join(["one two three"] * 200)}
    rows[150]["messages"] = [rows[150]["messages"][0], long_answer]
    path = write_jsonl(rows, tmp_path / "chat.jsonl")
    # Slices are encoded in parallel, but their errors are taken in record order: line 58 before line 151.
    with pytest.raises(DataError, match=r"chat\.jsonl record 58: field 'messages'.*unknown role tool"):
        _prepare(tmp_path, tok, path, "data.train_on=assistant", "data.packing=padding_free",
                 "data.overlong=error")
    rows[57] = _conversations(1)[0]
    write_jsonl(rows, path)
    with pytest.raises(DataError, match=r"data\.overlong: .*chat\.jsonl record 151: field 'messages' is \d+ tokens"):
        _prepare(tmp_path, tok, path, "data.train_on=assistant", "data.packing=padding_free",
                 "data.overlong=error")
    assert not list((tmp_path / "work" / "data-cache").glob("[!.]*/meta.json"))  # nothing half-written was kept


@pytest.mark.parametrize("records", ["messages", "text"])
def test_the_digest_scan_in_workers_is_the_readers_digest(tmp_path, small_slices, never_whole, records):
    """The scan's slices read, checked and rendered for the hash by two workers, hashed in order here: the digest of
    the in-memory reader (blank texts dropped as it drops them), and a bad record named as it names it."""
    from memfit.data.formats import data_digest

    rows = (_conversations(150) if records == "messages"
            else [{"text": "   " if i % 7 == 0 else f"record {i} words"} for i in range(150)])
    path = write_jsonl(rows, tmp_path / "data.jsonl")
    cfg = config.load(None, [f"data.path={path}", f"run.work_dir={tmp_path / 'work'}", "data.num_proc=2",
                             "data.packing=padding_free"])  # not plain text blocks: arrow_examples scans
    scanned = DataSource(cfg.data, cfg.run.work_dir)
    assert scanned.digest() == data_digest(_load_whole(cfg.data))
    assert scanned.known()["examples"] == (150 if records == "messages" else 150 - len(range(0, 150, 7)))
    rows[120] = {"other": 1}  # slice 8 of 10: a worker finds it, the parent names it as the reader does
    rows[130] = {"other": 2}
    write_jsonl(rows, path)
    with pytest.raises(DataError) as new:
        DataSource(cfg.data, cfg.run.work_dir).digest()
    with pytest.raises(DataError) as old:
        _load_whole(cfg.data)
    assert str(new.value) == str(old.value) and "record 121" in str(new.value)


@pytest.mark.parametrize("packing", ["padding_free", "none", "blocks"])
def test_many_slices_give_the_rows_of_one(tmp_path, tok, monkeypatch, packing, never_whole):
    """Slices of 16 records and of the default size: the same rows, held-out prompts and counts."""
    path = write_jsonl(_conversations(150), tmp_path / "chat.jsonl")
    sets = ["data.train_on=assistant", f"data.packing={packing}", "data.heldout_prompts=4", "data.overlong=drop"]
    whole = _prepare(tmp_path / "a", tok, path, *sets)
    monkeypatch.setattr(arrow_examples, "SLICE", 16)
    sliced = _prepare(tmp_path / "b", tok, path, *sets)
    assert whole.train.equal(sliced.train) and whole.val.equal(sliced.val)
    assert all(whole.train_fields[k].equal(sliced.train_fields[k]) for k in whole.train_fields)
    assert whole.heldout == sliced.heldout and whole.stats == sliced.stats
    assert (len(whole.heldout) == 4) == (packing != "blocks")  # blocks cut conversations: none is held out


def test_preference_pairs_out_of_core(tmp_path, tok, small_slices, never_whole):
    path = write_jsonl(synthetic_preference_pairs(120, 2), tmp_path / "pairs.jsonl")
    bundle = _prepare(tmp_path, tok, path, "data.heldout_prompts=2", objective="dpo")
    assert bundle.stats["examples"] == 120 and len(bundle.train) + len(bundle.val) == 120
    assert {"rejected_input_ids", "rejected_labels", "attention_mask"} <= set(bundle.train_fields)
    assert len(bundle.heldout) == 2 and set(bundle.heldout[0]) == {"prompt", "completion"}


def test_records_and_objective_disagree_in_one_line(tmp_path, tok, never_whole):
    path = write_jsonl(_conversations(20), tmp_path / "chat.jsonl")
    with pytest.raises(DataError, match=r"train\.objective: dpo, and .*chat\.jsonl holds messages records"):
        _prepare(tmp_path, tok, path, objective="dpo")


def test_a_folder_mixing_formats_is_refused_in_one_line(tmp_path, tok, never_whole):
    write_jsonl(_conversations(20), tmp_path / "data" / "a.jsonl")
    write_jsonl([{"text": "plain words here"}] * 20, tmp_path / "data" / "b.jsonl")
    with pytest.raises(DataError, match=r"mixes formats \(messages, text\)"):
        _prepare(tmp_path, tok, tmp_path / "data", "data.packing=padding_free")


def test_packing_auto_reads_the_lengths_out_of_core_and_chooses_as_in_memory(tmp_path, tok, small_slices, monkeypatch):
    from transformers import LlamaConfig

    from memfit.data.cache import resolve_auto_packing
    from memfit.data.formats import load_texts

    path = write_jsonl(_conversations(120), tmp_path / "chat.jsonl")
    cfg = config.load(None, [f"data.path={path}", f"run.work_dir={tmp_path / 'work'}", "data.seq_len=256",
                             "data.num_proc=2", "data.train_on=assistant", "data.packing=auto"])
    model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=512)
    corpus = load_texts(cfg.data)  # the in-memory reading, the oracle
    in_memory = resolve_auto_packing(cfg, corpus, "d1", tok, model)
    monkeypatch.setattr(source.DataSource, "corpus", lambda *_: (_ for _ in ()).throw(AssertionError("whole")))
    out_of_core = resolve_auto_packing(cfg, DataSource(cfg.data, cfg.run.work_dir), "d2", tok, model)
    assert out_of_core == in_memory and len(in_memory[1]) >= 2


def test_dpo_estimate_reads_the_longest_pair_a_slice_at_a_time(tmp_path, tok, small_slices):
    from memfit.data.formats import load_texts
    from memfit.data.pairs import encode_pairs

    path = write_jsonl(synthetic_preference_pairs(90, 6), tmp_path / "pairs.jsonl")
    cfg = config.load(None, [f"data.path={path}", "data.seq_len=256", "train.objective=dpo"])
    rows, _, _ = encode_pairs(load_texts(cfg.data), tok, cfg.data, 0)
    whole = max(int(rows[k].sum(-1).max()) for k in ("attention_mask", "rejected_attention_mask"))
    # the shortest prompt: the fewest -100 labels before a trained one, over both sides of every pair
    shortest = min(int((rows[k] == -100).int().cumprod(dim=1).sum(dim=1).min()) for k in ("labels", "rejected_labels"))
    # ...and the pairs kept, as the in-memory encoding keeps them (what dpo.reference auto's coverage counts)
    kept = len(rows["input_ids"])
    assert arrow_examples.longest_pair(cfg.data, tok, str(tmp_path / "arrow")) == (whole, shortest, kept)
    assert 0 < shortest < whole
    short = cfg.data.model_copy(update={"seq_len": 4, "overlong": "drop"})
    with pytest.raises(DataError, match=r"data\.seq_len: .*pairs\.jsonl record 1: field 'prompt'"):
        arrow_examples.longest_pair(short, tok, str(tmp_path / "arrow"))


def _die_or_fail(job):
    import os

    i, payload = job
    if i == 5 and payload == "die":
        os._exit(3)  # a worker killed mid-job (the OOM killer, say)
    if i == 5:
        raise DataError(f"data.path: x.jsonl record {i}: bad")
    return i, len(payload)


@pytest.mark.parametrize("payload", ["fail", "die"])
def test_a_failing_or_dying_worker_is_an_error_not_a_wait(payload):
    """Large jobs (pipes full), a failure in the middle: the error comes back in job order, and nothing hangs."""
    from memfit.data.workers import in_order

    big = "x" * 2_000_000
    jobs = [(i, payload if i == 5 else big) for i in range(40)]
    got: list[int] = []
    expected = r"record 5: bad" if payload == "fail" else r"data\.num_proc: a data preparation worker died"
    with pytest.raises(DataError, match=expected):
        in_order(_die_or_fail, iter(jobs), 2, lambda r: got.append(r[0]))
    assert got == [0, 1, 2, 3, 4]  # everything before the failure, in order, and nothing after it


def _pid_and_pool(before):
    """(this process, how many processes its parent has that it did not have `before`: the pool's workers). By
    pid, not by start time: psutil's start times count from the boot time in whole seconds, so a worker forked
    just now could read as older than a wall-clock time taken before it (this test failed so on one machine)."""
    import os

    import psutil

    parent = psutil.Process(os.getppid())
    return os.getpid(), len([c for c in parent.children() if c.pid not in before])


def test_few_jobs_take_few_workers_and_one_job_none():
    """A small corpus forks nothing (its one slice is encoded here); three slices take three workers, not eight."""
    import os

    import psutil

    from memfit.data.workers import in_order

    got: list[tuple[int, int]] = []
    before = frozenset(c.pid for c in psutil.Process().children())
    in_order(_pid_and_pool, iter([before]), 8, got.append)
    assert [pid for pid, _ in got] == [os.getpid()]
    got.clear()
    in_order(_pid_and_pool, iter([before] * 3), 8, got.append)
    assert len(got) == 3 and os.getpid() not in [pid for pid, _ in got]
    assert max(n for _, n in got) == 3, got  # the pool's size
