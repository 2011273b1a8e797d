"""The one background writer of training checkpoints: one save in flight, retries, on_busy, a deadline."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

from memfit.errors import CheckpointError
from memfit.runtime.procs import lower_thread_priority

log = logging.getLogger("memfit.checkpoints")


@dataclass
class SaveRecord:
    """One training-checkpoint save as the training thread and the writer thread saw it."""

    step: int
    stall_s: float  # training thread: waiting for the previous save + snapshot + hand-off
    snapshot_s: float  # training thread: copying the state to CPU memory (or to local files)
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


def test_upload_delay() -> None:
    # TEST-ONLY hook: MEMFIT_TEST_UPLOAD_DELAY=<seconds> sleeps after each object written to the store, so
    # a test can SIGKILL the process deterministically mid-upload or right after the manifest.
    delay = os.environ.get("MEMFIT_TEST_UPLOAD_DELAY")
    if delay:
        time.sleep(float(delay))


class BackgroundWriter:
    """Saves of one kind (single-file or sharded) run one at a time on a single writer thread.

    A subclass gives `_stage` (writer thread, once: the local files), `_upload` (retried with exponential
    backoff, `upload_attempts` tries, none that could not end before the deadline; returns what `wait`
    returns and the bytes committed) and `_cleanup`. `on_busy` says what a periodic save due while one
    is in flight does ("wait" stalls training, "skip" drops it). A failure is re-raised, as a
    CheckpointError naming the step, by the next save, `wait`, `raise_if_failed` or `close`: never
    silently lost. `due` is where the saving rule lives: the loop only says which step ended and
    whether it was the last.
    """

    def __init__(self, *, every_steps: int | None = None, on_busy: str = "wait", upload_attempts: int = 1,
                 retry_backoff_s: float = 5.0, grace_seconds: float | None = None, name: str = "memfit-ckpt"
                 ) -> None:
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', not {on_busy!r}")
        self.every_steps, self.on_busy = every_steps, on_busy
        self.upload_attempts, self.retry_backoff_s = max(1, upload_attempts), retry_backoff_s
        self.grace_seconds = grace_seconds
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=lower_thread_priority)
        self._inflight: Future[Any] | None = None
        self._after: Future[Any] | None = None  # see commit_after
        self._lock = threading.Lock()
        self.last_save_seconds: float | None = None
        self.last_step: int | None = None  # step of the newest save handed to the writer
        self.stats = SaveStats()
        self._done: deque[SaveRecord] = deque()

    # -- the rule --------------------------------------------------------------------------------------
    def due(self, step: int, last: bool, requested: bool = False) -> bool:
        """A periodic (every_steps) or requested save after `step`; the last step's save is `save_final`'s."""
        return not last and (requested or (self.every_steps is not None and step % self.every_steps == 0))

    # -- the hand-off ----------------------------------------------------------------------------------
    def commit_after(self, fut: Future[Any] | None) -> None:
        """The next save uploads only once `fut` is done (the metrics logged up to its step, written by the
        tracker's thread): a checkpoint never commits ahead of its metrics, and the training thread waits for
        neither. A failure of `fut` is the tracker's to report (its next flush), not the save's."""
        self._after = fut

    @property
    def busy(self) -> bool:
        fut = self._inflight
        return fut is not None and not fut.done()

    def submit(self, step: int | None, snapshot: Callable[[], Any], *, blocking: bool, force: bool = False,
               deadline: float | None = None, busy: bool | None = None) -> Future[Any] | None:
        """Take `snapshot()` (only if the save goes ahead) and write it in the background.

        Returns None when skipped (on_busy="skip", a save in flight, neither blocking nor forced). `busy`:
        several ranks pass whether any of them is busy, so that all skip or none. `deadline`
        (time.monotonic()) stops retries that could not finish before it.
        """
        t0 = time.perf_counter()
        after, self._after = self._after, None
        self.raise_if_failed()
        busy = self.busy if busy is None else busy
        if busy and not (blocking or force) and self.on_busy == "skip":
            self.stats.skipped += 1
            log.warning("training checkpoint save skipped: the previous one (step %s) is still uploading "
                        "(checkpoint.on_busy=skip; %d skipped so far)", self.last_step, self.stats.skipped)
            return None
        if self.busy:
            log.info("training checkpoint save waits for the previous one (step %s) to finish uploading",
                     self.last_step)
        self.wait()
        t1 = time.perf_counter()
        snap = snapshot()
        step = snap.step if step is None else step  # a lazy snapshot may know its step only once taken
        record = SaveRecord(step=step, stall_s=0.0, snapshot_s=time.perf_counter() - t1)
        with self._lock:
            # Copy the caller's context so logs from the writer thread land in the same (Prefect) run.
            fut = self._pool.submit(contextvars.copy_context().run, self._write, snap, record, deadline, after)
            self._inflight = fut
            self.last_step = step
        record.stall_s = time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.total_stall_s += record.stall_s
        self.stats.total_snapshot_s += record.snapshot_s
        self.stats.last = record
        if blocking:
            self.wait()
        return fut

    def _write(self, snap: Any, record: SaveRecord, deadline: float | None, after: Future[Any] | None = None
               ) -> Any:
        t0 = time.perf_counter()
        attempt, staged = 0, None
        try:
            staged = self._stage(snap)
            if after is not None:
                wait_for([after])
            while True:
                attempt += 1
                try:
                    result, nbytes = self._upload(staged)
                    break
                except Exception as err:  # noqa: BLE001 - every failure is retried, then re-raised loudly
                    wait_s = self.retry_backoff_s * 2 ** (attempt - 1)
                    late = deadline is not None and time.monotonic() + wait_s > deadline
                    if attempt >= self.upload_attempts or late:
                        raise CheckpointError(f"training checkpoint step {record.step} could not be saved to "
                                              f"{self.describe(record.step)} ({attempt} attempt(s)): {err}"
                                              ) from err
                    log.warning("training checkpoint step %d: upload attempt %d/%d failed (%s); retrying in "
                                "%.1f s", record.step, attempt, self.upload_attempts, err, wait_s)
                    time.sleep(wait_s)
        finally:
            self._cleanup(staged)  # None when staging itself failed
        self.last_save_seconds = time.perf_counter() - t0
        record.write_upload_s, record.bytes, record.attempts = self.last_save_seconds, nbytes, attempt
        self._done.append(record)
        took = self.last_save_seconds + record.snapshot_s
        if self.grace_seconds is not None and took > self.grace_seconds:
            log.warning("saving training checkpoint step %d took %.1f s, more than checkpoint.grace_seconds=%.0f: "
                        "a save after a preemption notice may not finish in time; give the machine a longer "
                        "grace period (and raise checkpoint.grace_seconds) or save a smaller state",
                        record.step, took, self.grace_seconds)
        return result

    # Subclasses: the kind of checkpoint written.
    def _stage(self, snap: Any) -> Any:
        return snap

    def _upload(self, staged: Any) -> tuple[Any, int | None]:
        raise NotImplementedError

    def _cleanup(self, staged: Any) -> None:
        return None

    def describe(self, step: int) -> str:
        return f"step {step}"

    # -- waiting ---------------------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Re-raise (at once, without blocking) the failure of a finished background save."""
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self.wait()

    def wait(self) -> Any:
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

    def drain(self, timeout_s: float) -> None:
        """On a failure: give the save in flight a bounded chance to commit (never raises).

        A process that fails after step N's snapshot still finishes uploading it (and, sharded, rank 0 still
        commits it if every rank did), so the rerun resumes from step N rather than the save before it.
        """
        fut = self._inflight
        if fut is None or self.last_step is None:
            return
        try:
            fut.result(timeout=timeout_s)
            log.info("training checkpoint step %d finished uploading before exit", self.last_step)
        except Exception as err:  # noqa: BLE001 - the run is failing anyway; report, do not mask
            log.warning("training checkpoint step %d did not finish before exit: %s", self.last_step,
                        err or type(err).__name__)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
