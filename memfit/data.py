"""Training data: a seeded synthetic corpus or local .txt/.jsonl files, packed into token blocks."""

from __future__ import annotations

import hashlib
import random
import tempfile
import warnings
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

from memfit.config import DataConfig, MemfitConfig
from memfit.errors import CheckpointError, DataError, ModelLoadError
from memfit.preflight import blank_data, data_files, missing_data

# Small closed vocabularies: a tiny model picks up the templates and the number/letter
# sequences within a few dozen steps, so a falling validation loss is visible in a short run.
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_COLORS = ("red", "blue", "green", "yellow", "black", "white")
_ANIMALS = ("cat", "dog", "fox", "bird", "horse", "fish")
_VERBS = ("sees", "likes", "chases", "finds", "follows", "watches")
_OBJECTS = ("ball", "tree", "house", "river", "box", "hat")
_PATTERNS = ("ab", "red blue", "up down", "tick tock", "one two three", "x y z")


def _counting(rng: random.Random) -> str:
    start = rng.randrange(0, 14)
    n = rng.randint(4, 8)
    return " ".join(_NUMBER_WORDS[start:start + n]) + "."


def _letters(rng: random.Random) -> str:
    start = rng.randrange(0, 20)
    return " ".join(_LETTERS[start:start + rng.randint(4, 7)]) + "."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    if rng.random() < 0.5:
        return f"{a} plus {b} is {a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a} minus {b} is {a - b}."


def _template(rng: random.Random) -> str:
    return (f"the {rng.choice(_COLORS)} {rng.choice(_ANIMALS)} {rng.choice(_VERBS)} "
            f"the {rng.choice(_OBJECTS)}.")


def _repeat(rng: random.Random) -> str:
    return " ".join([rng.choice(_PATTERNS)] * rng.randint(3, 5)) + "."


_GENERATORS = (_counting, _letters, _arithmetic, _template, _repeat)


def synthetic_corpus(n_docs: int, seed: int) -> list[str]:
    """`n_docs` plain-ASCII documents of 3-6 templated sentences; the same seed gives the same texts."""
    # A private Random: the corpus never depends on (or disturbs) the global RNG state.
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [rng.choice(_GENERATORS)(rng) for _ in range(rng.randint(3, 6))]
        docs.append(" ".join(sentences))
    return docs


def _load_group(suffix: str, files: list[Path], text_field: str, where: Path, cache_dir: str) -> list[str]:
    import datasets  # lazy: importing datasets costs ~1 s, and only local files need it

    if suffix == ".txt":
        # Blank-line separated paragraphs become documents (an eos goes between them when packing);
        # line breaks inside a paragraph are kept.
        kind, kwargs = "text", {"sample_by": "paragraph"}
    else:
        kind, kwargs = "json", {}
    # The packaged "text"/"json" builders read local files only (checked with sockets blocked);
    # cache_dir keeps the Arrow cache out of the user's home, and it is deleted afterwards.
    # A "Generating train split" bar per load is noise in a training log.
    progress_was_off = datasets.utils.are_progress_bars_disabled()
    with warnings.catch_warnings():  # it warns when HF_DATASETS_DISABLE_PROGRESS_BARS pins the setting
        warnings.simplefilter("ignore")
        datasets.utils.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train",
                                   cache_dir=cache_dir, **kwargs)
    except Exception as err:  # noqa: BLE001 - the builders raise many types (ArrowInvalid, DatasetGenerationError, ...)
        # DatasetGenerationError wraps the useful message (e.g. the JSON parse error): use the root cause.
        root: BaseException = err
        while root.__cause__ is not None:
            root = root.__cause__
        first = (str(root).strip().splitlines() or [type(root).__name__])[0]
        hint = "each line must be one JSON object" if suffix == ".jsonl" else "check the file encoding"
        raise DataError(f"data.path: could not read the {suffix} data at {where} ({first}); {hint}") from None
    finally:
        if not progress_was_off:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                datasets.utils.enable_progress_bars()
    if ds.num_rows == 0:
        return []
    field = "text" if suffix == ".txt" else text_field
    if field not in ds.column_names:
        raise DataError(f"data.text_field: the .jsonl records at {where} have no {field!r} field "
                        f"(fields: {', '.join(ds.column_names)}); "
                        "set data.text_field to the one holding text")
    values = ds[field]
    texts = []
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(f"data.text_field: .jsonl record {i + 1} at {where} has "
                            f"{'no' if value is None else 'a non-string'} {field!r} field; "
                            "every record needs a string there (or set data.text_field)")
        texts.append(value)
    return texts


def load_texts(data_cfg: DataConfig) -> list[str]:
    """The documents to train on: the synthetic corpus, or every .txt/.jsonl under data.path (sorted)."""
    if data_cfg.path is None:
        return synthetic_corpus(data_cfg.synthetic_docs, data_cfg.seed)
    path = Path(data_cfg.path).expanduser()
    if not path.exists():
        raise missing_data(path)
    # Empty files add nothing, and datasets' builders fail on them.
    files = [f for f in data_files(path) if f.stat().st_size > 0]
    texts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="memfit-datasets-") as cache_dir:
        # One load_dataset call per run of same-type files keeps the sorted file order and stays fast.
        for suffix, group in groupby(files, key=lambda p: p.suffix.lower()):
            texts.extend(_load_group(suffix, list(group), data_cfg.text_field, path, cache_dir))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise blank_data(path)
    return texts


def data_digest(texts: list[str]) -> str:
    """sha256 hex of the texts, order-sensitive; the same texts give the same digest in every run."""
    h = hashlib.sha256()
    for t in texts:
        raw = t.encode("utf-8")
        # Length-prefixing makes ["ab", "c"] and ["a", "bc"] digest differently.
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "bos_token_id", None)
    if eos is None:
        raise ModelLoadError("model.name_or_path: the tokenizer has no eos (or bos) token to separate "
                             "documents; use a tokenizer that defines one")
    return int(eos)


def tokenize_and_pack(texts: list[str], tokenizer: Any, seq_len: int, chunk_docs: int = 1024) -> torch.Tensor:
    """Token ids of all docs, each followed by eos, concatenated and cut into [n_blocks, seq_len]."""
    eos = _eos_id(tokenizer)
    flat: list[int] = []
    for start in range(0, len(texts), chunk_docs):
        # Batched calls run in the Rust tokenizer's thread pool; verbose=False silences the
        # "longer than the model's maximum" warning, which does not apply to packed data.
        ids = tokenizer(texts[start:start + chunk_docs], add_special_tokens=False, verbose=False)["input_ids"]
        for doc in ids:
            flat.extend(doc)
            flat.append(eos)
    n_blocks = len(flat) // seq_len
    if n_blocks < 2:
        raise DataError(f"data.seq_len: only {len(flat)} tokens, fewer than 2 blocks of {seq_len} "
                        "(one for training, one for validation): lower data.seq_len or add data")
    return torch.tensor(flat[:n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def split_blocks(blocks: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded shuffle of the blocks, then (train, val); each side gets at least one block."""
    n = blocks.shape[0]
    if n < 2:
        raise DataError(f"data.seq_len: only {n} block(s); need 2 or more: lower data.seq_len or add data")
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return blocks[order[n_val:]].clone(), blocks[order[:n_val]].clone()


class BatchOrder:
    """Which training blocks come next; its state_dict resumes the order at the exact batch."""

    def __init__(self, n_items: int, batch_size: int, seed: int) -> None:
        if n_items < 1 or batch_size < 1:
            raise ValueError(f"BatchOrder needs n_items >= 1 and batch_size >= 1 "
                             f"(got {n_items}, {batch_size})")
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._index = 0  # position inside the current epoch's permutation
        self._perm: list[int] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def _permutation(self) -> list[int]:
        # A fresh Generator per epoch: the order is a pure function of (seed, epoch), so resuming
        # needs no RNG state, and the global RNG is never touched.
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed + self._epoch)
            self._perm = torch.randperm(self.n_items, generator=gen).tolist()
        return self._perm

    def next_indices(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            perm = self._permutation()
            take = perm[self._index:self._index + self.batch_size - len(out)]
            out.extend(take)
            self._index += len(take)
            if self._index >= self.n_items:  # roll into the next epoch mid-batch if needed
                self._epoch += 1
                self._index = 0
                self._perm = None
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "n_items": self.n_items,
                "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            n_items, seed = int(state["n_items"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"data order state in the checkpoint is malformed ({err!r}); "
                                  "start without resuming (checkpoint.resume=false)") from None
        if n_items != self.n_items or seed != self.seed:
            raise CheckpointError(
                f"the training data changed since the checkpoint (blocks {n_items} -> {self.n_items}, "
                f"seed {seed} -> {self.seed}); restore the same data/seeds or start a new run "
                "(checkpoint.resume=false or another checkpoint.uri)")
        if epoch < 0 or not 0 <= index < n_items:
            raise CheckpointError(f"data order state in the checkpoint is out of range (epoch {epoch}, "
                                  f"index {index} of {n_items})")
        # batch_size may change on resume: the position is counted in items, not batches.
        self._epoch, self._index, self._perm = epoch, index, None


@dataclass
class DataBundle:
    train: torch.Tensor
    val: torch.Tensor
    digest: str
    n_train_tokens: int
    n_val_tokens: int
    source: str


def prepare_data(cfg: MemfitConfig, tokenizer: Any, texts: list[str] | None = None) -> DataBundle:
    """Load (unless given), pack with data.seq_len and split with data.val_fraction / data.seed."""
    if texts is None:
        texts = load_texts(cfg.data)
    blocks = tokenize_and_pack(texts, tokenizer, cfg.data.seq_len)
    train, val = split_blocks(blocks, cfg.data.val_fraction, cfg.data.seed)
    source = cfg.data.path or f"synthetic({cfg.data.synthetic_docs}, {cfg.data.seed})"
    return DataBundle(train=train, val=val, digest=data_digest(texts), n_train_tokens=train.numel(),
                      n_val_tokens=val.numel(), source=source)
