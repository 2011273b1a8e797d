"""Records of every format out of core: read a slice at a time from Arrow, encoded in workers, packed on disk."""

# The rows are the bytes prepare.prepare_data makes (tests/unit/test_packed_rows_pinned.py runs both); what changes
# is that no process holds the records or their tokens: a slice of records becomes Python objects at a time, worker
# processes encode slices (templates, masks, overlong), the token ids and labels go to files, and the rows are
# gathered from those files into the .npy files the trainer memory-maps. Only small per-example arrays (lengths,
# indices) and the padding-free bins stay in memory.

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.config import DataConfig, MemfitConfig
from memfit.data.files import blank_data
from memfit.data.packed_files import Flat, write_rows
from memfit.data.workers import in_order
from memfit.errors import DataError

log = logging.getLogger("memfit.data")
SLICE = 2048  # records a worker reads and encodes at once


@dataclass
class Scanned:
    digest: str  # formats.data_digest of the records
    format: str
    examples: int


@dataclass(frozen=True)
class RawSlice:
    """Up to SLICE records of one source as they lie in its Arrow file, for a worker to decode, check and normalise:
    the parent only reads Arrow batches, so it is not the serial part of a many-core preparation."""

    where: str  # the source file (or folder, dataset) the records are named by
    fmt: str
    data: DataConfig  # the reader settings for this source (a .txt file's text field is "text")
    numbers: list[int]  # each record's number as an editor shows it
    arrow: bytes | None = None  # the records as one Arrow IPC stream, decoded by `features`...
    features: Any = None
    rows: list[dict[str, Any]] | None = None  # ...or already decoded (datasets' own reads)

    def examples(self) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
        """The records checked and normalised (formats.normalise) with their origins; blank texts dropped as
        load_texts drops them."""
        from memfit.data.formats import normalise

        rows = self.rows if self.rows is not None else _decoded(self.arrow, self.features)
        examples = normalise(rows, self.fmt, self.data, self.where, self.numbers)
        origins = [(self.where, n) for n in self.numbers]
        if self.fmt == "text":
            keep = [i for i, e in enumerate(examples) if e["text"].strip()]
            examples, origins = [examples[i] for i in keep], [origins[i] for i in keep]
        return examples, origins


def _decoded(arrow: bytes | None, features: Any) -> list[dict[str, Any]]:
    import pyarrow as pa

    batch = pa.ipc.open_stream(pa.py_buffer(arrow)).read_next_batch()
    # decoded by the features as datasets' own to_list decodes them (a field of mixed JSON types is stored as JSON
    # text: 3 must come back as 3, for the record checks to name it)
    columns = features.decode_batch(batch.to_pydict())
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def _slices(data: DataConfig, cache_dir: str, quiet: bool = False, tables: list[Any] | None = None
            ) -> Iterator[RawSlice]:
    """Every record of data.path, SLICE at a time, in load_texts' order, as read (RawSlice.examples checks and
    normalises them). `tables` collects (where, rows) of each source read, for finding a record again by its
    index."""
    from memfit.data.formats import _tables, detect_format, record_lines

    seen: str | None = None
    for where, ds, suffix in _tables(data, cache_dir):
        if ds.num_rows == 0:
            continue
        is_txt = suffix == ".txt"  # paragraphs are text whatever data.format says for the other files
        fmt = "text" if is_txt else detect_format(list(ds.column_names), data, where, quiet=quiet)
        if seen is not None and fmt != seen:
            raise DataError(f"data.path: {data.path} mixes formats ({', '.join(sorted({fmt, seen}))}); "
                            "keep one format per run (or set data.format)")
        seen = fmt
        cfg = data.model_copy(update={"text_field": "text"}) if is_txt else data
        numbers = record_lines(Path(where), suffix, ds.num_rows)
        if tables is not None:
            tables.append((where, ds))
        start = 0
        for raw in _raw(ds):
            n, records = ((len(raw), {"rows": raw}) if isinstance(raw, list)
                          else (raw.num_rows, {"arrow": _ipc(raw), "features": ds.features}))
            yield RawSlice(where, fmt, cfg, numbers[start:start + n].tolist(), **records)
            start += n


def _raw(ds: Any) -> Iterator[Any]:
    """The records SLICE at most at a time, in order: Arrow record batches read from datasets' Arrow files with
    plain reads where it can (a memory map would leave every page it touched counted in this process's memory,
    which then grows with the corpus; arrow_text reads its column the same way), else lists of dicts."""
    import pyarrow as pa

    files = [f["filename"] for f in ds.cache_files]
    if not files or ds._indices is not None:  # in memory, or a selection of the files' rows: datasets' own reads
        for start in range(0, ds.num_rows, SLICE):
            yield ds.select(range(start, min(start + SLICE, ds.num_rows))).to_list()
        return
    for name in files:
        with pa.OSFile(name) as src:
            for batch in pa.ipc.open_stream(src):
                for start in range(0, batch.num_rows, SLICE):
                    yield batch.slice(start, SLICE)


def _ipc(batch: Any) -> bytes:
    """A batch slice as Arrow IPC bytes: pickling a slice would carry its whole parent batch's buffers."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _items(fmt: str, examples: list[dict[str, Any]]) -> list[str]:
    return [e["text"] for e in examples] if fmt == "text" else [
        json.dumps({"format": fmt, **e}, sort_keys=True) for e in examples]


def _digest_slice(raw: RawSlice) -> tuple[int, bytes]:
    """(examples, what formats.add_items would feed the hash for them)."""
    from memfit.data.formats import items_bytes

    examples, _ = raw.examples()
    return len(examples), items_bytes(_items(raw.fmt, examples))


def scan_records(data: DataConfig, cache_dir: str, num_proc: int = 1) -> Scanned | None:
    """Check every record and digest them (as formats.Corpus.digest does) a slice at a time, the slices read,
    checked and rendered for the hash by num_proc workers and hashed here in order; None for the synthetic corpus
    (no data.path)."""
    if data.path is None:
        return None
    h, n, fmt_seen = hashlib.sha256(), [0], []

    def sink(result: tuple[int, bytes]) -> None:
        h.update(result[1])
        n[0] += result[0]

    in_order(_digest_slice, _formats(_slices(data, cache_dir), fmt_seen), num_proc, sink)
    if n[0] == 0:
        raise blank_data(Path(data.path))
    return Scanned(h.hexdigest(), fmt_seen[0], n[0])


def _formats(slices: Iterator[RawSlice], seen: list[str]) -> Iterator[RawSlice]:
    """The slices, the first one's format noted in `seen` (a source holds one format)."""
    for raw in slices:
        if not seen:
            seen.append(raw.fmt)
        yield raw


_TOKENIZER: Any = None
_DATA: Any = None


def _arr(values: Any, dtype: Any = np.int32) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def _encode_slice(raw: RawSlice) -> dict[str, Any]:
    """One slice read, checked and encoded as prepare_data encodes the whole: flat ids/labels and lengths per side,
    kept indices (within the slice; the sink makes them global), counts."""
    from memfit.data.formats import Corpus
    from memfit.data.masking import encode_counted, fit_overlong

    examples, origins = raw.examples()
    fmt, data = raw.fmt, _DATA
    corpus = Corpus([], fmt, examples, origins)
    if fmt == "preference":
        from memfit.data.pairs import encode_sides

        chosen, rejected, index, counts = encode_sides(corpus, _TOKENIZER, data)
        sides, no_answer = {"": chosen, "rejected_": rejected}, 0
    else:
        encoded, no_answer = encode_counted(corpus, _TOKENIZER, data) if examples else ([], 0)
        counts = {"truncated": 0, "dropped": 0}
        index = list(range(len(encoded)))
        if data.packing != "blocks":
            field = {"messages": data.messages_field, "prompt_completion": data.completion_field}.get(
                fmt, data.text_field)
            encoded, index, counts = fit_overlong(encoded, origins, data.seq_len, data.overlong, field)
        sides = {"": encoded}
    out: dict[str, Any] = {"index": _arr(index, np.int64), "counts": counts, "no_answer": no_answer,
                           "examples": len(examples)}
    for side, encoded in sides.items():
        out[side + "ids"] = _arr([t for ids, _ in encoded for t in ids])
        out[side + "labels"] = _arr([t for _, labels in encoded for t in labels])
        out[side + "lengths"] = _arr([len(ids) for ids, _ in encoded])
    return out


def _lengths_slice(raw: RawSlice) -> tuple[bytes, bytes]:
    """One slice's example lengths and trained tokens as packed rows would hold them (data.packing auto)."""
    from memfit.data.formats import Corpus
    from memfit.data.layout import example_lengths
    from memfit.data.masking import encode_counted

    examples, origins = raw.examples()
    if not examples:
        return b"", b""
    encoded, _ = encode_counted(Corpus([], raw.fmt, examples, origins), _TOKENIZER, _DATA)
    lengths, trained = example_lengths(encoded, origins, _DATA)
    return _arr(lengths), _arr(trained)


def example_lengths(data: DataConfig, tokenizer: Any, num_proc: int, cache_dir: str
                    ) -> tuple[list[int], list[int], str] | None:
    """(tokens, trained tokens, format) of every example of data.path, read and encoded a slice at a time by
    num_proc workers, for data.packing auto; None for the synthetic corpus."""
    global _TOKENIZER, _DATA
    if data.path is None:
        return None
    lengths: list[int] = []
    trained: list[int] = []
    fmt_seen: list[str] = []

    def sink(result: tuple[bytes, bytes]) -> None:
        lengths.extend(np.frombuffer(result[0], dtype=np.int32).tolist())
        trained.extend(np.frombuffer(result[1], dtype=np.int32).tolist())

    _TOKENIZER, _DATA = tokenizer, data
    try:
        _encode_all(_formats(_slices(data, cache_dir, quiet=True), fmt_seen), num_proc, sink, _lengths_slice)
    finally:
        _TOKENIZER = _DATA = None
    if not lengths:
        raise blank_data(Path(data.path))
    return lengths, trained, fmt_seen[0]


def longest_pair(data: DataConfig, tokenizer: Any, cache_dir: str) -> tuple[int, int, int] | None:
    """(the tokens of the longest side of any pair, the tokens of the shortest prompt before a trained token, the
    pairs kept) of data.path as rows hold them, read a slice at a time in this process; None for synthetic pairs."""
    from memfit.data.formats import Corpus
    from memfit.data.pairs import check_kept, encode_sides

    if data.path is None:
        return None
    longest = kept = 0
    shortest = data.seq_len
    for raw in _slices(data, cache_dir, quiet=True):
        examples, origins = raw.examples()
        chosen, rejected, index, _ = encode_sides(Corpus([], raw.fmt, examples, origins), tokenizer, data)
        longest = max([longest, *(len(ids) for ids, _ in chosen + rejected)])
        shortest = min([shortest, *(prompt_tokens(labels) for _, labels in chosen + rejected)])
        kept += len(index)
    check_kept(kept, {"truncated": 0, "dropped": 0}, data)  # no pair left: the estimate says why in one line
    return longest, shortest, kept


def prompt_tokens(labels: list[int]) -> int:
    """The tokens before a side's first trained one (its prompt); its whole length when none is trained."""
    return next((i for i, label in enumerate(labels) if label != -100), len(labels))


def _encode_all(jobs: Iterator[Any], num_proc: int, sink: Any, work: Any = None) -> None:
    """Every slice through `work` (_encode_slice) in order, in num_proc forked workers (workers.in_order)."""
    in_order(work or _encode_slice, jobs, num_proc, sink)


class _Sink:
    """The encoded slices appended to flat files per side, their lengths and kept indices kept as arrays."""

    def __init__(self, folder: Path, sides: list[str]) -> None:
        self.flats = {side: Flat(folder, side) for side in sides}
        self.index: list[np.ndarray] = []
        self.counts = {"truncated": 0, "dropped": 0}
        self.no_answer = self.examples = 0

    def __call__(self, result: dict[str, Any]) -> None:
        for side, flat in self.flats.items():
            flat.append(result[side + "ids"], result[side + "labels"], result[side + "lengths"])
        # results come in record order: the examples before this slice make its indices global
        self.index.append(np.frombuffer(result["index"], dtype=np.int64) + self.examples)
        for k in self.counts:
            self.counts[k] += result["counts"][k]
        self.no_answer += result["no_answer"]
        self.examples += result["examples"]

    def kept(self) -> np.ndarray:
        return np.concatenate(self.index) if self.index else np.zeros(0, dtype=np.int64)


def prepare_examples(cfg: MemfitConfig, tokenizer: Any, out_dir: Path, num_proc: int, cache_dir: str,
                     digest: str) -> bool:
    """The packed rows of data.path (.npy files and meta.json in `out_dir`), as prepare_data packs them; False for
    the synthetic corpus (prepared in memory: it is small)."""
    global _TOKENIZER, _DATA
    from memfit.data.masking import eos_id, warn_no_answer
    from memfit.data.packed_files import pack_plan
    from memfit.data.pairs import check_kept

    data = cfg.data
    if data.path is None:
        return False
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = int(pad_id) if pad_id is not None else eos_id(tokenizer)
    fmt_seen: list[str] = []
    tables: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="memfit-encoded-", dir=out_dir) as tmp:
        sides = ["", "rejected_"] if cfg.train.objective == "dpo" else [""]
        sink = _Sink(Path(tmp), sides)
        _TOKENIZER, _DATA = tokenizer, data
        try:
            slices = _checked(_slices(data, cache_dir, quiet=True, tables=tables), cfg)
            _encode_all(_formats(slices, fmt_seen), num_proc, sink)
        finally:
            _TOKENIZER = _DATA = None
        if not sink.examples:
            raise blank_data(Path(data.path))
        fmt = fmt_seen[0]
        warn_no_answer(sink.no_answer)
        if fmt == "preference":
            check_kept(len(sink.kept()), sink.counts, data)
        try:
            plan = pack_plan(fmt, data, sink, pad_id)
            written = write_rows(plan, out_dir, data.val_fraction, data.seed, num_proc)
        finally:
            for flat in sink.flats.values():
                flat.release()
        stats = plan.stats
        stats["trained_tokens_share"] = round(written.trained_share, 4)
        heldout = _heldout(fmt, plan, written.val_order, data, tables)
        from memfit.files import write_json_atomic

        write_json_atomic(out_dir / "meta.json", {"digest": digest, "source": data.path, "packing": data.packing,
                                                  "heldout": heldout, "stats": stats})
    log.info("data: %d %s example(s), packing %s into %d training + %d validation rows of %d tokens; trained "
             "tokens (train_on %s): %.1f%% of the training rows' tokens (out of core, %d process(es))",
             stats["examples"], fmt, data.packing, written.n_train, written.n_val, data.seq_len, data.train_on,
             100 * written.trained_share, num_proc)
    return True


def _checked(slices: Iterator[RawSlice], cfg: MemfitConfig) -> Iterator[RawSlice]:
    """The objective and the records agree (as prepare_data checks), told at the first slice."""
    for i, raw in enumerate(slices):
        if i == 0 and (cfg.train.objective == "dpo") != (raw.fmt == "preference"):
            raise DataError(f"train.objective: {cfg.train.objective}, and {cfg.data.path} holds {raw.fmt} records; "
                            "dpo trains on preference pairs (records with chosen and rejected fields, or "
                            "data.format: preference without data.path for synthetic ones), sft on the others")
        yield raw


def _heldout(fmt: str, plan: Any, val_order: np.ndarray, data: DataConfig, tables: list[Any]
             ) -> list[dict[str, Any]]:
    """Held-out examples as prepare._heldout picks them (the validation rows' examples, in row order), read back
    by their index from the Arrow tables: records are never all held."""
    from memfit.data.formats import normalise

    n = data.heldout_prompts
    if fmt == "text" or n == 0 or plan.members is None:
        return []
    wanted: list[int] = []
    for row in val_order.tolist():
        for i in plan.members(row):
            wanted.append(int(plan.kept[i]))
            if len(wanted) == n:
                break
        if len(wanted) == n:
            break
    out = []
    for g in wanted:  # records are not dropped outside text, so a global index is a table and a row
        for where, ds in tables:
            if g < ds.num_rows:
                row = ds.select([g]).to_list()
                e = normalise(row, fmt, data, where)[0]
                break
            g -= ds.num_rows
        if "chosen" in e:  # a pair is held out as its prompt and the chosen answer
            e = ({"prompt": e["prompt"], "completion": e["chosen"]} if isinstance(e["prompt"], str)
                 else {"messages": [*e["prompt"], *e["chosen"]]})
        out.append(e)
    return out
