"""data.streaming: plain text records read as a stream, cut into blocks on the fly, resumable at the exact block."""

# What streams: .txt paragraphs, and data.text_field in .jsonl/.json/.parquet/.csv files, a save_to_disk dataset or
# hf:NAME (datasets.load_dataset(NAME, split, streaming=True): one source, the hub's shards in its state_dict), each
# read through datasets' IterableDataset (nothing is written to disk). The blocks are those the prepared path
# cuts (every text followed by eos, all concatenated, cut every seq_len tokens); the split and the order differ:
# validation is the stream's first blocks, and a stream cannot be shuffled globally, so each window of
# data.shuffle_buffer consecutive blocks is permuted. A position is (source, datasets' state_dict before a batch of
# records, tokens of that batch already used): a resume reads from the window's start, so it tokenises one window
# again at most, and the permutation is a pure function of (seed, epoch, window).

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.config import DataConfig, MemfitConfig
from memfit.data.files import HUB_PREFIX, data_files, missing_data, saved_dataset_dir
from memfit.errors import CheckpointError, DataError

log = logging.getLogger("memfit.data")
BATCH = 256  # records tokenised at once; also the granularity of a saved position
STREAMS = ".txt paragraphs, or data.text_field in .jsonl/.json/.parquet/.csv files, a saved dataset or hf:NAME"
Position = dict[str, Any]  # {"source", "state" (datasets' state_dict or None: the start), "record", "skip"}


def _sources(data: DataConfig) -> list[tuple[str, Callable[[], Any], str]]:
    """(where, a function opening its IterableDataset, text field) per source, in the prepared path's order."""
    from memfit.data.formats import _BUILDERS, _quiet_datasets, _read_saved, stream_hub

    assert data.path is not None  # the config refuses streaming the synthetic corpus
    if data.path.startswith(HUB_PREFIX):
        path = data.path
        return [(path, lambda: stream_hub(path, data.split), data.text_field)]
    path = Path(data.path).expanduser()
    if not path.exists():
        raise missing_data(path)
    if saved_dataset_dir(path):
        return [(str(path), lambda: _read_saved(path, data.split).to_iterable_dataset(), data.text_field)]
    datasets = _quiet_datasets()

    def opener(f: Path) -> Callable[[], Any]:
        suffix = f.suffix.lower()
        kwargs = {"sample_by": "paragraph"} if suffix == ".txt" else {}
        return lambda: datasets.load_dataset(_BUILDERS[suffix], data_files=[str(f)], split="train", streaming=True,
                                             **kwargs)

    return [(str(f), opener(f), "text" if f.suffix.lower() == ".txt" else data.text_field)
            for f in data_files(path) if f.stat().st_size > 0]


def _layout(columns: list[str], data: DataConfig, where: str) -> str:
    """The record layout the prepared path would read (data.format, or what the fields show); text when none."""
    from memfit.data.formats import detect_format

    try:
        return detect_format(columns, data, where)
    except DataError:  # no field of any layout: the text field is the one that is missing
        return "text"


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class BlockStream:
    """Training blocks in a seeded, windowed order, read from the sources as they are needed; state_dict /
    load_state_dict resume at the exact block. `start`: where training starts (after the validation blocks)."""

    def __init__(self, data: DataConfig, tokenizer: Any, seed: int, fingerprint: str) -> None:
        from memfit.data.masking import eos_id

        self.data, self.tokenizer, self.seed, self.fingerprint = data, tokenizer, seed, fingerprint
        self.seq_len, self.buffer = data.seq_len, data.shuffle_buffer
        self.eos = eos_id(tokenizer)
        self.sources = _sources(data)
        self._checked: set[int] = set()
        self.start: Position = {"source": 0, "state": None, "record": 0, "skip": 0}
        self.epoch, self.window, self.index = 0, 0, 0
        self._window_start: Position = self.start
        self._blocks: torch.Tensor | None = None
        self._next: Position | None = None

    # -- reading ------------------------------------------------------------------------------------------
    def _check(self, i: int, ds: Any) -> None:
        """A source holds plain text records, or one clear line says it does not stream."""
        where, _, field = self.sources[i]
        if i in self._checked or (where.lower().endswith(".txt") and not where.startswith(HUB_PREFIX)):
            return
        from memfit.data.arrow_text import _is_text

        columns = list(ds.column_names or next(iter(self._batches(i, ds.take(1))), {}).keys())
        if field not in columns and _layout(columns, self.data, where) == "text":  # no text, nor another layout
            raise DataError(f"data.text_field: the records of {where} have no {field!r} field (fields: "
                            f"{', '.join(columns) or 'none'}); set data.text_field to the field holding the text")
        if not _is_text(columns, self.data):
            raise DataError(f"data.streaming: {where} holds {_layout(columns, self.data, where)} records; only "
                            f"plain text streams ({STREAMS}): set data.streaming: false")
        self._checked.add(i)

    def _batches(self, i: int, ds: Any) -> Iterator[dict[str, list[Any]]]:
        """ds's records BATCH at a time; a read that fails (a broken file, the network mid-stream) is one line."""
        where = self.sources[i][0]
        batches = iter(ds.iter(batch_size=BATCH))
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as err:  # noqa: BLE001 - the builders and the hub raise many types
                from memfit.data.formats import _root_cause

                fix = ("check the network and the id (a resume continues at the last checkpoint)"
                       if where.startswith(HUB_PREFIX) else "check the file, or read it with data.streaming: false "
                       "for the record it fails at")
                raise DataError(f"data.path: could not read {where} as a stream ({_root_cause(err)}); {fix}"
                                ) from None
            yield batch

    def _encode(self, texts: list[str]) -> np.ndarray:
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        return np.fromiter((t for doc in ids for t in (*doc, self.eos)), dtype=np.int64)

    def _chunks(self, pos: Position) -> Iterator[tuple[Position, np.ndarray]]:
        """(position of the chunk's first token, its token ids) per batch of records, from `pos` to the end."""
        for i in range(pos["source"], len(self.sources)):
            where, open_source, field = self.sources[i]
            ds = open_source()
            self._check(i, ds)
            state, record = (pos["state"], pos["record"]) if i == pos["source"] else (None, 0)
            if state is not None:
                ds.load_state_dict(state)
            for batch in self._batches(i, ds):
                texts = batch[field]
                if any(t is None for t in texts):
                    n = record + 1 + next(k for k, t in enumerate(texts) if t is None)
                    raise DataError(f"data.path: {where}, record {n}: '{field}' is missing; every text record "
                                    "needs a string there")
                yield {"source": i, "state": state, "record": record, "skip": 0}, self._encode(
                    [t for t in texts if t.strip()])
                record += len(texts)
                state = ds.state_dict()

    def read(self, pos: Position, n: int) -> tuple[list[np.ndarray], Position | None]:
        """Up to `n` blocks from `pos`, and the position of the first token after them (None: the stream ended)."""
        blocks: list[np.ndarray] = []
        carry = np.empty(0, dtype=np.int64)
        segs: deque[list[Any]] = deque()  # [position, tokens left] of the chunks `carry` holds, oldest first
        drop = pos["skip"]
        chunks = self._chunks(pos)
        for cpos, ids in chunks:
            if len(blocks) == n:  # the blocks ended exactly at a chunk's end: the next chunk starts there
                return blocks, cpos
            take = min(drop, len(ids))
            ids, drop = ids[take:], drop - take
            if not len(ids):
                continue
            segs.append([{**cpos, "skip": take}, len(ids)])
            carry = np.concatenate([carry, ids])
            while len(carry) >= self.seq_len and len(blocks) < n:
                blocks.append(carry[:self.seq_len])
                carry, need = carry[self.seq_len:], self.seq_len
                while need:
                    used = min(need, segs[0][1])
                    segs[0] = [{**segs[0][0], "skip": segs[0][0]["skip"] + used}, segs[0][1] - used]
                    need -= used
                    if not segs[0][1]:
                        segs.popleft()
            if len(blocks) == n and segs:
                return blocks, segs[0][0]
        return blocks, None

    # -- the training order -------------------------------------------------------------------------------
    def _fill(self) -> None:
        blocks, self._next = self.read(self._window_start, self.buffer)
        if not blocks:
            if self.window == 0:
                raise DataError(f"data.streaming: {self.data.path} holds no training block of {self.seq_len} "
                                "tokens after the validation blocks: lower data.seq_len or add data")
            self.epoch, self.window, self._window_start = self.epoch + 1, 0, self.start
            return self._fill()
        gen = torch.Generator().manual_seed(_seed(self.seed, self.epoch, self.window))
        self._blocks = torch.from_numpy(np.stack(blocks))[torch.randperm(len(blocks), generator=gen)]

    def next_blocks(self, n: int) -> torch.Tensor:
        """The next `n` training blocks [n, seq_len] (rolling into the next window or epoch as needed)."""
        out: list[torch.Tensor] = []
        while sum(len(t) for t in out) < n:
            if self._blocks is None:
                self._fill()
            assert self._blocks is not None
            take = self._blocks[self.index:self.index + n - sum(len(t) for t in out)]
            out.append(take)
            self.index += len(take)
            if self.index >= len(self._blocks):
                if self._next is None:
                    self.epoch, self.window, self._window_start = self.epoch + 1, 0, self.start
                else:
                    self.window, self._window_start = self.window + 1, self._next
                self.index, self._blocks = 0, None
        return torch.cat(out)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": {"epoch": self.epoch, "window": self.window, "start": self._window_start,
                           "index": self.index},
                "fingerprint": self.fingerprint, "seq_len": self.seq_len, "shuffle_buffer": self.buffer,
                "seed": self.seed, "train_start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" not in state:
            raise CheckpointError("the checkpoint was saved without data.streaming (its data order is a block "
                                  "index): resume with data.streaming: false or start a new run")
        same = {k: state.get(k) for k in ("fingerprint", "seq_len", "shuffle_buffer", "seed")}
        if same != {"fingerprint": self.fingerprint, "seq_len": self.seq_len, "shuffle_buffer": self.buffer,
                    "seed": self.seed} or state.get("train_start") != self.start:
            raise CheckpointError(f"the streamed training data changed since the checkpoint ({same}); restore the "
                                  "same data/seeds or start a new run (checkpoint.resume=false)")
        s = state["stream"]
        self.epoch, self.window, self.index = int(s["epoch"]), int(s["window"]), int(s["index"])
        self._window_start, self._blocks = s["start"], None


def streamed_data(cfg: MemfitConfig, source: Any, tokenizer: Any) -> Any:
    """A DataBundle whose training blocks come from a BlockStream: validation is the stream's first
    train.eval_batches micro-batches of blocks, `train` the first global batch after them (for shapes and the
    memory probe); nothing is written to disk."""
    from memfit.data.prepare import DataBundle

    d, t = cfg.data, cfg.train
    fingerprint = getattr(source, "fingerprint", None)
    if fingerprint is None:
        from memfit.data.source import source_fingerprint

        fingerprint = source_fingerprint(d)
    stream = BlockStream(d, tokenizer, t.seed, fingerprint)
    n_val = t.eval_batches * t.micro_batch_size
    val, stream.start = stream.read(stream.start, n_val)
    head = stream.read(stream.start, t.batch_size)[0] if stream.start is not None else []
    if len(val) < n_val or not head:
        raise DataError(f"data.streaming: {d.path} holds fewer than {n_val + 1} blocks of {d.seq_len} tokens "
                        f"({n_val} for validation: train.eval_batches x micro-batch, and one for training): lower "
                        "data.seq_len or train.eval_batches, or add data")
    stream._window_start = stream.start
    log.info("data: streaming %s in blocks of %d tokens (no global shuffle: windows of %d blocks permuted, "
             "data.shuffle_buffer); %d validation blocks are the stream's first", d.path, d.seq_len, d.shuffle_buffer,
             n_val)
    train, val_t = torch.from_numpy(np.stack(head)), torch.from_numpy(np.stack(val))
    stats = {"format": "text", "streaming": True, "shuffle_buffer": d.shuffle_buffer,
             "trained_tokens_share": round((d.seq_len - 1) / d.seq_len, 4)}
    return DataBundle(train=train, val=val_t, digest=fingerprint, n_train_tokens=train.numel(),
                      n_val_tokens=val_t.numel(), source=str(d.path), packing="blocks", stats=stats, stream=stream)
