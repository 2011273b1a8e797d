"""Reading records as users bring them (text, prompt/completion, messages) from files, saved datasets or the hub."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import warnings
from itertools import groupby
from pathlib import Path
from typing import Any

from memfit.config import DataConfig
from memfit.data.files import HUB_PREFIX, blank_data, data_files, hub_name, missing_data, saved_dataset_dir
from memfit.data.synthetic import synthetic_corpus, synthetic_preference_pairs
from memfit.errors import DataError

log = logging.getLogger("memfit.data")

_SLICE = 10_000  # records turned into Python objects at once
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class Corpus(list[str]):
    """The texts a preset's tokenizer is trained on, with the structured examples they came from.

    A list of str so every caller that hashes or trains on texts works unchanged; `examples` holds the normalised
    records ({"text"}, {"prompt", "completion"} or {"messages"}) and `origins` where each came from (file, record).
    """

    def __init__(self, texts: list[str], fmt: str = "text", examples: list[dict[str, Any]] | None = None,
                 origins: list[tuple[str, int]] | None = None) -> None:
        super().__init__(texts)
        self.format = fmt
        self.examples = examples if examples is not None else [{"text": t} for t in texts]
        self.origins = origins if origins is not None else [("<texts>", i + 1) for i in range(len(texts))]

    def digest(self) -> str:
        """sha256 of the examples and their format; the text format digests exactly as a plain list of texts."""
        h = hashlib.sha256()
        add_items(h, list(self) if self.format == "text" else [
            json.dumps({"format": self.format, **e}, sort_keys=True) for e in self.examples])
        return h.hexdigest()


def add_items(h: Any, items: list[str]) -> None:
    """Feed strings to a hash, each length-prefixed: ["ab", "c"] and ["a", "bc"] digest differently. The readers
    that digest a slice of records at a time call it per slice and get Corpus.digest's value. A thousand items at
    a time: a whole corpus's digest never holds a second copy of its text."""
    for start in range(0, len(items), 1024):
        h.update(items_bytes(items[start:start + 1024]))


def items_bytes(items: list[str]) -> bytes:
    """What add_items feeds the hash for `items`: each string's utf-8 length (8 bytes, little-endian), then the
    string (the scan's workers make it for their slices; the parent hashes the slices in order)."""
    parts = []
    for t in items:
        raw = t.encode("utf-8")
        parts += (len(raw).to_bytes(8, "little"), raw)
    return b"".join(parts)


def data_digest(texts: list[str]) -> str:
    """sha256 hex of the texts (or a Corpus's examples), order-sensitive; the same data gives the same digest."""
    return texts.digest() if isinstance(texts, Corpus) else Corpus(list(texts)).digest()


def _quiet_datasets() -> Any:
    import datasets  # lazy: importing datasets costs ~1 s, and only real data needs it

    with warnings.catch_warnings():  # it warns when HF_DATASETS_DISABLE_PROGRESS_BARS pins the setting
        warnings.simplefilter("ignore")
        datasets.utils.disable_progress_bars()  # a "Generating train split" bar per load is noise in a log
    return datasets


def _root_cause(err: BaseException) -> str:
    # DatasetGenerationError wraps the useful message (e.g. the JSON parse error): use the root cause.
    root: BaseException = err
    while root.__cause__ is not None:
        root = root.__cause__
    return (str(root).strip().splitlines() or [type(root).__name__])[0]


def record_lines(path: Path, suffix: str, n_rows: int) -> Any:
    """Each record's number as an editor shows it: its 1-based line in a .jsonl (blank lines skipped) or .csv
    (after the header); 1..n elsewhere, or where the lines do not map one to one onto the records. A numpy int64
    array (8 bytes a record: a corpus of millions of records is not held as Python ints)."""
    import numpy as np

    fallback = np.arange(1, n_rows + 1, dtype=np.int64)
    if suffix not in (".jsonl", ".csv") or not path.is_file():
        return fallback
    with path.open("rb") as f:
        lines = np.fromiter((i for i, line in enumerate(f, start=1) if line.strip()), dtype=np.int64)
    if suffix == ".csv":
        lines = lines[1:]
    return lines if len(lines) == n_rows else fallback


def _bad_json_line(path: Path) -> str | None:
    """'line N: why' for the first line of a .jsonl that is not one JSON object (the parsers count rows from 0)."""
    with path.open("rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                return f"line {n}: {err}"
            if not isinstance(value, dict):
                return f"line {n}: not a JSON object"
    return None


def _read_files(suffix: str, files: list[Path], cache_dir: str) -> Any:
    datasets = _quiet_datasets()
    # .txt: blank-line separated paragraphs become documents; line breaks inside a paragraph are kept.
    kwargs = {"sample_by": "paragraph"} if suffix == ".txt" else {}
    try:
        # The packaged builders read local files only; cache_dir keeps the Arrow cache out of the user's home.
        return datasets.load_dataset(_BUILDERS[suffix], data_files=[str(f) for f in files], split="train",
                                     cache_dir=cache_dir, **kwargs)
    except Exception as err:  # noqa: BLE001 - the builders raise many types (ArrowInvalid, DatasetGenerationError, ...)
        hint = {".jsonl": "each line must be one JSON object", ".parquet": "is it a complete parquet file?",
                ".csv": "it needs a header row"}.get(suffix, "check the file encoding")
        where = files[0] if len(files) == 1 else files[0].parent
        bad = _bad_json_line(files[0]) if suffix == ".jsonl" and len(files) == 1 else None
        if bad:
            raise DataError(f"data.path: {where} {bad}; each line must be one JSON object") from None
        raise DataError(f"data.path: could not read the {suffix} data at {where} ({_root_cause(err)}); "
                        f"{hint}") from None


def _read_saved(path: Path, split: str) -> Any:
    datasets = _quiet_datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001
        raise DataError(f"data.path: could not read the saved dataset at {path} ({_root_cause(err)}); "
                        "point data.path at a folder written by save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"data.split: the saved dataset at {path} has no split {split!r} "
                            f"(splits: {', '.join(ds)}); set data.split")
        ds = ds[split]
    return ds


def _hub_error(path: str, split: str, err: BaseException) -> DataError:
    name, revision = hub_name(path)
    why = _root_cause(err)
    at = f" at revision {revision!r}" if revision else ""
    if why.startswith(("Bad split", "Unknown split")):  # datasets' words for a split the dataset lacks
        return DataError(f"data.split: dataset {name!r}{at} (data.path {path}) has no split {split!r} ({why}); "
                         "set data.split to one of its splits")
    return DataError(f"data.path: could not load dataset {name!r}{at} split {split!r} with datasets.load_dataset "
                     f"({why}); check the id, the revision after @, the split (data.split) and the network")


def _read_hub(path: str, split: str, cache_dir: str) -> Any:
    """data.path hf:NAME[@REVISION] through datasets.load_dataset (the revision pins a commit, tag or branch)."""
    datasets = _quiet_datasets()
    name, revision = hub_name(path)
    try:
        return datasets.load_dataset(name, split=split, cache_dir=cache_dir, revision=revision)
    except Exception as err:  # noqa: BLE001 - hub, network and builder errors all mean "could not load"
        raise _hub_error(path, split, err) from None


def stream_hub(path: str, split: str) -> Any:
    """load_dataset(NAME, split, revision, streaming=True) for hf:NAME[@REVISION]: nothing downloaded ahead."""
    datasets = _quiet_datasets()
    name, revision = hub_name(path)
    try:
        return datasets.load_dataset(name, split=split, streaming=True, revision=revision)
    except Exception as err:  # noqa: BLE001 - as _read_hub
        raise _hub_error(path, split, err) from None


def detect_format(columns: list[str], cfg: DataConfig, where: str, quiet: bool = False) -> str:
    """The record layout data.format names, or under auto the one the columns show (logged with the reason,
    unless `quiet`: a second pass over records already recognised)."""
    fields = ", ".join(columns) or "none"
    if cfg.format != "auto":
        return cfg.format
    if cfg.chosen_field in columns:  # a pair whose rejected side is missing is named record by record
        fmt, why = "preference", f"records have a {cfg.chosen_field!r} field"
    elif cfg.messages_field in columns:
        fmt, why = "messages", f"records have a {cfg.messages_field!r} field"
    elif cfg.prompt_field in columns and cfg.completion_field in columns:
        fmt, why = "prompt_completion", f"records have {cfg.prompt_field!r} and {cfg.completion_field!r} fields"
    elif cfg.text_field in columns:
        fmt, why = "text", f"records have a {cfg.text_field!r} field"
    else:
        raise DataError(f"data.text_field: the records at {where} have no {cfg.text_field!r} field (nor "
                        f"{cfg.messages_field!r}, nor {cfg.prompt_field!r} + {cfg.completion_field!r}; fields: "
                        f"{fields}); set data.text_field, or data.format and its field names")
    if not quiet:
        log.info("data: format %s recognised in %s (%s)", fmt, where, why)
    return fmt


def _bad(key: str, where: str, n: int, field: str, problem: str, fix: str) -> DataError:
    return DataError(f"data.{key}: {where} record {n}: field {field!r} {problem}; {fix}")


def _messages(value: Any, where: str, n: int, field: str, key: str = "messages_field") -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        what = "is missing" if value is None else "is an empty conversation" if value == [] else "is not a list"
        raise _bad(key, where, n, field, what, "give a non-empty list of {role, content} turns (or drop the record)")
    turns = []
    for i, turn in enumerate(value):
        for part in ("role", "content"):
            if not isinstance(turn, dict) or not isinstance(turn.get(part), str):
                raise _bad(key, where, n, f"{field}[{i}].{part}", "is missing or not a string",
                           "every turn needs string role and content")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return turns


def normalise(rows: list[dict[str, Any]], fmt: str, cfg: DataConfig, where: str, numbers: list[int] | None = None
              ) -> list[dict[str, Any]]:
    """Rows of one file as memfit's examples, each checked; a bad one fails naming the file, record and field.
    `numbers`: each row's 1-based record number as an editor shows it (its line in .jsonl/.csv); default 1..n."""
    record_numbers = numbers if numbers is not None else list(range(1, len(rows) + 1))
    out = []
    for n, row in zip(record_numbers, rows, strict=True):
        if fmt == "preference":
            out.append(_preference(row, cfg, where, n))
            continue
        if fmt == "messages":
            out.append({"messages": _messages(row.get(cfg.messages_field), where, n, cfg.messages_field)})
            continue
        keys = ("text_field",) if fmt == "text" else ("prompt_field", "completion_field")
        values = []
        for key in keys:
            name = getattr(cfg, key)
            value = row.get(name)
            if not isinstance(value, str):
                what = "is missing" if value is None else "is a non-string"
                raise _bad(key, where, n, name, what, f"every {fmt} record needs a string there "
                           "(or set data.format and the data.*_field names)")
            values.append(value)
        out.append({"text": values[0]} if fmt == "text" else {"prompt": values[0], "completion": values[1]})
    return out


def _preference(row: dict[str, Any], cfg: DataConfig, where: str, n: int) -> dict[str, Any]:
    """One pair as {prompt, chosen, rejected}: strings (TRL's standard form) or turn lists (conversational); whole
    chosen/rejected conversations without a prompt field share their leading turns as the prompt (TRL's implicit
    prompt)."""
    sides = {}
    for key in ("chosen_field", "rejected_field"):
        name = getattr(cfg, key)
        value = row.get(name)
        if value is None:
            raise _bad(key, where, n, name, "is missing", "every preference record needs a chosen and a rejected "
                       "completion (or set data.chosen_field / data.rejected_field)")
        sides[key] = value
    chosen, rejected, prompt = sides["chosen_field"], sides["rejected_field"], row.get(cfg.prompt_field)
    if isinstance(chosen, str) or isinstance(rejected, str):
        for key, name, value in (("prompt_field", cfg.prompt_field, prompt), ("chosen_field", cfg.chosen_field,
                                 chosen), ("rejected_field", cfg.rejected_field, rejected)):
            if not isinstance(value, str):
                raise _bad(key, where, n, name, "is missing" if value is None else "is not a string",
                           "a standard preference record holds prompt, chosen and rejected strings (or all "
                           "three as message lists)")
        pair: dict[str, Any] = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    else:
        chosen = _messages(chosen, where, n, cfg.chosen_field, "chosen_field")
        rejected = _messages(rejected, where, n, cfg.rejected_field, "rejected_field")
        if prompt is None:  # implicit prompt: the turns both conversations begin with
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            if k == 0:
                raise _bad("prompt_field", where, n, cfg.prompt_field, "is missing and the chosen and rejected "
                           "conversations share no leading turn", "add the prompt turns, or a prompt field")
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        else:
            prompt = _messages(prompt, where, n, cfg.prompt_field, "prompt_field")
        pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if pair["chosen"] == pair["rejected"]:
        raise _bad("rejected_field", where, n, cfg.rejected_field, "is identical to the chosen completion",
                   "a pair must differ (drop the record)")
    return pair


def _texts_of(example: dict[str, Any]) -> str:
    if "chosen" in example:  # a preset tokenizer learns every side of a pair
        if isinstance(example["prompt"], str):
            return example["prompt"] + example["chosen"] + "\n" + example["rejected"]
        turns = [*example["prompt"], *example["chosen"], *example["rejected"]]
        return "\n".join(f"<|{t['role']}|>\n{t['content']}" for t in turns)
    if "messages" in example:  # role markers as the presets' template writes them: their tokens get merges
        return "\n".join(f"<|{t['role']}|>\n{t['content']}" for t in example["messages"])
    return example.get("text") or example["prompt"] + example["completion"]


def _tables(cfg: DataConfig, cache_dir: str) -> list[tuple[str, Any, str]]:
    """(where, datasets.Dataset, file suffix) for every source data.path names, in sorted file order."""
    assert cfg.path is not None
    if cfg.path.startswith(HUB_PREFIX):
        return [(hub_name(cfg.path)[0], _read_hub(cfg.path, cfg.split, cache_dir), "")]
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise missing_data(path)
    if saved_dataset_dir(path):
        return [(str(path), _read_saved(path, cfg.split), "")]
    files = [f for f in data_files(path) if f.stat().st_size > 0]  # empty files add nothing; builders fail on them
    out = []
    for suffix, group in groupby(files, key=lambda p: p.suffix.lower()):
        group = list(group)
        if suffix == ".txt":  # one call for a run of .txt files keeps the order and stays fast
            out.append((str(path), _read_files(suffix, group, cache_dir), suffix))
        else:  # one call per file, so a bad record is named by its file and record number
            out += [(str(f), _read_files(suffix, [f], cache_dir), suffix) for f in group]
    return out


def load_texts(data_cfg: DataConfig) -> Corpus:
    """The examples to train on: the synthetic corpus, or every record under data.path, as a Corpus."""
    if data_cfg.path is None:
        if data_cfg.format == "preference":
            pairs = synthetic_preference_pairs(data_cfg.synthetic_docs, data_cfg.seed)
            return Corpus([_texts_of(e) for e in pairs], "preference", pairs,
                          [("<synthetic pairs>", i + 1) for i in range(len(pairs))])
        if data_cfg.format not in ("auto", "text"):
            raise DataError(f"data.format: {data_cfg.format} needs data.path (the synthetic corpus is text)")
        return Corpus(synthetic_corpus(data_cfg.synthetic_docs, data_cfg.seed))
    examples: list[dict[str, Any]] = []
    origins: list[tuple[str, int]] = []
    formats: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="memfit-datasets-") as cache_dir:
        for where, ds, suffix in _tables(data_cfg, cache_dir):
            if ds.num_rows == 0:
                continue
            is_txt = suffix == ".txt"  # paragraphs are text whatever data.format says for the other files
            fmt = "text" if is_txt else detect_format(list(ds.column_names), data_cfg, where)
            cfg = data_cfg.model_copy(update={"text_field": "text"}) if is_txt else data_cfg
            numbers = record_lines(Path(where), suffix, ds.num_rows).tolist()
            # A slice at a time: the table's Python copy never exists whole beside the examples built from it.
            for start in range(0, ds.num_rows, _SLICE):
                rows = ds.select(range(start, min(start + _SLICE, ds.num_rows))).to_list()
                examples += normalise(rows, fmt, cfg, where, numbers[start:start + _SLICE])
            formats.add(fmt)
            origins += [(where, n) for n in numbers]
    if len(formats) > 1:
        raise DataError(f"data.path: {data_cfg.path} mixes formats ({', '.join(sorted(formats))}); "
                        "keep one format per run (or set data.format)")
    fmt = formats.pop() if formats else "text"
    keep = [i for i, e in enumerate(examples) if fmt != "text" or e["text"].strip()]
    examples, origins = [examples[i] for i in keep], [origins[i] for i in keep]
    if not examples:
        raise blank_data(Path(data_cfg.path))
    return Corpus([_texts_of(e) for e in examples], fmt, examples, origins)
