"""Training checkpoints (state to resume from, not gradient checkpointing): save, verify, resume, retain."""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import pickle
import re
import shutil
import tempfile
import threading
import time
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


class CheckpointManager:
    """Training checkpoints under one store: `step-NNNNNNNN/` folders, each committed by its manifest, written last."""

    def __init__(self, store: ObjectStore, keep_last: int = 2, staging_dir: str | Path | None = None) -> None:
        self.store = store
        self.keep_last = keep_last
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-ckpt")
        self._inflight: Future[CheckpointInfo] | None = None
        self._lock = threading.Lock()
        self.last_save_seconds: float | None = None

    # -- saving -----------------------------------------------------------------------------------
    def save(self, snap: Snapshot, blocking: bool = True) -> Future[CheckpointInfo]:
        """Write and upload a snapshot; one save in flight at a time (a second waits for the first)."""
        self.wait()
        with self._lock:
            # Copy the caller's context so logs from the writer thread land in the same (Prefect) run.
            fut = self._pool.submit(contextvars.copy_context().run, self._save_now, snap)
            self._inflight = fut
        if blocking:
            fut.result()
        return fut

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

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _save_now(self, snap: Snapshot) -> CheckpointInfo:
        t0 = time.perf_counter()
        prefix = step_prefix(snap.step)
        if self.staging_dir:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=self.staging_dir))
        try:
            files = _write_local(snap, tmp)
            # A re-save of the same step (after a crash between upload and manifest) first drops the old manifest.
            self.store.delete(f"{prefix}/{MANIFEST}")
            for name in files:
                self.store.put_file(tmp / name, f"{prefix}/{name}")
            manifest = {"format": FORMAT, "step": snap.step, "created_at": time.time(), "files": files}
            # The manifest goes last: until it exists, the checkpoint does not.
            self.store.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        info = CheckpointInfo(step=snap.step, prefix=prefix, uri=self._uri(prefix), files=files,
                              created_at=manifest["created_at"])
        self._apply_retention()
        self.last_save_seconds = time.perf_counter() - t0
        log.info("training checkpoint step %d committed to %s (%.2f s)", snap.step, info.uri, self.last_save_seconds)
        return info

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
