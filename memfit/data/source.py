"""A run's data source, read once: its content fingerprint, its records (lazily), and their digest kept on disk."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from memfit.config import DataConfig
from memfit.data.files import HUB_PREFIX, data_files, missing_data, saved_dataset_dir
from memfit.files import write_json_atomic

log = logging.getLogger("memfit.data")
_READER = ("path", "format", "text_field", "prompt_field", "completion_field", "messages_field", "chosen_field",
           "rejected_field", "split")
# In-process memo: the records of a fingerprint, so the phases of one process read a source once.
_CORPORA: dict[str, Any] = {}
_HASHES: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _HASHES:
        with path.open("rb") as f:
            _HASHES[memo] = hashlib.file_digest(f, "sha256").hexdigest()
    return _HASHES[memo]


def source_fingerprint(data: DataConfig) -> str:
    """sha256 of what decides the records: the reader settings and every source file's bytes (a saved dataset's
    files too); a hub dataset by name and split. Cheap next to reading: no record is parsed."""
    parts: dict[str, Any] = {k: getattr(data, k) for k in _READER}
    if data.path is None:
        parts["synthetic"] = [data.synthetic_docs, data.seed]
    elif not data.path.startswith(HUB_PREFIX):
        path = Path(data.path).expanduser()
        if not path.exists():
            raise missing_data(path)
        files = (sorted(p for p in path.rglob("*") if p.is_file()) if saved_dataset_dir(path)
                 else data_files(path))
        root = path if path.is_dir() else path.parent
        parts["files"] = [[str(f.relative_to(root)), f.stat().st_size, _file_sha256(f)] for f in files]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class DataSource:
    """data.path as a run sees it: `fingerprint` at once, the records (`corpus()`) and their digest only when
    needed. The digest is kept beside the packed-data cache by fingerprint, so a later phase or run whose packed
    rows are cached never reads a record."""

    def __init__(self, data: DataConfig, work_dir: str | Path) -> None:
        self.data = data
        self.fingerprint = source_fingerprint(data)
        self._sidecar = Path(work_dir) / "data-cache" / f"source-{self.fingerprint}.json"
        # datasets' Arrow copies of the files, kept: the scan and the packing convert each file once
        self.arrow_dir = str(Path(work_dir) / "data-cache" / "datasets")
        self._digest: str | None = None

    def corpus(self) -> Any:
        """The records as a Corpus (formats.load_texts), read once per process."""
        if self.fingerprint not in _CORPORA:
            from memfit.data.formats import load_texts

            _CORPORA.clear()  # one source a process at a time: a corpus can be large
            _CORPORA[self.fingerprint] = load_texts(self.data)
        return _CORPORA[self.fingerprint]

    def known(self) -> dict[str, Any] | None:
        """What an earlier read of these bytes recorded (digest, format, examples), or None. A hub dataset's
        fingerprint is its name, not its bytes (a new version upstream keeps the name): never taken as known."""
        if self.data.path is not None and self.data.path.startswith(HUB_PREFIX):
            return None
        try:
            return json.loads(self._sidecar.read_text())
        except (OSError, ValueError):
            return None

    def remember(self, digest: str, fmt: str, examples: int) -> None:
        self._digest = digest
        try:
            self._sidecar.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._sidecar, {"digest": digest, "format": fmt, "examples": examples})
        except OSError as err:  # only a shortcut: the next process reads the records again
            log.warning("data: could not record the data digest in %s (%s)", self._sidecar, err)

    def digest(self) -> str:
        """data_digest of the records (formats.data_digest), from the record of an earlier read when there is
        one; else the records are read (and checked) a batch at a time, without holding them (arrow_text; arrow_examples
        in data.num_proc workers)."""
        if self._digest is None:
            known = self.known()
            if self.data.streaming:  # the records are checked as they stream: the files' bytes name the data
                self._digest = self.fingerprint
            elif known is not None:
                self._digest = str(known["digest"])
            elif self.fingerprint in _CORPORA:  # read already in this process: its digest costs nothing more
                corpus = self.corpus()
                self.remember(corpus.digest(), corpus.format, len(corpus.examples))
            else:  # checked and digested a batch of records at a time, never all held
                from memfit.data.arrow_examples import scan_records
                from memfit.data.arrow_text import scan_text
                from memfit.data.workers import num_proc

                plain = self.data.packing == "blocks" and self.data.train_on == "all"
                text = scan_text(self.data, self.arrow_dir) if plain else None
                if text is not None:
                    self.remember(text.digest, "text", text.examples)
                else:
                    scanned = scan_records(self.data, self.arrow_dir, num_proc(self.data))
                    if scanned is None:  # the synthetic corpus: small, made in memory
                        corpus = self.corpus()
                        self.remember(corpus.digest(), corpus.format, len(corpus.examples))
                    else:
                        self.remember(scanned.digest, scanned.format, scanned.examples)
        assert self._digest is not None
        return self._digest

    def release(self) -> None:
        """Drop this process's copy of the records (preflight checks them and moves on)."""
        _CORPORA.pop(self.fingerprint, None)

    def texts(self) -> list[str]:
        """The texts a preset's tokenizer learns (the Corpus itself)."""
        return self.corpus()
