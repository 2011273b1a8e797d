"""The ObjectStore protocol every checkpoint backend implements, plus key helpers and errors."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from memfit.errors import StorageError

__all__ = ["KeyNotFound", "ObjectStore", "StorageError", "check_key", "check_prefix", "join_key"]

# Suffix of in-flight temp files; list() hides them so a reader never picks up half a file.
TEMP_SUFFIX = ".memfit-tmp"
# Probe objects written by check_writable(); a dot name keeps them out of the way if one is left behind.
PROBE_PREFIX = ".memfit-write-probe-"


class KeyNotFound(StorageError):
    """The key does not exist in the store."""


@runtime_checkable
class ObjectStore(Protocol):
    """A flat key -> bytes store with "/"-separated keys relative to the store root.

    Prefixes passed to list()/delete_prefix() name a folder: "ckpt/step-1" matches
    "ckpt/step-1/model.bin" but not "ckpt/step-10/..." (deleting step-1 must not take step-10 with it).
    """

    uri: str

    def put_file(self, local_path: str | Path, key: str, *, consume: bool = False) -> None:
        """Upload a local file under key, replacing any previous object. `consume`: the caller never changes
        local_path again (a staged file it only deletes), so a local store may take the file itself."""
        ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store data under key, replacing any previous object."""
        ...

    def get_file(self, key: str, local_path: str | Path) -> None:
        """Download key to local_path atomically (temp file in the same folder, then os.replace)."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """Return the object's bytes; KeyNotFound if missing."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """All keys under prefix (recursive), relative to the store root, sorted."""
        ...

    def exists(self, key: str) -> bool:
        """True if an object is stored under key."""
        ...

    def delete(self, key: str) -> None:
        """Delete key; a missing key is not an error."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under the (non-empty) folder prefix."""
        ...

    def check_writable(self) -> None:
        """Write, read back and delete a small probe; StorageError naming the uri and the fix otherwise."""
        ...

    def describe(self) -> str:
        """One human line saying where objects go (never credentials)."""
        ...


def join_key(*parts: str) -> str:
    """Join key parts with "/", dropping empty parts and stray slashes at the joins."""
    cleaned = [str(p).strip("/") for p in parts]
    return "/".join(p for p in cleaned if p)


def _check_segments(text: str, what: str) -> None:
    # The same rules for both backends, so a key valid on S3 is valid on disk and vice versa.
    if "\\" in text or "\x00" in text:
        raise StorageError(f"invalid {what} {text!r}: use '/' as separator and no NUL characters")
    for seg in text.split("/"):
        if seg in ("", ".", ".."):
            raise StorageError(
                f"invalid {what} {text!r}: empty, '.' or '..' segments are not allowed "
                "(keys must stay inside the store root)"
            )
        if seg.endswith(TEMP_SUFFIX):
            raise StorageError(f"invalid {what} {text!r}: names ending in {TEMP_SUFFIX!r} are reserved")


def check_key(key: str) -> str:
    """Validate an object key (relative, "/"-separated, no '..') and return it unchanged."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"invalid key {key!r}: must be a non-empty string")
    if key.startswith("/"):
        raise StorageError(f"invalid key {key!r}: keys are relative to the store root (no leading '/')")
    _check_segments(key, "key")
    return key


def check_prefix(prefix: str, *, allow_empty: bool = True) -> str:
    """Validate a folder prefix and return it normalised to "" or "a/b/" (trailing slash)."""
    if not isinstance(prefix, str):
        raise StorageError(f"invalid prefix {prefix!r}: must be a string")
    stripped = prefix.strip("/")
    if not stripped:
        if not allow_empty:
            raise StorageError("refusing an empty prefix here: it would address the whole store")
        return ""
    if prefix.startswith("/"):
        raise StorageError(f"invalid prefix {prefix!r}: prefixes are relative to the store root")
    _check_segments(stripped, "prefix")
    return stripped + "/"
