"""Encoded examples in flat files, and the packed rows gathered from them into .npy files a chunk at a time."""

# The layouts are packing.py's (pack_blocks, pack_padding_free, pack_padded, split_rows), computed from files
# instead of lists: the same bins, the same seeded split, the same bytes. Reads are plain preads, never a memory
# map, so the pages read do not stay counted in this process's memory.

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from memfit.config import DataConfig
from memfit.data.masking import IGNORE
from memfit.errors import DataError

CHUNK = 1024  # rows gathered at once


class Flat:
    """One side's token ids and labels (int32, back to back) and each example's length."""

    def __init__(self, folder: Path, side: str) -> None:
        self.paths = (folder / f"{side}ids.int32", folder / f"{side}labels.int32")
        self.files = [p.open("wb") for p in self.paths]
        self._lengths: list[np.ndarray] = []
        self.fds: tuple[int, int] | None = None

    def append(self, ids: bytes, labels: bytes, lengths: bytes) -> None:
        self.files[0].write(ids)
        self.files[1].write(labels)
        self._lengths.append(np.frombuffer(lengths, dtype=np.int32))

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.lengths = (np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)).astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.readers = [p.open("rb") for p in self.paths]
        self.fds = (self.readers[0].fileno(), self.readers[1].fileno())

    def release(self) -> None:
        for f in getattr(self, "readers", []):
            f.close()

    def span(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n tokens from token `start`: (ids, labels)."""
        assert self.fds is not None
        return tuple(np.frombuffer(os.pread(fd, 4 * n, 4 * start), dtype=np.int32) for fd in self.fds)  # type: ignore

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.span(int(self.offsets[i]), int(self.lengths[i]))

    def examples(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples `which`, in that order, back to back: (ids, labels). One pread each, one array a side."""
        assert self.fds is not None
        spans = list(zip((4 * self.offsets[which]).tolist(), (4 * self.lengths[which]).tolist(), strict=True))
        return tuple(np.frombuffer(b"".join([os.pread(fd, n, at) for at, n in spans]), dtype=np.int32)
                     for fd in self.fds)  # type: ignore[return-value]


@dataclass
class Plan:
    """The rows to write: how many, which fields, and how to fill a chunk of them."""

    n_rows: int
    seq_len: int
    fields: list[str]  # "input_ids" first
    fill: Callable[[list[int], dict[str, np.ndarray]], None]
    stats: dict[str, Any]
    kept: np.ndarray  # kept example -> global example index
    members: Callable[[int], list[int]] | None = None  # a row's kept examples, for held-out prompts


def pack_plan(fmt: str, data: DataConfig, sink: Any, pad_id: int) -> Plan:
    """packing.py's layouts over the encoded files: blocks, padding-free bins, one (padded) example or pair a row."""
    from memfit.data.packing import _bins

    for flat in sink.flats.values():
        flat.close()
    main, seq_len, kept = sink.flats[""], data.seq_len, sink.kept()
    if fmt == "preference":
        stats = {**sink.counts, "format": "preference", "examples": len(kept), "pad_id": pad_id}
        rej = sink.flats["rejected_"]
        names = ["input_ids", "labels", "attention_mask"]

        def fill_pairs(rows: list[int], out: dict[str, np.ndarray]) -> None:
            for side, flat in (("", main), ("rejected_", rej)):
                _padded(flat, rows, [out[side + n] for n in names], pad_id)

        return Plan(len(kept), seq_len, names + ["rejected_" + n for n in names], fill_pairs, stats, kept,
                    lambda r: [r])
    if data.packing == "blocks":
        plain = fmt == "text" and data.train_on == "all"
        total = int(main.offsets[-1])
        n = total // seq_len
        if n < 2:
            raise DataError(f"data.seq_len: only {total} tokens, fewer than 2 blocks of {seq_len} "
                            "(one for training, one for validation): lower data.seq_len or add data")

        def fill_blocks(rows: list[int], out: dict[str, np.ndarray]) -> None:
            for k, r in enumerate(rows):
                ids, labels = main.span(r * seq_len, seq_len)
                out["input_ids"][k] = ids
                if not plain:
                    out["labels"][k] = labels

        stats = {"format": fmt, "examples": sink.examples} if plain else {
            "format": fmt, "examples": sink.examples, "pad_id": pad_id}
        return Plan(n, seq_len, ["input_ids"] if plain else ["input_ids", "labels"], fill_blocks, stats, kept)
    stats = {"format": fmt, "examples": sink.examples, **sink.counts, "pad_id": pad_id}
    if data.packing == "none":
        names = ["input_ids", "labels", "attention_mask"]
        return Plan(len(kept), seq_len, names,
                    lambda rows, out: _padded(main, rows, [out[n] for n in names], pad_id), stats, kept, lambda r: [r])
    bins = _bins(main.lengths.tolist(), seq_len)

    def fill_free(rows: list[int], out: dict[str, np.ndarray]) -> None:
        # The chunk at once, not an example at a time: a row is its examples back to back, then padding, so in
        # row-major order the cells before each row's padding take the examples' tokens in order.
        members = [bins[r] for r in rows]
        counts = np.fromiter(map(len, members), np.int64, len(rows))
        which = np.fromiter(chain.from_iterable(members), np.int64, int(counts.sum()))
        lengths = main.lengths[which]
        starts = np.cumsum(lengths) - lengths  # each example's first token among the chunk's tokens
        row_of = np.repeat(np.arange(len(rows)), counts)
        col = starts - np.repeat(starts[np.cumsum(counts) - counts], counts)  # its first column in its row
        used = np.bincount(row_of, weights=lengths, minlength=len(rows)).astype(np.int64)
        tail = np.arange(seq_len)[None, :] - used[:, None]
        pad = tail >= 0
        tokens = ~pad
        ids, labels = main.examples(which)
        out["input_ids"][tokens], out["labels"][tokens] = ids, labels
        out["position_ids"][tokens] = np.arange(len(ids)) - np.repeat(starts, lengths)
        some = lengths > 0  # an example's first token has no previous token of its own
        out["labels"].reshape(-1)[(row_of * seq_len + col)[some]] = IGNORE
        out["input_ids"][pad], out["labels"][pad], out["position_ids"][pad] = pad_id, IGNORE, tail[pad]

    return Plan(len(bins), seq_len, ["input_ids", "labels", "position_ids"], fill_free, stats, kept,
                lambda r: bins[r])


def _padded(flat: Flat, rows: list[int], out: list[np.ndarray], pad_id: int) -> None:
    ids_out, labels_out, mask_out = out
    for k, r in enumerate(rows):
        ids, labels = flat.example(r)
        n = len(ids)
        ids_out[k, :n], labels_out[k, :n], mask_out[k, :n] = ids, labels, 1
        ids_out[k, n:], labels_out[k, n:], mask_out[k, n:] = pad_id, IGNORE, 0


@dataclass
class Written:
    n_train: int
    n_val: int
    trained_share: float
    val_order: np.ndarray = field(repr=False)


def write_rows(plan: Plan, out_dir: Path, val_fraction: float, seed: int, num_proc: int = 1) -> Written:
    """The rows split as packing.split_rows splits them (seeded permutation; validation first), each split's
    fields written as int64 .npy files (train.npy, train.labels.npy, ...): each file is made at its full size
    first, then chunks of rows are filled and written at their place, by `num_proc` forked workers (which read
    the encoded files and write the rows themselves: the parent only hands out chunks and sums their counts)."""
    import torch

    from memfit.data.packing import val_count
    from memfit.data.workers import in_order

    global _PLAN
    n = plan.n_rows
    if n < 2:
        raise DataError(f"data.seq_len: only {n} block(s); need 2 or more: lower data.seq_len or add data")
    n_val = val_count(n, val_fraction)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    seq_len, jobs = plan.seq_len, []
    for split, rows in (("train", order[n_val:]), ("val", order[:n_val])):
        data_at = {}  # each field's file: where its rows begin, after the .npy header
        for f in plan.fields:
            path = str(out_dir / (f"{split}.npy" if f == "input_ids" else f"{split}.{f}.npy"))
            with open(path, "wb") as fh:
                np.lib.format.write_array_header_1_0(fh, {"descr": "<i8", "fortran_order": False,
                                                          "shape": (len(rows), seq_len)})
                data_at[path] = fh.tell()
                fh.truncate(data_at[path] + 8 * len(rows) * seq_len)
        jobs += [(split == "train", {p: at + 8 * i * seq_len for p, at in data_at.items()}, rows[i:i + CHUNK])
                 for i in range(0, len(rows), CHUNK)]
    trained: list[int] = []  # each chunk's trained tokens
    _PLAN = plan  # forked workers inherit it (closures over open files: never pickled)
    try:
        in_order(_write_chunk, jobs, num_proc, trained.append)
    finally:
        _PLAN = None
    share = sum(trained) / max(1, (n - n_val) * seq_len)
    return Written(n - n_val, n_val, share, order[:n_val])


_PLAN: Plan | None = None


def _write_chunk(job: tuple[bool, dict[str, int], np.ndarray]) -> int:
    """Fill one chunk of rows and write each field at its place in its file; the chunk's trained tokens (training
    rows), else 0."""
    train, places, rows = job
    plan = _PLAN
    assert plan is not None
    chunk = rows.tolist()
    out = {f: np.empty((len(chunk), plan.seq_len), dtype=np.int64) for f in plan.fields}  # the fill sets every cell
    plan.fill(chunk, out)
    for (path, at), arr in zip(places.items(), out.values(), strict=True):
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(arr).cast("B")
            while view:
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done
        finally:
            os.close(fd)
    if not train:
        return 0
    return int((out["labels"][:, 1:] != IGNORE).sum()) if "labels" in out else len(chunk) * (plan.seq_len - 1)
