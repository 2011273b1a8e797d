"""S3Store: an ObjectStore on S3 or an S3-compatible server (MinIO, moto), via boto3."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from memfit.storage.base import PROBE_PREFIX, TEMP_SUFFIX, KeyNotFound, StorageError, check_key, check_prefix

_MIB = 1024 * 1024
# S3 rejects multipart parts under 5 MiB (except the last), so chunks never go below it.
_MIN_PART = 5 * _MIB
_DELETE_BATCH = 1000  # the DeleteObjects API limit per call
_CRED_CODES = {
    "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "InvalidClientTokenId", "UnrecognizedClientException", "TokenRefreshRequired",
}  # fmt: skip
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
# botocore's "max_attempts" counts retries, so this is 6 calls in all; "total_max_attempts" counts calls.
_RETRIES = {"mode": "standard", "max_attempts": 5}
_PROBE_RETRIES = {"mode": "standard", "total_max_attempts": 2}
_CRED_HINT = "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or the profile"


def _retries() -> dict[str, Any]:
    # AWS_MAX_ATTEMPTS / AWS_RETRY_MODE win, as with every AWS tool (an explicit Config would hide them).
    mode = os.environ.get("AWS_RETRY_MODE") or _RETRIES["mode"]
    raw = os.environ.get("AWS_MAX_ATTEMPTS")
    if not raw:
        return {**_RETRIES, "mode": mode}
    try:
        total = int(raw)
        if total < 1:
            raise ValueError
    except ValueError:
        raise StorageError(f"AWS_MAX_ATTEMPTS={raw!r}: expected a whole number of attempts >= 1") from None
    return {"mode": mode, "total_max_attempts": total}


def _root_cause(exc: BaseException) -> BaseException:
    # boto3 wraps upload ClientErrors in S3UploadFailedError (chained implicitly); the
    # inner botocore error carries the code we need to give a useful message.
    from botocore.exceptions import BotoCoreError, ClientError

    seen = exc
    while seen is not None and not isinstance(seen, (ClientError, BotoCoreError, StorageError)):
        seen = seen.__cause__ or seen.__context__
    return seen if seen is not None else exc


def map_s3_error(
    exc: BaseException, *, uri: str, endpoint: str, bucket: str, key: str | None = None, action: str = "use"
) -> StorageError:
    """Turn a boto3/botocore exception into a StorageError a user can act on (never containing secrets).

    key is the full S3 key, or None for bucket-level calls (then a 404 means the bucket is missing).
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionClosedError,
        ConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    cause = _root_cause(exc)
    if isinstance(cause, StorageError):
        return cause
    where = f"s3://{bucket}/{key}" if key else uri
    name = type(cause).__name__
    if isinstance(cause, ClientError):
        err = cause.response.get("Error") or {}
        code, msg = str(err.get("Code", "")), err.get("Message", "")
        if code == "NoSuchBucket" or (key is None and code in _MISSING_CODES):
            text = (
                f"bucket {bucket} does not exist at {endpoint}; "
                f"create it (aws s3 mb s3://{bucket}) or fix checkpoint.uri ({uri})"
            )
        elif code in _MISSING_CODES:
            return KeyNotFound(f"key {where} not found at {endpoint}")
        elif code in _CRED_CODES:
            # A bare 403 (HEAD has no error body) may also be a policy denial: say both.
            text = f"credentials rejected by {endpoint} ({code}) while trying to {action} {where}; "
            text += _CRED_HINT + (f", and that they may use bucket {bucket}" if code == "403" else "")
        elif code == "AccessDenied":
            text = (
                f"access denied by {endpoint} while trying to {action} {where}: these credentials may not "
                f"use bucket {bucket}; fix the bucket/IAM policy or {_CRED_HINT}"
            )
        elif code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
            headers = cause.response.get("ResponseMetadata", {}).get("HTTPHeaders") or {}
            region = headers.get("x-amz-bucket-region", "another region")
            text = f"bucket {bucket} is in {region}, not the client's region at {endpoint}; "
            text += "pass region= or set AWS_REGION"
        else:
            text = f"cannot {action} {where} at {endpoint}: {code or 'error'}: {msg}".rstrip(": ")
    elif isinstance(cause, ConnectionError):
        text = (
            f"cannot reach {endpoint} to {action} {where} ({name}); check that the S3 server is up and the "
            "endpoint (endpoint_url / AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) is right"
        )
    elif isinstance(cause, (ConnectionClosedError, ReadTimeoutError)):
        text = (
            f"connection to {endpoint} dropped or timed out while trying to {action} {where}, even after "
            f"retries ({name}); the server is reachable but unhealthy or overloaded: try again"
        )
    elif isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
        text = f"no usable AWS credentials to {action} {where} at {endpoint}; set AWS_ACCESS_KEY_ID and "
        text += "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    elif isinstance(cause, BotoCoreError):
        text = f"cannot {action} {where} at {endpoint}: {cause}"
    else:
        text = f"cannot {action} {where} at {endpoint}: {type(exc).__name__}: {exc}"
    return StorageError(text)


class S3Store:
    """An ObjectStore under s3://bucket/prefix; endpoint, region, credentials follow boto3's usual rules."""

    def __init__(
        self, uri: str, *, endpoint_url: str | None = None, region: str | None = None, client: Any = None,
        multipart_threshold_mb: int = 64,
    ):  # fmt: skip
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StorageError(f"invalid S3 uri {uri!r}: expected s3://bucket[/prefix]")
        self.bucket = parsed.netloc
        self.prefix = check_prefix(parsed.path.lstrip("/")).rstrip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""  # prepended to every key
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._endpoint_arg = endpoint_url
        self._region_arg = region
        self._client = client
        self._given_client = client is not None
        if multipart_threshold_mb <= 0:
            raise StorageError(f"multipart_threshold_mb must be positive, got {multipart_threshold_mb}")
        self._threshold = int(multipart_threshold_mb * _MIB)

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    def _make_client(self, *, retries: dict, connect_timeout: float, read_timeout: float) -> Any:
        # Lazy: boto3 is a heavy optional import and local-only users never pay for it.
        import boto3
        from botocore.config import Config

        # "standard" retries 5xx, throttling and connection resets with jittered backoff; path-style
        # addressing because MinIO, moto and most S3-compatible servers lack virtual-host DNS.
        config = Config(
            retries=retries, connect_timeout=connect_timeout, read_timeout=read_timeout,
            s3={"addressing_style": "path"},
        )  # fmt: skip
        # endpoint_url/region None -> boto3 resolves AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
        # AWS_REGION, profiles and the credential chain itself.
        try:
            return boto3.session.Session().client(
                "s3", endpoint_url=self._endpoint_arg, region_name=self._region_arg, config=config
            )
        except Exception as exc:  # e.g. a malformed endpoint URL, an unknown AWS_PROFILE
            where = dict(uri=self.uri, endpoint=self._endpoint_arg or "the AWS endpoint", bucket=self.bucket)
            raise map_s3_error(exc, action="connect to", **where) from exc

    @property
    def client(self) -> Any:
        """The boto3 S3 client, created on first use."""
        if self._client is None:  # a race only builds a spare client; boto3 clients are thread-safe
            self._client = self._make_client(retries=_retries(), connect_timeout=5, read_timeout=60)
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        chunk = max(self._threshold, _MIN_PART)
        return TransferConfig(multipart_threshold=self._threshold, multipart_chunksize=chunk)

    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _err(self, exc: BaseException, action: str, full_key: str | None) -> StorageError:
        if isinstance(exc, StorageError):  # already mapped (e.g. client creation failed)
            return exc
        where = dict(uri=self.uri, endpoint=self.endpoint, bucket=self.bucket)
        return map_s3_error(exc, key=full_key, action=action, **where)

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        try:
            if len(data) > self._threshold:
                # Above the threshold one PUT risks the 5 GiB limit and loses all progress on a reset.
                config = self._transfer_config()
                self.client.upload_fileobj(io.BytesIO(data), self.bucket, full, Config=config)
            else:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=data)
        except Exception as exc:
            raise self._err(exc, "write", full) from exc

    def put_file(self, local_path: str | Path, key: str, *, consume: bool = False) -> None:
        full = self._full(key)
        src = Path(local_path)
        if not src.is_file():
            raise StorageError(f"cannot upload {src}: not a file (destination s3://{self.bucket}/{full})")
        try:
            self.client.upload_file(str(src), self.bucket, full, Config=self._transfer_config())
        except Exception as exc:
            raise self._err(exc, "upload to", full) from exc

    def get_bytes(self, key: str) -> bytes:
        full = self._full(key)
        try:
            return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
        except Exception as exc:
            raise self._err(exc, "read", full) from exc

    def get_file(self, key: str, local_path: str | Path) -> None:
        full = self._full(key)
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Same folder so os.replace is an atomic rename; a reader never sees half a download.
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
        try:
            self.client.download_file(self.bucket, full, str(tmp), Config=self._transfer_config())
            os.replace(tmp, dest)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, Exception):
                raise self._err(exc, "download", full) from exc
            raise

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self.client.head_object(Bucket=self.bucket, Key=full)
            return True
        except Exception as exc:
            err = self._err(exc, "check", full)
            if isinstance(err, KeyNotFound):
                return False
            raise err from exc

    def list(self, prefix: str = "") -> list[str]:
        root, norm = self._root, check_prefix(prefix)
        keys = []
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root + norm):
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(root) :]
                    # Console "folders" are zero-byte keys ending in "/": not objects for us.
                    if rel and not rel.endswith("/"):
                        keys.append(rel)
        except Exception as exc:
            raise self._err(exc, "list", (root + norm) or None) from exc
        return sorted(keys)

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=full)  # 204 for a missing key too
        except Exception as exc:
            raise self._err(exc, "delete", full) from exc

    def delete_prefix(self, prefix: str) -> None:
        norm = check_prefix(prefix, allow_empty=False)
        root = self._root
        keys = [root + k for k in self.list(norm)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            try:
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except Exception as exc:
                raise self._err(exc, "delete", root + norm) from exc
            # DeleteObjects reports per-key failures in a 200 response; don't let them pass silently.
            errors = resp.get("Errors") or []
            if errors:
                e = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} object(s) under s3://{self.bucket}/{root + norm} at "
                    f"{self.endpoint}, e.g. {e.get('Key')}: {e.get('Code')} {e.get('Message', '')}"
                )

    def check_writable(self) -> None:
        # A separate client with 2 attempts in total and short timeouts: a down endpoint must fail
        # in seconds at startup, not after the main client's full retry budget.
        if self._given_client:
            probe_client = self._client  # the caller's own settings; we cannot clone them
        else:
            probe_client = self._make_client(retries=_PROBE_RETRIES, connect_timeout=2, read_timeout=10)
        endpoint = str(probe_client.meta.endpoint_url)
        mapped = dict(uri=self.uri, endpoint=endpoint, bucket=self.bucket)
        try:
            probe_client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            raise map_s3_error(exc, key=None, action="open bucket", **mapped) from exc
        probe = self._full(PROBE_PREFIX + uuid.uuid4().hex)
        payload = b"memfit write probe"
        try:
            probe_client.put_object(Bucket=self.bucket, Key=probe, Body=payload)
            body = probe_client.get_object(Bucket=self.bucket, Key=probe)["Body"].read()
            probe_client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as exc:
            err = map_s3_error(exc, key=probe, action="write a probe object to", **mapped)
            raise StorageError(f"{self.uri} is not writable: {err}") from exc
        if body != payload:
            raise StorageError(f"{self.uri} at {endpoint} returned different bytes than were written")

    def describe(self) -> str:
        region = self.client.meta.region_name or "default region"
        where = f"prefix {self.prefix}" if self.prefix else "bucket root"
        return f"S3 bucket {self.bucket} ({where}) at {self.endpoint}, {region}"
