"""Machine-local training slots: held per open file, waiting says who holds them, release frees at once."""

from __future__ import annotations

import threading
import time

import pytest

from memfit.runtime.slots import holders, machine_slot, read_holder, slot_files

pytestmark = pytest.mark.unit


def test_each_holder_gets_its_own_slot_and_says_who_it_is(tmp_path):
    with machine_slot(tmp_path, "memfit-training", 2, run="first", notify=print) as a, \
            machine_slot(tmp_path, "memfit-training", 2, run="second", notify=print) as b:
        assert {a, b} == {0, 1}
        held = holders(tmp_path, "memfit-training", 2)
        assert sorted(h["run"] for h in held) == ["first", "second"]
    assert holders(tmp_path, "memfit-training", 2) == []  # both released
    assert all(read_holder(p) is None for p in slot_files(tmp_path, "memfit-training", 2))


def test_a_waiting_run_says_what_it_waits_for_and_starts_when_the_slot_frees(tmp_path):
    lines: list[str] = []
    got = threading.Event()

    def second() -> None:
        with machine_slot(tmp_path, "gpu0", 1, run="later", notify=lines.append, first_notice_s=0.2,
                          repeat_notice_s=0.3, poll_s=0.02):
            got.set()

    with machine_slot(tmp_path, "gpu0", 1, run="busy", notify=lines.append):
        waiter = threading.Thread(target=second)
        waiter.start()
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not got.is_set()
    waiter.join(10)
    assert got.is_set()
    assert len(lines) >= 2  # the first notice, then repeated while waiting
    line = lines[0]
    assert "training slot" in line and "'gpu0'" in line and "run 'busy'" in line
    assert "deploy.training_slots" in line and str(tmp_path) in line and "\n" not in line


def test_a_slot_file_left_with_a_holder_but_no_lock_is_free(tmp_path):
    """What a dead holder leaves behind (its lock gone with it) does not block anyone."""
    (path,) = slot_files(tmp_path, "memfit-training", 1)
    path.write_text('{"pid": 999999, "run": "killed", "since": "earlier"}')
    assert holders(tmp_path, "memfit-training", 1) == []
    with machine_slot(tmp_path, "memfit-training", 1, run="rerun", notify=pytest.fail) as index:
        assert index == 0 and read_holder(path)["run"] == "rerun"


def test_odd_names_make_safe_file_names(tmp_path):
    (path,) = slot_files(tmp_path, "team/a b:c", 1)
    assert path.parent == tmp_path and "/" not in path.name and " " not in path.name


def test_prefects_error_for_a_timed_out_slot_wait_is_dropped_and_other_errors_are_kept(caplog):
    import logging

    from tasks.slots import quiet_expected_timeouts

    quiet_expected_timeouts()
    quiet_expected_timeouts()  # idempotent: one filter
    logger = logging.getLogger("prefect._internal.concurrency")
    assert len([f for f in logger.filters if type(f).__name__ == "_ExpectedTimeouts"]) == 1
    with caplog.at_level(logging.ERROR, logger="prefect._internal.concurrency"):
        logger.error("Service %r failed to process item %r", "ConcurrencySlotAcquisitionWithLeaseService",
                     (1, "concurrency", 30.0, "<Future at 0x1 state=finished raised TimeoutError>"))
        logger.error("Service %r failed to process item %r", "ConcurrencySlotAcquisitionWithLeaseService",
                     (1, "concurrency", 30.0, "<Future at 0x1 state=finished raised HTTPStatusError>"))
    assert [r.getMessage() for r in caplog.records] == [
        "Service 'ConcurrencySlotAcquisitionWithLeaseService' failed to process item (1, 'concurrency', 30.0, "
        "'<Future at 0x1 state=finished raised HTTPStatusError>')"]
