"""Files that are whole or absent: sha256, atomic file and JSON writes, staged folders committed by a rename."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHUNK_BYTES = 1 << 20
CACHE_ENV = "MEMFIT_CACHE_DIR"


def cache_root() -> Path:
    """$MEMFIT_CACHE_DIR (default ~/.cache/memfit): what memfit builds once per machine and reuses across runs."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/memfit").expanduser()


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks so multi-GB weights never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: str | Path) -> dict[str, Any]:
    """A manifest's entry for one file: its size and sha256."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def probe_writable(folder: Path) -> None:
    """Create `folder` if needed and prove it can be written now (OSError if not), before minutes of work."""
    folder.mkdir(parents=True, exist_ok=True)
    probe_file = folder / f".memfit-write-test-{os.getpid()}-{os.urandom(4).hex()}"
    probe_file.write_bytes(b"")
    probe_file.unlink()


def temporary_sibling(path: Path) -> Path:
    """A hidden name beside `path` (same folder, so a rename onto `path` is atomic), unique per writer."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary name to write; on success it replaces `path` in one rename, on error it is removed.

    A reader sees the old file or the new one, never half of one.
    """
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, payload: Any, **dumps: Any) -> None:
    """`payload` as JSON at `path`, replaced atomically; `dumps` go to json.dumps (indent, sort_keys, ...)."""
    write_text_atomic(path, json.dumps(payload, **dumps))


def fsync_tree(root: Path) -> None:
    """Flush every file under `root` to disk."""
    # Renames are atomic, but without fsync a crash right after one can leave empty files behind it.
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


@contextmanager
def staged_folder(final: Path) -> Iterator[Path]:
    """A new empty folder beside `final` to stage into; whatever is left in it is removed on the way out.

    Beside, not in /tmp: the commit is then a rename on the same filesystem.
    """
    tmp = temporary_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def commit_folder(staged: Path, final: Path) -> None:
    """Swap `staged` in as `final` (fsynced first); an existing `final` is renamed aside and deleted last.

    NotADirectoryError when `final` exists and is not a folder (the caller says what to do about it).
    """
    fsync_tree(staged)
    old = None
    if final.exists() or final.is_symlink():
        if not final.is_dir():
            raise NotADirectoryError(f"{final} exists and is not a folder")
        old = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, old)
    try:
        os.rename(staged, final)
    except OSError:
        if old is not None:
            os.rename(old, final)  # put the previous folder back: never leave no `final` at all
        raise
    if old is not None and old.is_symlink():
        old.unlink()  # final was a link to a folder: drop the link, not what it points to
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)
