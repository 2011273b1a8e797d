"""Training checkpoints (state to resume from, not gradient checkpointing): save, verify, resume, retain."""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit.errors import CheckpointError
from memfit.storage.base import ObjectStore

log = logging.getLogger("memfit.checkpointing")

FORMAT = "memfit-training-checkpoint/1"
# Written by several ranks through torch.distributed.checkpoint (memfit/dist_checkpoint.py); same layout rules.
SHARDED_FORMAT = "memfit-sharded-training-checkpoint/1"
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
_STEP_DIR = re.compile(r"^step-(\d{8})/")


def step_prefix(step: int) -> str:
    return f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Snapshot:
    """Everything needed to resume, already copied to CPU memory so training can go on while it is written."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_tensors: dict[str, Any]
    state: dict[str, Any]
    config_yaml: str


@dataclass
class CheckpointInfo:
    step: int
    prefix: str
    uri: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_at: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


@dataclass
class CheckpointEntry:
    """A step folder found in the store; only status "complete" (a valid manifest) can ever be loaded."""

    step: int
    prefix: str
    uri: str
    objects: int
    status: str
    info: CheckpointInfo | None = None


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_tensors: dict[str, Any]
    state: dict[str, Any]
    config_yaml: str

    @property
    def step(self) -> int:
        return self.info.step


def _cpu_copy(obj: Any) -> Any:
    # Clone, not just move: a CPU tensor would otherwise alias the live parameter being updated.
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def take_snapshot(step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                  rng_tensors: dict[str, Any], state: dict[str, Any], config_yaml: str) -> Snapshot:
    return Snapshot(step=step, model_state=_cpu_copy(model_state), optimizer_state=_cpu_copy(optimizer_state),
                    rng_tensors=_cpu_copy(rng_tensors), state=json.loads(json.dumps(state)),
                    config_yaml=config_yaml)


def _write_local(snap: Snapshot, folder: Path) -> dict[str, dict[str, Any]]:
    # Cloned tensors share no storage, which safetensors requires (tied embeddings otherwise alias).
    save_file({k: v.contiguous() for k, v in snap.model_state.items()}, str(folder / MODEL_FILE),
              metadata={"format": "pt", "step": str(snap.step)})
    torch.save(snap.optimizer_state, folder / OPTIMIZER_FILE)
    torch.save(snap.rng_tensors, folder / RNG_FILE)
    (folder / STATE_FILE).write_text(json.dumps(snap.state, indent=2, sort_keys=True))
    (folder / CONFIG_FILE).write_text(snap.config_yaml)
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(folder.iterdir())}


@dataclass
class SaveRecord:
    """One training-checkpoint save as the training thread and the writer thread saw it."""

    step: int
    stall_s: float  # training thread: waiting for the previous save + snapshot + hand-off
    snapshot_s: float  # training thread: copying the state to CPU memory
    write_upload_s: float | None = None  # writer thread: serialise, hash, upload, manifest (None until done)
    bytes: int | None = None
    attempts: int = 0

    @property
    def upload_mb_per_s(self) -> float | None:
        if not self.bytes or not self.write_upload_s:
            return None
        return self.bytes / 1e6 / self.write_upload_s


@dataclass
class SaveStats:
    saves: int = 0
    skipped: int = 0
    total_stall_s: float = 0.0
    total_snapshot_s: float = 0.0
    last: SaveRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        n = max(self.saves, 1)
        return {"saves": self.saves, "skipped": self.skipped, "mean_stall_s": self.total_stall_s / n,
                "mean_snapshot_s": self.total_snapshot_s / n,
                "last_write_upload_s": self.last.write_upload_s if self.last else None,
                "last_upload_mb_per_s": self.last.upload_mb_per_s if self.last else None}


def _test_upload_delay() -> None:
    # TEST-ONLY hook: MEMFIT_TEST_UPLOAD_DELAY=<seconds> sleeps after each object written to the store, so
    # a test can SIGKILL the process deterministically mid-upload or right after the manifest.
    delay = os.environ.get("MEMFIT_TEST_UPLOAD_DELAY")
    if delay:
        time.sleep(float(delay))


class CheckpointManager:
    """Training checkpoints under one store: `step-NNNNNNNN/` folders, each committed by its manifest, written last.

    One save is in flight at a time, on a single writer thread; `on_busy` says what a periodic save due
    meanwhile does ("wait" stalls training until the previous one is committed, "skip" drops it). A save
    that fails (after `upload_attempts` tries with exponential backoff) is re-raised, as a CheckpointError
    naming the step, by the next save, `wait`, `raise_if_failed` or `close`: never silently lost.
    """

    def __init__(self, store: ObjectStore, keep_last: int = 2, staging_dir: str | Path | None = None, *,
                 on_busy: str = "wait", upload_attempts: int = 1, retry_backoff_s: float = 5.0,
                 grace_seconds: float | None = None) -> None:
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', not {on_busy!r}")
        self.store = store
        self.keep_last = keep_last
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.on_busy = on_busy
        self.upload_attempts = max(1, upload_attempts)
        self.retry_backoff_s = retry_backoff_s
        self.grace_seconds = grace_seconds
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-ckpt")
        self._inflight: Future[CheckpointInfo] | None = None
        self._lock = threading.Lock()
        self.last_save_seconds: float | None = None
        self.last_step: int | None = None  # step of the newest save handed to the writer
        self.stats = SaveStats()
        self._done: deque[SaveRecord] = deque()

    # -- saving -----------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        fut = self._inflight
        return fut is not None and not fut.done()

    def save(self, snap: Snapshot | Callable[[], Snapshot], blocking: bool = True, *, force: bool = False,
             deadline: float | None = None) -> Future[CheckpointInfo] | None:
        """Write and upload a snapshot (or what `snap()` returns, taken only if the save goes ahead).

        Returns None when skipped (on_busy="skip", a save in flight, neither blocking nor forced).
        `deadline` (time.monotonic()) stops retries that could not finish before it.
        """
        t0 = time.perf_counter()
        self.raise_if_failed()
        if self.busy and not (blocking or force) and self.on_busy == "skip":
            self.stats.skipped += 1
            log.warning("training checkpoint save skipped: the previous one (step %s) is still uploading "
                        "(checkpoint.on_busy=skip; %d skipped so far)", self.last_step, self.stats.skipped)
            return None
        if self.busy:
            log.info("training checkpoint save waits for the previous one (step %s) to finish uploading",
                     self.last_step)
        self.wait()
        t1 = time.perf_counter()
        snapshot = snap() if callable(snap) else snap
        snapshot_s = time.perf_counter() - t1
        record = SaveRecord(step=snapshot.step, stall_s=0.0, snapshot_s=snapshot_s)
        with self._lock:
            # Copy the caller's context so logs from the writer thread land in the same (Prefect) run.
            fut = self._pool.submit(contextvars.copy_context().run, self._save_now, snapshot, record, deadline)
            self._inflight = fut
            self.last_step = snapshot.step
        record.stall_s = time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.total_stall_s += record.stall_s
        self.stats.total_snapshot_s += snapshot_s
        self.stats.last = record
        if blocking:
            self.wait()
        return fut

    def raise_if_failed(self) -> None:
        """Re-raise (at once, without blocking) the failure of a finished background save."""
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self.wait()

    def wait(self) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        fut = self._inflight
        if fut is None:
            return None
        try:
            return fut.result()
        finally:
            with self._lock:
                if self._inflight is fut:
                    self._inflight = None

    def completed(self) -> list[SaveRecord]:
        """Saves committed since the last call (for the training thread to log; thread-safe)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _save_now(self, snap: Snapshot, record: SaveRecord | None = None,
                  deadline: float | None = None) -> CheckpointInfo:
        t0 = time.perf_counter()
        prefix = step_prefix(snap.step)
        if self.staging_dir:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=self.staging_dir))
        attempt = 0
        try:
            files = _write_local(snap, tmp)
            while True:
                attempt += 1
                try:
                    created_at = self._upload(prefix, tmp, files, snap.step)
                    break
                except Exception as err:  # noqa: BLE001 - every failure is retried, then re-raised loudly
                    wait_s = self.retry_backoff_s * 2 ** (attempt - 1)
                    late = deadline is not None and time.monotonic() + wait_s > deadline
                    if attempt >= self.upload_attempts or late:
                        raise CheckpointError(
                            f"training checkpoint step {snap.step} could not be saved to {self._uri(prefix)} "
                            f"({attempt} attempt(s)): {err}") from err
                    log.warning("training checkpoint step %d: upload attempt %d/%d failed (%s); retrying in "
                                "%.1f s", snap.step, attempt, self.upload_attempts, err, wait_s)
                    time.sleep(wait_s)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        info = CheckpointInfo(step=snap.step, prefix=prefix, uri=self._uri(prefix), files=files,
                              created_at=created_at)
        try:
            self._apply_retention()
        except Exception as err:  # noqa: BLE001 - the new checkpoint is committed; pruning can wait
            log.warning("training checkpoint step %d is committed, but removing older ones failed (%s); "
                        "retried after the next save", snap.step, err)
        self.last_save_seconds = time.perf_counter() - t0
        if record is not None:
            record.write_upload_s, record.bytes, record.attempts = self.last_save_seconds, info.total_bytes, attempt
            self._done.append(record)
        log.info("training checkpoint step %d committed to %s (%.2f s, %.1f MB)", snap.step, info.uri,
                 self.last_save_seconds, info.total_bytes / 1e6)
        took = self.last_save_seconds + (record.snapshot_s if record else 0.0)
        if self.grace_seconds is not None and took > self.grace_seconds:
            log.warning("saving training checkpoint step %d took %.1f s, more than checkpoint.grace_seconds=%.0f: "
                        "a save after a preemption notice may not finish in time; give the machine a longer "
                        "grace period (and raise checkpoint.grace_seconds) or save a smaller state",
                        snap.step, took, self.grace_seconds)
        return info

    def _upload(self, prefix: str, tmp: Path, files: dict[str, dict[str, Any]], step: int) -> float:
        # A re-save of the same step (after a crash between upload and manifest) first drops the old manifest.
        self.store.delete(f"{prefix}/{MANIFEST}")
        for name in files:
            self.store.put_file(tmp / name, f"{prefix}/{name}")
            _test_upload_delay()
        created_at = time.time()
        manifest = {"format": FORMAT, "step": step, "created_at": created_at, "files": files}
        # The manifest goes last: until it exists, the checkpoint does not.
        self.store.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        _test_upload_delay()
        return created_at

    def _apply_retention(self) -> None:
        complete = self.list()
        keep = {c.prefix for c in complete[-self.keep_last:]}
        newest = complete[-1].step if complete else -1
        for c in complete[:-self.keep_last]:
            # Manifest first: a checkpoint half-deleted must look incomplete, never complete-but-broken.
            self.store.delete(f"{c.prefix}/{MANIFEST}")
            self.store.delete_prefix(f"{c.prefix}/")
        for step, prefix in self._step_prefixes():
            if prefix not in keep and step < newest and not self.store.exists(f"{prefix}/{MANIFEST}"):
                self.store.delete_prefix(f"{prefix}/")  # debris of an interrupted save

    # -- listing and loading ----------------------------------------------------------------------
    def _uri(self, prefix: str) -> str:
        return f"{self.store.uri.rstrip('/')}/{prefix}"

    def _step_prefixes(self) -> list[tuple[int, str]]:
        seen: dict[int, str] = {}
        for key in self.store.list(""):
            m = _STEP_DIR.match(key)
            if m:
                seen[int(m.group(1))] = f"step-{m.group(1)}"
        return sorted(seen.items())

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest exists and parses, oldest first (contents not yet verified)."""
        out = []
        for step, prefix in self._step_prefixes():
            try:
                manifest = json.loads(self.store.get_bytes(f"{prefix}/{MANIFEST}"))
            except Exception:  # noqa: BLE001 - missing or unreadable manifest: not a checkpoint
                continue
            if manifest.get("format") not in (FORMAT, SHARDED_FORMAT) or manifest.get("step") != step:
                continue
            out.append(CheckpointInfo(step=step, prefix=prefix, uri=self._uri(prefix), files=manifest["files"],
                                      created_at=manifest.get("created_at")))
        return out

    def scan(self) -> list[CheckpointEntry]:
        """Every step folder in the store, oldest first: complete (a valid manifest) or incomplete (debris)."""
        complete = {c.step: c for c in self.list()}
        keys: dict[int, int] = {}
        for key in self.store.list(""):
            m = _STEP_DIR.match(key)
            if m:
                keys[int(m.group(1))] = keys.get(int(m.group(1)), 0) + 1
        out = []
        for step in sorted(keys):
            prefix = step_prefix(step)
            info = complete.get(step)
            out.append(CheckpointEntry(step=step, prefix=prefix, uri=self._uri(prefix), objects=keys[step],
                                       status="complete" if info else "incomplete", info=info))
        return out

    def verify(self, info: CheckpointInfo, dest: Path) -> str | None:
        """Download and check one checkpoint (checksums, then a read that unpickles nothing); None if it is sound."""
        target = dest / info.prefix
        try:
            read_checkpoint_folder(self.download_verified(info, target), info)
            return None
        except CheckpointError as err:
            return str(err)
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def download_verified(self, info: CheckpointInfo, dest: Path) -> Path:
        """Download every file of `info` into dest and check sizes and sha256 against its manifest."""
        dest.mkdir(parents=True, exist_ok=True)
        for name, meta in info.files.items():
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{info.uri}: manifest names an unsafe file {name!r}")
            local = dest / name
            try:
                self.store.get_file(f"{info.prefix}/{name}", local)
            except Exception as err:  # noqa: BLE001
                raise CheckpointError(f"{info.uri}/{name}: cannot download ({err})") from None
            size = local.stat().st_size
            if size != int(meta["bytes"]):
                raise CheckpointError(f"{info.uri}/{name}: {size} bytes, manifest says {meta['bytes']}")
            if sha256_file(local) != meta["sha256"]:
                raise CheckpointError(f"{info.uri}/{name}: sha256 does not match the manifest")
        return dest

    def load(self, info: CheckpointInfo, dest: Path) -> LoadedCheckpoint:
        folder = self.download_verified(info, dest)
        return read_checkpoint_folder(folder, info)

    def latest(self, dest: Path) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies; corrupt or partial ones are skipped with a warning."""
        for info in reversed(self.list()):
            target = dest / info.prefix
            try:
                return self.load(info, target)
            except CheckpointError as err:
                log.warning("skipping training checkpoint %s: %s", info.uri, err)
                shutil.rmtree(target, ignore_errors=True)
        return None


def read_checkpoint_folder(folder: Path, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
    """Read a verified local checkpoint folder. Nothing is unpickled: weights_only loads and JSON."""
    from memfit import dist_checkpoint  # lazy: it imports this module

    if dist_checkpoint.is_sharded_folder(folder):
        return dist_checkpoint.read_sharded_folder(folder, info)
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        model_state = load_file(str(folder / MODEL_FILE))
        optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(folder / RNG_FILE, map_location="cpu", weights_only=True)
        config_yaml = (folder / CONFIG_FILE).read_text()
    except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as err:
        # weights_only refuses arbitrary pickles with UnpicklingError: a planted object never runs.
        raise CheckpointError(f"{folder}: unreadable training checkpoint ({err})") from None
    if info is None:
        info = CheckpointInfo(step=int(state["step"]), prefix=folder.name, uri=str(folder))
    return LoadedCheckpoint(info=info, model_state=model_state, optimizer_state=optimizer_state,
                            rng_tensors=rng, state=state, config_yaml=config_yaml)
