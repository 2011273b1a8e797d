"""Child processes that must not outlive memfit, even when it is SIGKILLed (OOM killer, a lost spot host)."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

# Runs in its own small process: SIGTERM (sent by the kernel when memfit dies, or at its normal exit) ends the
# target, if it is still the process it was (a PID can be reused once the target is gone).
_REAPER = """
import os, signal, sys, time
import psutil
target, started, parent = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
def end(*_):
    try:
        p = psutil.Process(target)
        if abs(p.create_time() - started) < 0.01:
            p.terminate()
            try:
                p.wait(10)
            except psutil.TimeoutExpired:
                p.kill()
    except psutil.Error:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, end)
if os.getppid() != parent:  # memfit died before the kernel could be told to signal this process
    end()
while True:
    signal.pause()
"""


_reapers: list[subprocess.Popen[bytes]] = []  # referenced until exit (a collected Popen warns it still runs)


def die_with_parent_hook() -> Any:
    """A preexec_fn: if the process that starts the child dies, the kernel sends the child SIGTERM (Linux).

    libc is resolved here, before the fork: the hook itself makes one system call (no imports or locks in the
    forked child). Elsewhere None: the child is not tied to its parent.
    """
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def reap_with_this_process(pid: int) -> subprocess.Popen[bytes] | None:
    """Make process `pid` (one memfit did not start itself, e.g. a library's server) end when this one does.

    A reaper process tied to this one with PR_SET_PDEATHSIG terminates it. Call from the main thread: the
    kernel signals the child when the *thread* that started it ends. Linux only; elsewhere None.
    """
    import os

    import psutil

    hook = die_with_parent_hook()
    if hook is None:
        return None
    started = psutil.Process(pid).create_time()
    # A session of its own: a SIGKILL to memfit's whole process group must leave the reaper alive to act on it.
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(pid), repr(started), str(os.getpid())],
                              stdin=subprocess.DEVNULL, preexec_fn=hook, start_new_session=True)  # noqa: PLW1509
    _reapers.append(reaper)
    return reaper
