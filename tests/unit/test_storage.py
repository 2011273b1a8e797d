"""Contract tests for memfit.storage: one suite run against LocalStore and S3Store (moto over HTTP)."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from memfit.errors import MemfitError
from memfit.storage import (
    KeyNotFound,
    LocalStore,
    ObjectStore,
    StorageError,
    is_remote,
    join_key,
    open_store,
)
from memfit.storage.base import TEMP_SUFFIX
from memfit.storage.s3 import S3Store, map_s3_error

pytestmark = pytest.mark.unit

MB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalStore(str(tmp_path / "store"))
    _endpoint, bucket = request.getfixturevalue("s3_bucket")
    # No endpoint_url: boto3 must pick up AWS_ENDPOINT_URL_S3 from s3_env by itself.
    return S3Store(f"s3://{bucket}/runs/r1", multipart_threshold_mb=5)


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(TEMP_SUFFIX)]


# -- the contract, both backends -------------------------------------------------------------------


def test_is_an_object_store(store):
    assert isinstance(store, ObjectStore)
    assert isinstance(store.describe(), str) and store.describe()


def test_bytes_roundtrip_and_overwrite(store):
    store.put_bytes("a/b.txt", b"one")
    assert store.get_bytes("a/b.txt") == b"one"
    store.put_bytes("a/b.txt", b"two, longer")
    assert store.get_bytes("a/b.txt") == b"two, longer"
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b""


def test_file_roundtrip(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x00\x01payload" * 100)
    store.put_file(src, "ckpt/step-1/model.bin")
    dest = tmp_path / "out" / "nested" / "model.bin"  # parent folders do not exist yet
    store.get_file("ckpt/step-1/model.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert _temp_files(tmp_path / "out") == []
    # Overwrite through put_file and download over an existing file.
    src.write_bytes(b"v2")
    store.put_file(str(src), "ckpt/step-1/model.bin")
    store.get_file("ckpt/step-1/model.bin", str(dest))
    assert dest.read_bytes() == b"v2"


def test_a_consumed_file_is_taken_whole_by_a_local_store_and_uploaded_by_s3(store, tmp_path):
    src = tmp_path / "staged" / "model.safetensors"
    src.parent.mkdir()
    src.write_bytes(b"weights" * 1000)
    store.put_file(src, "ckpt/step-2/model.safetensors", consume=True)
    dest = tmp_path / "back.bin"
    store.get_file("ckpt/step-2/model.safetensors", dest)
    assert dest.read_bytes() == src.read_bytes()
    if isinstance(store, LocalStore):  # the same file, not a second copy; the staged name can go
        stored = Path(store.root) / "ckpt" / "step-2" / "model.safetensors"
        assert stored.stat().st_ino == src.stat().st_ino and _temp_files(Path(store.root)) == []
        src.unlink()
        assert stored.read_bytes() == b"weights" * 1000
        store.put_file(dest, "ckpt/step-2/copy.bin")  # not consumed: a copy, as before
        assert (stored.parent / "copy.bin").stat().st_ino != dest.stat().st_ino


def test_a_consumed_file_is_copied_where_no_link_can_be_made(tmp_path, monkeypatch):
    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    store = LocalStore(tmp_path / "store")
    src = tmp_path / "model.bin"
    src.write_bytes(b"x" * 100)
    store.put_file(src, "a/model.bin", consume=True)
    stored = tmp_path / "store" / "a" / "model.bin"
    assert stored.read_bytes() == b"x" * 100 and stored.stat().st_ino != src.stat().st_ino
    assert _temp_files(tmp_path / "store") == []


def test_list_with_prefixes(store):
    for key in ["b", "a/2/x", "a/1", "ab/3", "step-1/m", "step-10/m"]:
        store.put_bytes(key, key.encode())
    assert store.list() == ["a/1", "a/2/x", "ab/3", "b", "step-1/m", "step-10/m"]
    assert store.list("a") == ["a/1", "a/2/x"]  # a folder: "ab/3" is not under "a"
    assert store.list("a/") == ["a/1", "a/2/x"]
    assert store.list("a/2") == ["a/2/x"]
    assert store.list("step-1") == ["step-1/m"]
    assert store.list("nothing-here") == []


def test_exists_and_delete(store):
    store.put_bytes("x/y", b"1")
    assert store.exists("x/y")
    assert not store.exists("x")  # a folder is not an object
    assert not store.exists("x/z")
    store.delete("x/y")
    assert not store.exists("x/y")
    store.delete("x/y")  # missing is fine
    store.delete("never/there")


def test_delete_prefix(store):
    for key in ["step-1/a", "step-1/sub/b", "step-10/a", "keep"]:
        store.put_bytes(key, b"1")
    store.delete_prefix("step-1")
    assert store.list() == ["keep", "step-10/a"]  # step-10 survives deleting step-1
    store.delete_prefix("missing/")  # nothing to delete is fine
    with pytest.raises(StorageError, match="empty prefix"):
        store.delete_prefix("")


def test_delete_prefix_in_batches(store, monkeypatch):
    import memfit.storage.s3 as s3

    # 1000 keys (the DeleteObjects limit) is too slow here: shrink the batch to force several calls.
    monkeypatch.setattr(s3, "_DELETE_BATCH", 7)
    for i in range(30):
        store.put_bytes(f"many/{i:03d}", b"x")
    store.put_bytes("other", b"x")
    calls = []
    if isinstance(store, S3Store):
        store.client.meta.events.register("before-call.s3.DeleteObjects", lambda **kw: calls.append(1))
    store.delete_prefix("many")
    assert store.list() == ["other"]
    if isinstance(store, S3Store):
        assert len(calls) == 5  # ceil(30 / 7)


def test_missing_key_raises_key_not_found(store, tmp_path):
    with pytest.raises(KeyNotFound) as info:
        store.get_bytes("no/such/key")
    assert isinstance(info.value, StorageError) and isinstance(info.value, MemfitError)
    assert "no/such/key" in str(info.value)
    dest = tmp_path / "dl" / "f.bin"
    with pytest.raises(KeyNotFound):
        store.get_file("no/such/key", dest)
    assert not dest.exists()
    assert _temp_files(tmp_path / "dl") == []


@pytest.mark.parametrize("bad", ["", "../x", "a/../../x", "/abs", "a//b", "./a", "a\\b", "x.memfit-tmp"])
def test_bad_keys_rejected(store, bad):
    with pytest.raises(StorageError):
        store.put_bytes(bad, b"nope")


def test_check_writable_leaves_nothing(store):
    store.check_writable()
    assert store.list() == []


def test_multipart_roundtrip(store, tmp_path):
    data = os.urandom(6 * MB)  # threshold is 5 MiB: two parts on S3
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.put_file(src, "big/file.bin")
    store.put_bytes("big/bytes.bin", data)  # bytes above the threshold take the multipart path too
    out = tmp_path / "big.out"
    store.get_file("big/file.bin", out)
    assert out.read_bytes() == data
    assert store.get_bytes("big/bytes.bin") == data
    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key="runs/r1/big/file.bin")
        assert head["ETag"].strip('"').endswith("-2"), head["ETag"]  # really a 2-part upload


# -- LocalStore specifics ---------------------------------------------------------------------------


def test_local_put_leaves_no_temp_files_and_list_ignores_them(tmp_path):
    store = LocalStore(str(tmp_path))
    store.put_bytes("a/b", b"1")
    store.put_file(__file__, "a/c")
    assert _temp_files(tmp_path) == []
    (tmp_path / "a" / f".b.deadbeef{TEMP_SUFFIX}").write_bytes(b"half")  # an abandoned write
    assert store.list() == ["a/b", "a/c"]


def test_local_failure_mid_write_leaves_old_content(tmp_path, monkeypatch):
    import memfit.storage.local as local

    store = LocalStore(str(tmp_path))
    store.put_bytes("ckpt/state", b"old")

    def half_then_fail(src, dst, length=0):
        dst.write(src.read(3))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local.shutil, "copyfileobj", half_then_fail)
    src = tmp_path / "new.bin"
    src.write_bytes(b"new content")
    with pytest.raises(StorageError, match="No space left"):
        store.put_file(src, "ckpt/state")
    with pytest.raises(StorageError):
        store.put_file(src, "ckpt/fresh")
    assert store.get_bytes("ckpt/state") == b"old"
    assert not store.exists("ckpt/fresh")
    assert _temp_files(tmp_path) == []


def test_local_failure_in_fsync_leaves_no_file(tmp_path, monkeypatch):
    import memfit.storage.local as local

    def boom(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local.os, "fsync", boom)
    store = LocalStore(str(tmp_path / "s"))
    with pytest.raises(StorageError, match="Input/output error"):
        store.put_bytes("k", b"data")
    assert not (tmp_path / "s" / "k").exists()
    assert _temp_files(tmp_path) == []


def test_local_key_escaping_root_writes_nothing_outside(tmp_path):
    store = LocalStore(str(tmp_path / "root"))
    with pytest.raises(StorageError, match=r"\.\."):
        store.put_bytes("../outside", b"x")
    assert not (tmp_path / "outside").exists()
    with pytest.raises(StorageError):
        store.delete_prefix("..")


def test_local_check_writable_names_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = LocalStore(str(blocker / "sub"))
    with pytest.raises(StorageError, match="not writable") as info:
        store.check_writable()
    assert str(blocker) in str(info.value)


# -- open_store / helpers ---------------------------------------------------------------------------


def test_open_store_dispatch(tmp_path):
    plain = open_store(str(tmp_path / "p"))
    assert isinstance(plain, LocalStore) and plain.root == (tmp_path / "p").resolve()
    via_uri = open_store((tmp_path / "q").as_uri())
    assert isinstance(via_uri, LocalStore) and via_uri.root == (tmp_path / "q").resolve()
    assert isinstance(open_store(str(tmp_path), endpoint_url=None), LocalStore)  # unset options are fine
    s3 = open_store("s3://bucket/some/prefix/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s3, S3Store) and s3.uri == "s3://bucket/some/prefix"
    assert (s3.bucket, s3.prefix) == ("bucket", "some/prefix")


@pytest.mark.parametrize("uri", ["gs://bucket/x", "http://example.invalid/x", "azure://c/p"])
def test_open_store_bad_scheme(uri):
    with pytest.raises(StorageError) as info:
        open_store(uri)
    assert uri in str(info.value) and "s3://" in str(info.value) and "file://" in str(info.value)


def test_open_store_rejects_s3_options_for_local(tmp_path):
    with pytest.raises(StorageError, match="endpoint_url"):
        open_store(str(tmp_path), endpoint_url="http://127.0.0.1:9")


def test_is_remote_and_join_key():
    assert is_remote("s3://b/p") and is_remote("gs://b")
    assert not is_remote("/tmp/x") and not is_remote("file:///tmp/x") and not is_remote("rel/dir")
    assert join_key("a/", "/b/", "", "c") == "a/b/c"
    assert join_key() == ""


def test_invalid_s3_uri():
    with pytest.raises(StorageError, match="s3://bucket"):
        S3Store("s3:///no-bucket")
    with pytest.raises(StorageError):
        S3Store("s3://bucket/../up")


# -- S3Store specifics ------------------------------------------------------------------------------


def test_s3_client_config(s3_bucket):
    endpoint, bucket = s3_bucket
    store = S3Store(f"s3://{bucket}", endpoint_url=endpoint)
    cfg = store.client.meta.config
    # botocore turns max_attempts=5 (retries) into total_max_attempts=6 (calls).
    assert cfg.retries == {"mode": "standard", "total_max_attempts": 6}
    assert (cfg.connect_timeout, cfg.read_timeout) == (5, 60)
    assert cfg.s3["addressing_style"] == "path"
    assert endpoint in store.describe() and bucket in store.describe()


def test_s3_explicit_endpoint_wins_over_env(s3_bucket, monkeypatch):
    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{_closed_port()}")
    store = S3Store(f"s3://{bucket}/p", endpoint_url=endpoint)
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"


def test_s3_accepts_a_given_client(s3_bucket, s3_client):
    _endpoint, bucket = s3_bucket
    store = S3Store(f"s3://{bucket}", client=s3_client)
    store.put_bytes("k", b"v")
    assert store.list() == ["k"]
    store.check_writable()


def test_s3_retries_transient_503(s3_bucket):
    from botocore.awsrequest import AWSResponse

    endpoint, bucket = s3_bucket
    store = S3Store(f"s3://{bucket}", endpoint_url=endpoint)
    calls = []

    class Raw:
        def stream(self, *args, **kwargs):
            yield b"<Error><Code>ServiceUnavailable</Code><Message>busy</Message></Error>"

    def flaky(request, **kwargs):
        calls.append(1)
        if len(calls) <= 2:  # answer 503 twice without reaching the server, then let it through
            return AWSResponse(request.url, 503, {}, Raw())
        return None

    store.client.meta.events.register("before-send.s3.PutObject", flaky)
    store.put_bytes("k", b"v")
    assert len(calls) == 3 and store.get_bytes("k") == b"v"


def test_s3_missing_bucket(s3_env):
    store = S3Store("s3://memfit-no-such-bucket/p")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    msg = str(info.value)
    assert "bucket memfit-no-such-bucket does not exist at " + s3_env in msg
    assert "aws s3 mb s3://memfit-no-such-bucket" in msg
    with pytest.raises(StorageError, match="does not exist"):
        store.put_bytes("k", b"v")


@pytest.fixture
def moto_auth(moto_server):
    """Turn on moto's request authentication (unknown access keys get 403) for one test."""

    def set_count(value: str) -> None:
        # text/plain: moto reads the raw body; a form-encoded body arrives empty and moto answers 500.
        req = urllib.request.Request(
            f"{moto_server}/moto-api/reset-auth", data=value.encode(), method="POST",
            headers={"Content-Type": "text/plain"},
        )  # fmt: skip
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 only, no proxy
        with opener.open(req, timeout=5) as resp:
            assert resp.status == 200

    set_count("0")
    try:
        yield
    finally:
        set_count("inf")


def test_s3_bad_credentials(s3_bucket, monkeypatch, moto_auth):
    endpoint, bucket = s3_bucket
    secret = "memfit-secret-never-printed"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = S3Store(f"s3://{bucket}/p")
    with pytest.raises(StorageError) as info:
        store.check_writable()  # HeadBucket: a bare 403 (HEAD responses carry no error body)
    msg = str(info.value)
    assert f"credentials rejected by {endpoint}" in msg and "AWS_ACCESS_KEY_ID" in msg
    assert secret not in msg
    with pytest.raises(StorageError) as info:
        store.put_bytes("k", b"v")  # PutObject: InvalidAccessKeyId
    assert "credentials rejected" in str(info.value) and "InvalidAccessKeyId" in str(info.value)
    assert secret not in str(info.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_endpoint_down_fails_fast(s3_env):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = S3Store("s3://bucket/p", endpoint_url=endpoint)
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.check_writable()
    assert time.monotonic() - start < 5
    assert f"cannot reach {endpoint}" in str(info.value)


def _client_error(code: str, op: str = "PutObject", headers: dict | None = None):
    from botocore.exceptions import ClientError

    meta = {"HTTPStatusCode": 400, "HTTPHeaders": headers or {}}
    return ClientError({"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": meta}, op)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("SignatureDoesNotMatch", "credentials rejected by http://ep"),
        ("InvalidAccessKeyId", "credentials rejected by http://ep"),
        ("ExpiredToken", "credentials rejected by http://ep"),
        ("AccessDenied", "access denied by http://ep"),
        ("NoSuchBucket", "bucket bkt does not exist at http://ep"),
        ("PermanentRedirect", "bucket bkt is in eu-west-1"),
        ("InternalError", "cannot write s3://bkt/p/k at http://ep: InternalError: msg"),
    ],
)
def test_map_s3_error_codes(code, expected):
    exc = _client_error(code, headers={"x-amz-bucket-region": "eu-west-1"})
    err = map_s3_error(exc, uri="s3://bkt/p", endpoint="http://ep", bucket="bkt", key="p/k", action="write")
    assert type(err) is StorageError
    assert expected in str(err)


def test_map_s3_error_unwraps_upload_failure_and_connection_errors():
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    try:
        try:
            raise _client_error("SignatureDoesNotMatch")
        except Exception as inner:  # noqa: BLE001
            raise S3UploadFailedError(f"Failed to upload: {inner}")  # noqa: B904 - what boto3 does (implicit chain)
    except S3UploadFailedError as exc:
        wrapped = exc
    kw = dict(uri="s3://bkt", endpoint="http://ep", bucket="bkt", key="k")
    assert "credentials rejected" in str(map_s3_error(wrapped, **kw))
    assert isinstance(map_s3_error(_client_error("NoSuchKey"), **kw), KeyNotFound)
    assert "does not exist" in str(map_s3_error(_client_error("404"), **{**kw, "key": None}))
    for exc in (EndpointConnectionError(endpoint_url="http://ep"), ConnectTimeoutError(endpoint_url="x")):
        assert "cannot reach http://ep" in str(map_s3_error(exc, **kw))


def test_s3_get_file_failure_leaves_no_partial_file(s3_bucket, tmp_path, monkeypatch):
    endpoint, bucket = s3_bucket
    store = S3Store(f"s3://{bucket}", endpoint_url=endpoint)
    store.put_bytes("k", b"v" * 1000)
    dest = tmp_path / "d" / "k"
    dest.parent.mkdir()
    dest.write_bytes(b"previous")

    def fail(*args, **kwargs):
        Path(args[2]).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.client, "download_file", fail)
    with pytest.raises(StorageError, match="No space left"):
        store.get_file("k", dest)
    assert dest.read_bytes() == b"previous"
    assert _temp_files(tmp_path) == []
