"""Plain text records out of core: streamed from Arrow, tokenised in worker processes, packed into blocks on disk."""

# The rows are the bytes packing.tokenize_and_pack + split_blocks write (tests/unit/test_packed_rows_pinned.py); what
# changes is that no process holds the corpus: records are read a batch at a time, the token ids go to a file, and
# the blocks are written to .npy files the trainer memory-maps.

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.config import DataConfig
from memfit.data.files import blank_data
from memfit.data.workers import in_order
from memfit.errors import DataError

log = logging.getLogger("memfit.data")
BATCH = 2048  # records a worker tokenises at once: big enough for the Rust tokenizer, small next to the corpus


@dataclass
class Scanned:
    digest: str  # formats.data_digest of the texts
    examples: int  # non-blank texts


def _is_text(columns: list[str], data: DataConfig) -> bool:
    if data.format not in ("auto", "text"):
        return False
    if data.format == "text":
        return data.text_field in columns
    return (data.chosen_field not in columns and data.messages_field not in columns
            and not (data.prompt_field in columns and data.completion_field in columns)
            and data.text_field in columns)


def _sources(data: DataConfig, cache_dir: str, quiet: bool = False) -> list[tuple[str, Any, str, str]] | None:
    """(where, dataset, suffix, text field) of every source when all hold plain text records, else None (the
    in-memory reader handles them, and names what is wrong)."""
    import pyarrow as pa

    from memfit.data.formats import _tables, detect_format

    out = []
    for where, ds, suffix in _tables(data, cache_dir):
        if ds.num_rows == 0:
            continue
        field = "text" if suffix == ".txt" else data.text_field
        if suffix != ".txt":
            if not _is_text(list(ds.column_names), data):
                return None
            if not quiet:  # logs the recognition, as the reader does (once: the scan, not the packing)
                detect_format(list(ds.column_names), data, where)
        kind = ds.data.schema.field(field).type if field in ds.data.schema.names else None
        if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)) or ds._indices is not None:
            return None
        out.append((where, ds, suffix, field))
    return out


def _batches(ds: Any, field: str) -> Iterator[Any]:
    """The text column a record batch at a time, read from the Arrow files with plain reads: a memory map would
    leave every page it touched counted in this process's memory."""
    import pyarrow as pa

    files = [f["filename"] for f in ds.cache_files]
    if files:
        for name in files:
            with pa.OSFile(name) as src:
                reader = pa.ipc.open_stream(src)
                for batch in reader:
                    yield batch.column(batch.schema.get_field_index(field))
        return
    for batch in ds.data.table.select([field]).to_batches(max_chunksize=BATCH):
        yield batch.column(0)


def _missing(where: str, suffix: str, field: str, record: int, n_rows: int) -> DataError:
    from memfit.data.formats import _bad, record_lines

    n = int(record_lines(Path(where), suffix, n_rows)[record])
    return _bad("text_field", where, n, field, "is missing", "every text record needs a string there (or set "
                "data.format and the data.*_field names)")


def _texts(sources: list[tuple[str, Any, str, str]]) -> Iterator[list[str]]:
    """Non-blank texts in record order, BATCH at most a list; a missing text is named by file and record."""
    for where, ds, suffix, field in sources:
        seen = 0
        for column in _batches(ds, field):
            if column.null_count:
                first = next(i for i, v in enumerate(column.is_valid().to_pylist()) if not v)
                raise _missing(where, suffix, field, seen + first, ds.num_rows)
            for start in range(0, len(column), BATCH):
                texts = [t for t in column.slice(start, BATCH).to_pylist() if t.strip()]
                if texts:
                    yield texts
            seen += len(column)


def scan_text(data: DataConfig, cache_dir: str | None = None) -> Scanned | None:
    """Check plain text records and digest them (as formats.data_digest does) without holding them; None when
    the source is not plain text records."""
    from memfit.data.formats import add_items

    if data.path is None:
        return None
    with tempfile.TemporaryDirectory(prefix="memfit-datasets-") as tmp:
        sources = _sources(data, cache_dir or tmp)
        if sources is None:
            return None
        h, n = hashlib.sha256(), 0
        for texts in _texts(sources):
            add_items(h, texts)
            n += len(texts)
    if n == 0:
        raise blank_data(Path(data.path))
    return Scanned(h.hexdigest(), n)


_TOKENIZER: Any = None


def _encode(texts: list[str]) -> bytes:
    ids = _TOKENIZER(texts, add_special_tokens=False, verbose=False)["input_ids"]
    eos = _TOKENIZER.memfit_eos
    flat = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)
    return flat.tobytes()


def _tokenise_to(path: Path, texts: Iterator[list[str]], tokenizer: Any, num_proc: int) -> int:
    """Token ids of every text, each followed by eos, appended to `path` as int32; the number written."""
    global _TOKENIZER
    from memfit.data.masking import eos_id

    _TOKENIZER = tokenizer
    tokenizer.memfit_eos = eos_id(tokenizer)
    written = [0]
    with path.open("wb") as out:
        def sink(raw: bytes) -> None:
            out.write(raw)
            written[0] += len(raw) // 4

        in_order(_encode, texts, num_proc, sink)  # forked workers inherit the tokenizer
    return written[0]


def _write_rows(dest: Path, tokens: Path, rows: np.ndarray, seq_len: int) -> None:
    """Blocks `rows` of the token file, in that order, as an int64 .npy; written by plain reads and writes."""
    width = seq_len * 4
    with dest.open("wb") as out, tokens.open("rb") as src:
        np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False,
                                                   "shape": (len(rows), seq_len)})
        fd = src.fileno()
        for start in range(0, len(rows), 4096):
            chunk = rows[start:start + 4096]
            raw = b"".join(os.pread(fd, width, int(r) * width) for r in chunk)
            out.write(np.frombuffer(raw, dtype=np.int32).astype(np.int64).tobytes())


def prepare_text_blocks(data: DataConfig, tokenizer: Any, out_dir: Path, num_proc: int, cache_dir: str | None = None
                        ) -> tuple[int, int] | None:
    """train.npy and val.npy in `out_dir` (blocks of data.seq_len, split seeded as split_blocks does); (train,
    val) rows, or None when the source is not plain text records."""
    import torch

    from memfit.data.packing import val_count

    with tempfile.TemporaryDirectory(prefix="memfit-datasets-", dir=out_dir) as tmp:
        sources = _sources(data, cache_dir or tmp, quiet=True)
        if sources is None:
            return None
        tokens = Path(tmp) / "tokens.int32"
        total = _tokenise_to(tokens, _texts(sources), tokenizer, num_proc)
        seq_len = data.seq_len
        n = total // seq_len
        if n < 2:
            raise DataError(f"data.seq_len: only {total} tokens, fewer than 2 blocks of {seq_len} "
                            "(one for training, one for validation): lower data.seq_len or add data")
        n_val = val_count(n, data.val_fraction)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(data.seed)).numpy()
        _write_rows(out_dir / "train.npy", tokens, order[n_val:], seq_len)
        _write_rows(out_dir / "val.npy", tokens, order[:n_val], seq_len)
    return n - n_val, n_val
