"""How the reaper knows a process for good: its start in clock ticks since boot, read the same way on both sides."""

from __future__ import annotations

import os
import re
import sys

import psutil
import pytest

from memfit.runtime.procs import _REAPER, start_ticks, stat_start_ticks

pytestmark = [pytest.mark.unit, pytest.mark.skipif(sys.platform != "linux", reason="/proc: Linux only")]


def test_the_start_is_field_22_counted_after_the_name_whatever_the_name_holds():
    fields = ["S"] + [str(n) for n in range(4, 22)] + ["987654"] + ["0"] * 30  # fields 3..52; 22 is 987654
    for name in ("python", "a) b (c", ") )", "x y"):
        line = f"4242 ({name}) {' '.join(fields)}\n".encode()
        assert stat_start_ticks(line) == 987654, name


def test_this_process_start_agrees_with_psutils_clock_based_time():
    per_second = os.sysconf("SC_CLK_TCK")
    me = psutil.Process()
    assert abs(start_ticks(me.pid) - (me.create_time() - psutil.boot_time()) * per_second) <= 1


def test_the_reaper_reads_the_start_as_memfit_writes_it():
    """The reaper is a `python -c` script of its own: its copy of the reading must give the same number."""
    source = re.search(r"^def started\(pid\):\n(?:    .*\n)+", _REAPER, re.M)
    assert source, "the reaper script has no started(pid)"
    scope: dict = {}
    exec(source.group(0), scope)  # noqa: S102 - memfit's own constant
    assert scope["started"](os.getpid()) == start_ticks(os.getpid())
    assert "create_time" not in _REAPER  # the wall clock, which a clock step moves, is not how it matches
