"""The suite's own pytest-xdist scheduler (tests/xdist_schedule.py) through a worker crash: a segfaulting test fails
once, its file's other tests run on the new worker, and the run ends instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parents[1]


def test_a_worker_crash_fails_its_test_once_and_the_run_goes_on_to_the_end(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "tests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        import pytest
        sys.path.insert(0, {str(TESTS)!r})

        @pytest.hookimpl(optionalhook=True)
        def pytest_xdist_make_scheduler(config, log):
            from xdist_schedule import scheduler
            return scheduler(config, log, frozenset(), ("tests/test_crash.py",))
        """))
    for name in ("a", "b"):  # finished by the worker that then crashes, or by the other one
        (tmp_path / "tests" / f"test_{name}.py").write_text(textwrap.dedent(f"""
            import time
            import pytest
            @pytest.mark.parametrize("i", range(6))
            def test_{name}(i):
                time.sleep(0.2)
            """))
    (tmp_path / "tests" / "test_crash.py").write_text(textwrap.dedent("""
        import os
        import signal
        import pytest
        @pytest.mark.parametrize("i", range(5))
        def test_c(i):
            if i in (1, 3):  # as llama.cpp's AMX kernels did: the worker process dies
                os.kill(os.getpid(), signal.SIGSEGV)
        """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-q", "-p",
                           "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    tail = done.stdout[-2000:]
    # Stock pytest-xdist 3.8 hangs here for good: the crashed worker's finished file is handed out again, empty.
    assert "2 failed, 15 passed" in tail, tail
    assert "crashed while running 'tests/test_crash.py::test_c[1]'" in done.stdout
    assert "crashed while running 'tests/test_crash.py::test_c[3]'" in done.stdout
    assert done.returncode == 1
