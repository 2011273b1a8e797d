"""Which files data.path names: the supported suffixes, folders, save_to_disk datasets, hub ids (no heavy imports)."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import DataError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv")
HUB_PREFIX = "hf:"  # data.path = hf:NAME[@REVISION] loads a dataset with datasets.load_dataset


def hub_name(path: str) -> tuple[str, str | None]:
    """(NAME, REVISION or None) of data.path hf:NAME[@REVISION]: a commit, tag or branch pins what is read."""
    name = path[len(HUB_PREFIX):]
    base, at, revision = name.rpartition("@")
    if at and base and revision and "/" not in revision:
        return base, revision
    return name, None


def data_files(path: Path) -> list[Path]:
    """The data files that data.path names (itself, or every one under a folder, sorted)."""
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataError(f"data.path: {path} has an unsupported extension {path.suffix or '(none)'!r}; "
                            "use a .txt (paragraphs), .jsonl (one JSON record per line), .json, .parquet or "
                            ".csv file")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
    if not files:
        raise DataError(f"data.path: folder {path} holds no .txt or .jsonl files (nor .json, .parquet, .csv, "
                        "nor a save_to_disk dataset); add some or point data.path at another folder")
    return files


def saved_dataset_dir(path: Path) -> bool:
    """Whether `path` is a folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def missing_data(path: Path) -> DataError:
    return DataError(f"data.path: {path} not found; point data.path at a .txt/.jsonl file or folder, "
                     "or unset it for the synthetic corpus")


def blank_data(path: Path) -> DataError:
    return DataError(f"data.path: {path} holds no non-blank text; add data or unset data.path "
                     "for the synthetic corpus")
