"""Object stores for training checkpoints: open_store() picks a local folder or S3 from a URI."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from memfit.errors import ConfigError
from memfit.storage.base import KeyNotFound, ObjectStore, StorageError, join_key
from memfit.storage.local import LocalStore

if TYPE_CHECKING:
    from memfit.config import MemfitConfig

__all__ = [
    "KeyNotFound", "LocalStore", "ObjectStore", "S3Store", "StorageError",
    "is_remote", "join_key", "open_checkpoint_store", "open_store",
]  # fmt: skip

_SUPPORTED = "s3://bucket/prefix, file:///path or a plain local path"


def __getattr__(name: str) -> Any:
    # S3Store is imported on demand so `import memfit.storage` never drags in boto3.
    if name == "S3Store":
        from memfit.storage.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _scheme(uri: str) -> str:
    # Only "scheme://" counts as a URI, so "C:\\ckpt" or "ckpt:v2" stay plain paths.
    return uri.split("://", 1)[0].lower() if "://" in uri else ""


def is_remote(uri: str) -> bool:
    """True when uri names a store on another machine (anything with a scheme other than file://)."""
    return _scheme(str(uri)) not in ("", "file")


def open_store(uri: str | Path, **kwargs: Any) -> ObjectStore:
    """Open the store named by uri: s3:// -> S3Store(uri, **kwargs); file:// or a plain path -> LocalStore."""
    uri = str(uri)
    scheme = _scheme(uri)
    if scheme == "s3":
        from memfit.storage.s3 import S3Store

        return S3Store(uri, **kwargs)
    if scheme not in ("", "file"):
        raise StorageError(f"unsupported storage uri {uri!r}: supported are {_SUPPORTED}")
    # Config files pass every option (endpoint_url=None, ...) whatever the scheme; only real values matter.
    extra = sorted(k for k, v in kwargs.items() if v is not None)
    if extra:
        raise StorageError(f"option(s) {', '.join(extra)} only apply to s3:// uris, not to {uri!r}")
    if scheme == "file":
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"unsupported file uri {uri!r}: use file:///absolute/path (no host)")
        path = unquote(parsed.path)
        if not path:
            raise StorageError(f"file uri {uri!r} has no path: use file:///absolute/path")
        return LocalStore(path)
    if not uri.strip():
        raise StorageError(f"empty storage uri: expected {_SUPPORTED}")
    return LocalStore(uri)


def open_checkpoint_store(cfg: MemfitConfig) -> Any:
    """The store at checkpoint.uri, with the S3 settings of the config (credentials: boto3's own chain)."""
    ck = cfg.checkpoint
    if is_remote(ck.uri):
        return open_store(ck.uri, endpoint_url=ck.endpoint_url, region=ck.region,
                          multipart_threshold_mb=ck.multipart_threshold_mb)
    for name in ("endpoint_url", "region"):
        if getattr(ck, name) is not None:
            raise ConfigError(f"checkpoint.{name} only applies to s3:// uris, not checkpoint.uri={ck.uri!r}")
    return open_store(ck.uri)
