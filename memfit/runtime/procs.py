"""Child processes that must not outlive memfit, even when it is SIGKILLed (OOM killer, a lost spot host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

# Runs in its own small process and session. memfit writes "PID START_TICKS" lines to its stdin, one per process
# to end with memfit. When memfit ends, however it ends (SIGKILL included), the kernel closes memfit's end of
# the pipe: the reaper reads to that EOF, so it knows every process it was told of, then ends each that is
# still the process it was (a PID can be reused once the target is gone). SIGTERM (PR_SET_PDEATHSIG, a
# stray kill) only interrupts the read; acting on it at once could miss a line still in the pipe, which
# left a server running when memfit died within a second of starting it. A process is known by its start in
# clock ticks since boot (start_ticks), not by psutil's create_time: that one adds the boot time as the
# wall clock gives it now, which moves when the clock is stepped (NTP at a fresh instance's start, a paused
# and resumed VM), and then no target matched and the server ran on.
_REAPER = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *_: None)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by memfit from the fork to here
try:
    os.nice(10)  # off the critical path: its start-up (psutil's import) must not take memfit's core
except OSError:
    pass
import psutil
def started(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])
targets = []
for line in sys.stdin:
    pid, ticks = line.split()
    targets.append((int(pid), int(ticks)))
procs = []
for pid, ticks in targets:
    try:
        if started(pid) != ticks:
            print(f"memfit reaper: pid {pid} is another process now; left alone", file=sys.stderr, flush=True)
            continue
        p = psutil.Process(pid)
        p.terminate()
        procs.append(p)
    except (OSError, psutil.Error):
        pass  # gone already
_, alive = psutil.wait_procs(procs, timeout=5)
for p in alive:
    try:
        p.kill()
    except psutil.Error:
        pass
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


class Reaper:
    """A small process that ends the processes it is told of when this one ends, even on SIGKILL (Linux)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if sys.platform != "linux":
            return
        # A session of its own: a SIGKILL to memfit's whole process group must leave the reaper alive to act.
        # SIGTERM is blocked from the fork until the reaper has its handler (the child inherits the mask), so
        # that no SIGTERM in between can end it before it has done its work.
        held = {signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                         start_new_session=True)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        _reapers.append(self.proc)

    def watch(self, pid: int) -> None:
        """End process `pid` (one memfit did not start itself, e.g. a library's server) with this one."""
        if self.proc is None or self.proc.stdin is None:
            return
        self.proc.stdin.write(f"{pid} {start_ticks(pid)}\n".encode())
        self.proc.stdin.flush()


def stat_start_ticks(stat: bytes) -> int:
    """Field 22 of a /proc/PID/stat line: the process's start in clock ticks since boot (no wall clock in it).
    The name (field 2) is in parentheses and may hold spaces and parentheses itself: fields count from the last ')'."""
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (Linux): with the PID, it names one process for good."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return stat_start_ticks(f.read())


WRITER_NICE = 10  # background writers run this much nicer than the process (bench/loop_overhead.py measures it)


def lower_thread_priority(nice: int = WRITER_NICE) -> None:
    """Make the calling thread nicer, so that the training step's torch threads win the cores while it works.

    On Linux niceness is per thread: setpriority on the thread's native id changes only that thread.
    Elsewhere (where that id could name another process) nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted here: the writer keeps the process's priority
        pass
