"""The packed rows of every format, mask and packing choice, pinned byte for byte to digests recorded before #40."""

# The data path was rebuilt (out of core, prepared once); this guard says the rows a run trains on did not move.
# Record again only on purpose: MEMFIT_RECORD_PACKED=1 pytest tests/unit/test_packed_rows_pinned.py.

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from chat_support import TEMPLATE_SPECIALS, bpe_tokenizer, conversation_texts, messages_jsonl

from memfit import config
from memfit.data.prepare import DataBundle, prepare_data
from memfit.data.synthetic import (
    synthetic_corpus,
    synthetic_preference_pairs,
    synthetic_prompt_completions,
    write_jsonl,
    write_parquet,
)
from memfit.data.templates import BUILTIN_TEMPLATES

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).parents[1] / "fixtures" / "packed_rows.json"


def _digest(bundle: DataBundle) -> str:
    h = hashlib.sha256()
    tensors = {"train": bundle.train, "val": bundle.val, **{f"train.{k}": v for k, v in bundle.train_fields.items()},
               **{f"val.{k}": v for k, v in bundle.val_fields.items()}}
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    rest = {"digest": bundle.digest, "heldout": bundle.heldout, "stats": bundle.stats, "packing": bundle.packing,
            "tokens": [bundle.n_train_tokens, bundle.n_val_tokens]}
    h.update(json.dumps(rest, sort_keys=True).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tok():
    texts = conversation_texts(200) + synthetic_corpus(200, 3)
    texts += [p["prompt"] + p["chosen"] for p in synthetic_preference_pairs(100, 0)]
    t = bpe_tokenizer(texts, TEMPLATE_SPECIALS["chatml"])
    t.chat_template = BUILTIN_TEMPLATES["chatml"]
    return t


def _sources(root: Path) -> dict[str, Path]:
    """One source per format the readers handle, written by the shipped synthetic generators."""
    docs = synthetic_corpus(300, 7)
    texts = [{"text": d} for d in docs] + [{"text": "   "}]  # a blank record is dropped
    pcs = synthetic_prompt_completions(200, 1)
    out = {"text_jsonl": write_jsonl(texts, root / "text.jsonl"),
           "text_parquet": write_parquet(texts[:150], root / "text.parquet"),
           "pc_parquet": write_parquet(pcs, root / "pc.parquet"),
           "messages_jsonl": messages_jsonl(root / "chat.jsonl", 150, seed=2),
           "pref_jsonl": write_jsonl(synthetic_preference_pairs(120, 4), root / "pairs.jsonl")}
    txt = root / "paras.txt"
    txt.write_text("\n\n".join(d.replace(" ", "\n", 1) for d in docs[:120]) + "\n")
    out["txt"] = txt
    csv = root / "pc.csv"
    import csv as csvlib

    with csv.open("w", newline="") as f:
        w = csvlib.DictWriter(f, fieldnames=["prompt", "completion"])
        w.writeheader()
        w.writerows(pcs[:120])
    out["pc_csv"] = csv
    folder = root / "mixed"
    write_jsonl(texts[:80], folder / "a" / "one.jsonl")
    (folder / "b.txt").write_text("\n\n".join(docs[200:260]) + "\n")
    out["text_folder"] = folder
    import datasets

    chats = [json.loads(line) for line in (root / "chat.jsonl").read_text().splitlines()[:100]]
    datasets.Dataset.from_list(chats).save_to_disk(str(root / "saved_chat"))
    out["saved_messages"] = root / "saved_chat"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(texts[:200])}).save_to_disk(str(root / "saved_dd"))
    out["saved_dict_text"] = root / "saved_dd"
    return out


# (name, source, data settings, objective): every format with the answer-only masks and packing choices.
CASES = [
    ("synthetic_blocks", None, {}, "sft"),
    ("synthetic_pairs", None, {"format": "preference"}, "dpo"),
    ("text_blocks", "text_jsonl", {}, "sft"),
    ("text_padding_free", "text_jsonl", {"packing": "padding_free"}, "sft"),
    ("text_none", "text_jsonl", {"packing": "none", "overlong": "truncate"}, "sft"),
    ("text_drop", "text_jsonl", {"packing": "padding_free", "overlong": "drop", "seq_len": 40}, "sft"),
    ("text_parquet", "text_parquet", {}, "sft"),
    ("txt_paragraphs", "txt", {}, "sft"),
    ("folder_txt_jsonl", "text_folder", {}, "sft"),
    ("saved_dict_text", "saved_dict_text", {}, "sft"),
    ("pc_blocks_all", "pc_parquet", {}, "sft"),
    ("pc_completion_padding_free", "pc_parquet", {"train_on": "completion", "packing": "padding_free"}, "sft"),
    ("pc_completion_none", "pc_parquet", {"train_on": "completion", "packing": "none"}, "sft"),
    ("pc_completion_blocks", "pc_parquet", {"train_on": "completion", "packing": "blocks"}, "sft"),
    ("pc_csv", "pc_csv", {"train_on": "completion", "packing": "padding_free"}, "sft"),
    ("messages_assistant_pf", "messages_jsonl", {"train_on": "assistant", "packing": "padding_free"}, "sft"),
    ("messages_completion_none", "messages_jsonl", {"train_on": "completion", "packing": "none"}, "sft"),
    ("messages_all_blocks", "messages_jsonl", {"train_on": "all", "packing": "blocks"}, "sft"),
    ("saved_messages", "saved_messages", {"train_on": "assistant", "packing": "padding_free"}, "sft"),
    ("pref_pairs", "pref_jsonl", {}, "dpo"),
]


@pytest.fixture(scope="module")
def digests(tok, tmp_path_factory):
    sources = _sources(tmp_path_factory.mktemp("sources"))
    out = {}
    for name, source, data, objective in CASES:
        data = {"seq_len": 64, "val_fraction": 0.2, "seed": 11, "synthetic_docs": 120, "heldout_prompts": 3, **data}
        if source is not None:
            data["path"] = str(sources[source])
        cfg = config.MemfitConfig.model_validate({"data": data, "train": {"objective": objective}})
        bundle = prepare_data(cfg, tok)
        assert bundle.train.shape[0] >= 1 and bundle.val.shape[0] >= 1, name
        out[name] = _digest(bundle)
    return out


def test_packed_rows_are_byte_identical_to_the_recorded_ones(digests):
    if os.environ.get("MEMFIT_RECORD_PACKED") == "1":
        FIXTURE.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(FIXTURE.read_text())
    assert set(recorded) == {c[0] for c in CASES}
    moved = [name for name in recorded if recorded[name] != digests[name]]
    assert not moved, f"packed rows changed for {moved}"


@pytest.mark.parametrize(("num_proc", "chunk"), [(1, None), (2, None), (2, 3)])
def test_prepared_once_through_the_cache_gives_the_same_rows(tok, tmp_path_factory, num_proc, chunk, caplog,
                                                             monkeypatch):
    """The way a run prepares (a DataSource, records out of core in every format, one process or two workers, .npy
    memory-mapped): the recorded bytes, the held-out prompts and the counts included. Chunks of 3 rows: the
    workers write many chunks of each file, each at its own place."""
    from memfit.data import packed_files
    from memfit.data.cache import cached_data
    from memfit.data.source import DataSource

    if chunk:
        monkeypatch.setattr(packed_files, "CHUNK", chunk)

    sources = _sources(tmp_path_factory.mktemp("sources"))
    recorded = json.loads(FIXTURE.read_text())
    work = tmp_path_factory.mktemp("work")
    for name, source, data, objective in CASES:
        if source is None:
            continue
        data = {"seq_len": 64, "val_fraction": 0.2, "seed": 11, "synthetic_docs": 120, "heldout_prompts": 3,
                "num_proc": num_proc, "path": str(sources[source]), **data}
        cfg = config.MemfitConfig.model_validate({"data": data, "train": {"objective": objective},
                                                  "run": {"work_dir": str(work / name)}})
        with caplog.at_level("INFO", logger="memfit.data"):
            caplog.clear()
            first = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)
            second = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), None, tok)
        assert _digest(first) == _digest(second) == recorded[name], name
        said = [r.getMessage() for r in caplog.records]
        assert sum("data: prepared in" in m for m in said) == 1 and sum("reused" in m for m in said) == 1, said
        assert sum("recognised" in m for m in said) <= 1, said
        assert sum("out of core" in m for m in said) == 1, said  # never the in-memory path


def test_digest_sees_a_one_token_change(tok, tmp_path):
    path = write_jsonl([{"text": d} for d in synthetic_corpus(100, 7)], tmp_path / "t.jsonl")
    cfg = config.MemfitConfig.model_validate({"data": {"path": str(path), "seq_len": 32}})
    bundle = prepare_data(cfg, tok)
    before = _digest(bundle)
    bundle.train = bundle.train.clone()
    bundle.train[0, 0] += 1
    assert _digest(bundle) != before
    assert torch.equal(prepare_data(cfg, tok).val, bundle.val)
