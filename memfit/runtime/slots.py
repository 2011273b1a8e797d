"""Training slots on one machine held as file locks: the kernel frees a dead holder's slot the moment it dies."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# A Prefect lease outlives a SIGKILLed holder until something reaps it; an flock cannot: it belongs to the open
# file, which the kernel closes with the process. So a dead run never holds the next one.


def slot_files(folder: Path, name: str, slots: int) -> list[Path]:
    """One lock file per slot: <folder>/<name>.<i>.lock (the name made safe for a file name)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return [folder / f"{safe}.{i}.lock" for i in range(slots)]


def read_holder(path: Path) -> dict[str, Any] | None:
    """What the holder of a slot wrote into it (pid, run, since); None when free or unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        holder = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held by a live process
        os.close(fd)
        return None
    return fd


def holders(folder: Path, name: str, slots: int) -> list[dict[str, Any]]:
    """The live holders of the slots (a file whose lock can be taken is free, whatever it says)."""
    out = []
    for path in slot_files(folder, name, slots):
        if not path.exists():
            continue
        fd = _try_lock(path)
        if fd is not None:
            os.close(fd)  # free: taking and dropping the lock is harmless
            continue
        out.append(read_holder(path) or {"pid": "?"})
    return out


def describe_wait(name: str, slots: int, held_by: list[dict[str, Any]], waited_s: float, folder: Path) -> str:
    """One line: what this run waits for, who holds it, and how to free it."""
    who = "; ".join(f"pid {h.get('pid', '?')} (run {h.get('run', '?')!r} since {h.get('since', '?')})"
                    for h in held_by) or "another process"
    return (f"waiting {waited_s:.0f} s for a training slot: all {slots} slot(s) of {name!r} on this machine are held "
            f"by {who}; training starts when one ends (a killed run frees its slot at once). To go on now, stop "
            f"that run, or raise deploy.training_slots (lock files in {folder})")


@contextmanager
def machine_slot(folder: str | Path, name: str, slots: int, *, run: str,
                 notify: Callable[[str], None], first_notice_s: float = 5.0, repeat_notice_s: float = 30.0,
                 poll_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> Iterator[int]:
    """Hold one of `slots` slots named `name` for the duration of the block; yields the slot's index.

    Waits while all are held, calling `notify` with a line after `first_notice_s` and then every
    `repeat_notice_s` seconds.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = slot_files(folder, name, slots)
    start, next_notice = clock(), first_notice_s
    while True:
        for index, path in enumerate(paths):
            fd = _try_lock(path)
            if fd is None:
                continue
            try:
                info = {"pid": os.getpid(), "host": socket.gethostname(), "run": run,
                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
                yield index
            finally:
                try:
                    os.ftruncate(fd, 0)  # an empty file reads as free even to a reader that does not lock
                finally:
                    os.close(fd)  # closing the file drops the lock
            return
        waited = clock() - start
        if waited >= next_notice:
            notify(describe_wait(name, slots, holders(folder, name, slots), waited, folder))
            next_notice += repeat_notice_s
        time.sleep(poll_s)
