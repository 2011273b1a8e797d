"""After the loop, the memory a step freed goes back to the kernel (glibc): measured in a fresh process."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.runtime.env import _glibc

# Starts processes, so not in the unit tier: a fresh process's small heap makes the figures certain.
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_glibc() is None, reason="glibc's allocator only")]
REPO = Path(__file__).resolve().parents[2]


_REFAULTS = """
import ctypes, json, resource
from memfit.runtime.env import keep_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def refaults():  # page faults of an 8 MiB block written and freed, the second time round
    out = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(8 << 20)
        ctypes.memset(p, 1, 8 << 20)
        libc.free(p)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out[1]
release = keep_heap()
inside = refaults()
release()
print(json.dumps({"inside": inside, "after": refaults()}))
"""


def test_freed_memory_is_kept_inside_and_given_back_after():
    # A fresh process: its small heap makes where the block lands (the top of the heap) certain.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", _REFAULTS], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    pages = (8 << 20) // resource.getpagesize()
    assert got["inside"] < pages // 16  # reused as it was
    assert got["after"] > pages // 2  # glibc trims again: given back to the kernel, faulted in anew


def test_steps_after_the_first_take_no_page_faults(tmp_path):
    """A tiny fit's steps 5-14 under memfit's loop take at most an eighth of the page faults they take under glibc's
    default thresholds (measured: ≈ 11 000 a step against 0), both in one fresh process (tests/heap_faults.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "heap_faults.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["default"] >= 256, got  # the comparison means something: the defaults re-fault a megabyte a step
    assert got["kept"] <= got["default"] / 8, got
