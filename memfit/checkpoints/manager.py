"""Single-process training checkpoints: a CPU snapshot written, hashed and uploaded by the background writer."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from memfit.checkpoints.format import (
    CONFIG_FILE,
    FORMAT,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    CheckpointInfo,
    Snapshot,
    step_prefix,
)
from memfit.checkpoints.index import CheckpointIndex
from memfit.checkpoints.writer import BackgroundWriter, test_upload_delay
from memfit.files import file_record
from memfit.storage.base import ObjectStore

log = logging.getLogger("memfit.checkpoints")


@dataclass
class _Staged:
    snap: Snapshot
    folder: Path
    files: dict[str, dict[str, Any]]
    started: float  # perf_counter() when the writer began: the logged time counts every attempt


def write_local(snap: Snapshot, folder: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's files in `folder`; returns the manifest's file records."""
    # Cloned tensors share no storage, which safetensors requires (tied embeddings otherwise alias).
    save_file({k: v.contiguous() for k, v in snap.model_state.items()}, str(folder / MODEL_FILE),
              metadata={"format": "pt", "step": str(snap.step)})
    torch.save(snap.optimizer_state, folder / OPTIMIZER_FILE)
    torch.save(snap.rng_tensors, folder / RNG_FILE)
    (folder / STATE_FILE).write_text(json.dumps(snap.state, indent=2, sort_keys=True))
    (folder / CONFIG_FILE).write_text(snap.config_yaml)
    return {p.name: file_record(p) for p in sorted(folder.iterdir())}


class CheckpointManager(BackgroundWriter, CheckpointIndex):
    """Training checkpoints of one process under one store (listing and retention from CheckpointIndex,
    the one-at-a-time background save, retries, on_busy and deadline from BackgroundWriter)."""

    def __init__(self, store: ObjectStore, keep_last: int = 2, staging_dir: str | Path | None = None, *,
                 on_busy: str = "wait", upload_attempts: int = 1, retry_backoff_s: float = 5.0,
                 grace_seconds: float | None = None, every_steps: int | None = None) -> None:
        BackgroundWriter.__init__(self, every_steps=every_steps, on_busy=on_busy, upload_attempts=upload_attempts,
                                  retry_backoff_s=retry_backoff_s, grace_seconds=grace_seconds)
        CheckpointIndex.__init__(self, store, keep_last)
        self.staging_dir = Path(staging_dir) if staging_dir else None

    def save(self, snap: Snapshot | Callable[[], Snapshot], blocking: bool = True, *, force: bool = False,
             deadline: float | None = None, step: int | None = None, busy: bool | None = None
             ) -> Future[CheckpointInfo] | None:
        """Write and upload a snapshot (or what `snap()` returns, taken only if the save goes ahead).

        Returns None when skipped (on_busy="skip", a save in flight, neither blocking nor forced).
        `deadline` (time.monotonic()) stops retries that could not finish before it.
        """
        if step is None and not callable(snap):
            step = snap.step
        return self.submit(step, snap if callable(snap) else lambda: snap, blocking=blocking, force=force,
                           deadline=deadline, busy=busy)

    def describe(self, step: int) -> str:
        return self.uri(step_prefix(step))

    def _stage(self, snap: Snapshot) -> _Staged:
        if self.staging_dir:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix=f".{step_prefix(snap.step)}-", dir=self.staging_dir))
        try:
            return _Staged(snap, folder, write_local(snap, folder), started)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _cleanup(self, staged: _Staged | None) -> None:
        # _stage's own failure leaves nothing behind (None here); a staged folder goes, committed or not.
        if staged is not None:
            shutil.rmtree(staged.folder, ignore_errors=True)

    def _upload(self, staged: _Staged) -> tuple[CheckpointInfo, int]:
        step, prefix = staged.snap.step, step_prefix(staged.snap.step)
        # A re-save of the same step (after a crash between upload and manifest) first drops the old manifest.
        self.store.delete(f"{prefix}/{MANIFEST}")
        for name in staged.files:
            self.store.put_file(staged.folder / name, f"{prefix}/{name}", consume=True)
            test_upload_delay()
        created_at = time.time()
        manifest = {"format": FORMAT, "step": step, "created_at": created_at, "files": staged.files}
        # The manifest goes last: until it exists, the checkpoint does not.
        self.store.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        test_upload_delay()
        info = CheckpointInfo(step=step, prefix=prefix, uri=self.uri(prefix), files=staged.files,
                              created_at=created_at)
        try:
            self.apply_retention()
        except Exception as err:  # noqa: BLE001 - the new checkpoint is committed; pruning can wait
            log.warning("training checkpoint step %d is committed, but removing older ones failed (%s); "
                        "retried after the next save", step, err)
        log.info("training checkpoint step %d committed to %s (%.2f s, %.1f MB)", step, info.uri,
                 time.perf_counter() - staged.started, info.total_bytes / 1e6)
        return info, info.total_bytes
