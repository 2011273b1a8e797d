"""Training checkpoints: manifest-last commits, verification, fallback, retention, no unpickling."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch

from memfit.checkpoints import MANIFEST, CheckpointManager, take_snapshot
from memfit.errors import CheckpointError
from memfit.storage import LocalStore, StorageError, open_store

pytestmark = pytest.mark.unit


def _snapshot(step: int, value: float = 0.0):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return take_snapshot(step, model.state_dict(), opt.state_dict(), {"torch": torch.get_rng_state()},
                         {"step": step, "note": "x"}, "train:\n  max_steps: 3\n")


@pytest.fixture()
def manager(tmp_path: Path) -> CheckpointManager:
    m = CheckpointManager(open_store(str(tmp_path / "store")), keep_last=2, staging_dir=tmp_path / "staging")
    yield m
    m.close()


def test_save_list_and_load(manager, tmp_path):
    manager.save(_snapshot(5, 1.5))
    infos = manager.list()
    assert [i.step for i in infos] == [5]
    loaded = manager.latest(tmp_path / "dl")
    assert loaded.step == 5 and torch.all(loaded.model_state["weight"] == 1.5)
    assert loaded.state["note"] == "x" and "max_steps" in loaded.config_yaml
    assert loaded.optimizer_state["state"][0]["step"] == 1


def test_snapshot_is_a_copy(tmp_path):
    model = torch.nn.Linear(2, 2)
    snap = take_snapshot(1, model.state_dict(), {}, {}, {}, "")
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(snap.model_state["weight"], model.weight)


def test_background_save_then_wait(manager):
    fut = manager.save(_snapshot(1), blocking=False)
    info = manager.wait()
    assert fut.done() and info.step == 1 and manager.list()[-1].step == 1


def test_checkpoint_without_manifest_does_not_exist(manager, tmp_path):
    manager.save(_snapshot(2, 2.0))
    manager.save(_snapshot(4, 4.0))
    manager.store.delete(f"step-00000004/{MANIFEST}")
    assert [i.step for i in manager.list()] == [2]
    assert manager.latest(tmp_path / "dl").step == 2


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_newest_falls_back_with_warning(manager, tmp_path, caplog, damage):
    manager.save(_snapshot(2, 2.0))
    manager.save(_snapshot(4, 4.0))
    target = Path(manager.store.root) / "step-00000004" / "model.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoints"):
        loaded = manager.latest(tmp_path / "dl")
    assert loaded.step == 2 and torch.all(loaded.model_state["weight"] == 2.0)
    assert "step-00000004" in caplog.text


def test_retention_keeps_last_n_committed(manager):
    for s in (1, 2, 3, 4):
        manager.save(_snapshot(s))
    assert [i.step for i in manager.list()] == [3, 4]
    assert not any(k.startswith("step-00000001/") for k in manager.store.list(""))


class _Evil:
    def __reduce__(self):
        return (Path("/tmp/memfit-pwned").touch, ())


def test_planted_pickle_is_never_unpickled(manager, tmp_path):
    manager.save(_snapshot(3))
    store_dir = Path(manager.store.root) / "step-00000003"
    evil = pickle.dumps({"state": _Evil()})
    (store_dir / "optimizer.pt").write_bytes(evil)
    # Re-sign the manifest so only the loader's refusal to unpickle can stop it.
    manifest = json.loads((store_dir / MANIFEST).read_text())
    manifest["files"]["optimizer.pt"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (store_dir / MANIFEST).write_text(json.dumps(manifest))
    Path("/tmp/memfit-pwned").unlink(missing_ok=True)
    info = manager.list()[-1]
    with pytest.raises(CheckpointError):
        manager.load(info, tmp_path / "dl")
    assert not Path("/tmp/memfit-pwned").exists()


# -- the save policy, failures, retries ------------------------------------------------------------------
class _GatedStore(LocalStore):
    """A LocalStore whose uploads wait for `gate` and fail while `failures` > 0 (a flaky or slow S3)."""

    def __init__(self, root: Path, failures: int = 0) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.failures = failures

    def put_file(self, local_path, key, *, consume=False):
        self.gate.wait(10)
        if self.failures > 0:
            self.failures -= 1
            raise StorageError(f"cannot upload to {key!r}: 503 SlowDown (injected)")
        super().put_file(local_path, key, consume=consume)


def _gated(tmp_path: Path, failures: int = 0, **kw) -> CheckpointManager:
    return CheckpointManager(_GatedStore(tmp_path / "store", failures), keep_last=3,
                             staging_dir=tmp_path / "staging", **kw)


def test_on_busy_skip_drops_the_second_save_without_snapshotting(tmp_path, caplog):
    m = _gated(tmp_path, on_busy="skip")
    m.store.gate.clear()
    m.save(_snapshot(1), blocking=False)
    taken = []
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoints"):
        assert m.save(lambda: taken.append(1) or _snapshot(2), blocking=False) is None
    assert taken == [] and m.stats.skipped == 1 and "skipped" in caplog.text
    m.store.gate.set()
    m.close()
    assert [i.step for i in m.list()] == [1]


def test_on_busy_wait_stalls_until_the_previous_save_commits(tmp_path):
    m = _gated(tmp_path, on_busy="wait")
    m.store.gate.clear()
    m.save(_snapshot(1), blocking=False)
    threading.Timer(0.4, m.store.gate.set).start()
    m.save(_snapshot(2), blocking=False)
    assert m.stats.last.stall_s >= 0.3 > m.stats.last.snapshot_s
    m.close()
    assert [i.step for i in m.list()] == [1, 2]
    done = m.completed()
    assert [r.step for r in done] == [1, 2] and all(r.bytes and r.write_upload_s for r in done)


def test_failed_background_upload_surfaces_at_next_check_and_is_never_complete(tmp_path):
    m = _gated(tmp_path, failures=100, upload_attempts=1)
    m.save(_snapshot(3), blocking=False)
    for _ in range(200):
        if not m.busy:
            break
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="step 3 could not be saved") as info:
        m.raise_if_failed()
    assert "503 SlowDown" in str(info.value)
    assert m.list() == [] and not m.store.exists(f"step-00000003/{MANIFEST}")
    m.close()  # the failure was reported once; closing does not raise it again


def test_transient_upload_failures_are_retried_with_backoff(tmp_path, caplog):
    m = _gated(tmp_path, failures=2, upload_attempts=3, retry_backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoints"):
        m.save(_snapshot(4))
    assert [i.step for i in m.list()] == [4]
    assert caplog.text.count("retrying in") == 2 and m.completed()[0].attempts == 3
    m.close()


def test_retries_stop_at_the_deadline(tmp_path):
    m = _gated(tmp_path, failures=100, upload_attempts=10, retry_backoff_s=30)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"\(1 attempt"):
        m.save(_snapshot(5), deadline=time.monotonic() + 2)
    assert time.monotonic() - start < 10
    m.close()


def test_slow_save_warns_against_the_grace(tmp_path, caplog):
    m = _gated(tmp_path, grace_seconds=0.05)
    m.store.gate.clear()
    threading.Timer(0.2, m.store.gate.set).start()
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoints"):
        m.save(_snapshot(6))
    assert "more than checkpoint.grace_seconds" in caplog.text
    m.close()


def test_scan_shows_incomplete_folders_apart(manager):
    manager.save(_snapshot(2))
    manager.store.put_bytes("step-00000004/model.safetensors", b"half")
    entries = manager.scan()
    assert [(e.step, e.status) for e in entries] == [(2, "complete"), (4, "incomplete")]
    assert [i.step for i in manager.list()] == [2]


def test_a_save_commits_only_after_the_metrics_it_follows_are_written(manager):
    from concurrent.futures import Future

    metrics_written: Future[None] = Future()
    manager.commit_after(metrics_written)
    fut = manager.save(_snapshot(5), blocking=False)
    time.sleep(0.5)  # the writer has staged the files by now; it holds the commit for the metrics
    assert not fut.done() and manager.list() == []
    metrics_written.set_result(None)
    assert fut.result(timeout=30).step == 5 and manager.list()[-1].step == 5


def test_writer_threads_run_nicer_than_the_training_thread(manager):
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread niceness is Linux's")
    nice = manager._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert nice > os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) or nice == 19
