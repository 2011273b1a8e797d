"""Start-up imports with the cyclic GC paused: resumed however the block ends, frozen only in memfit's own process."""

from __future__ import annotations

import gc

import pytest

from memfit.runtime.importing import collector_paused

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _collector_restored():
    yield
    gc.enable()  # what a test froze stays frozen: the suite's worker froze its own imports after collection


def test_paused_inside_resumed_after_also_on_error():
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), collector_paused():
        import memfit_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_nested_blocks_resume_once_at_the_outermost():
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()  # the inner block did not resume it under the outer one
    assert gc.isenabled()


def test_a_caller_that_paused_the_collector_keeps_it_paused():
    before = gc.get_freeze_count()
    gc.disable()
    with collector_paused(freeze=True):
        pass
    assert not gc.isenabled() and gc.get_freeze_count() <= before  # and froze nothing: the caller decides


def test_frozen_only_when_asked():
    before = gc.get_freeze_count()
    with collector_paused():
        kept = [object() for _ in range(100)]
    # In-process callers (tests, notebooks) keep collecting everything. (Frozen objects still die by reference
    # count, so the count can fall meanwhile; a freeze would add every object there is.)
    assert gc.get_freeze_count() <= before
    with collector_paused(freeze=True):
        kept.append(object())
    assert gc.get_freeze_count() >= before + len(kept)


def test_in_process_cli_leaves_the_collector_as_it_was(repo_root):
    from tests_support import cli_in_process

    before = gc.get_freeze_count()
    result = cli_in_process("estimate", str(repo_root / "configs" / "tiny.yaml"), "--json")
    assert result.exit_code == 0, result.stderr[-2000:]
    assert gc.isenabled() and gc.get_freeze_count() <= before
