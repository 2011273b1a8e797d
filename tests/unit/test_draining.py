"""The draining runner's claim guard: from the notice on, a machine claims no flow run and hands back one whose
claim was already under way (flows/draining.py); no server, no process."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


class _Proposer:
    """Prefect's StateProposer as far as a claim goes: Scheduled -> Pending, `during` runs while it is in flight."""

    def __init__(self, during=None) -> None:
        self.claims: list[str] = []
        self.during = during

    async def propose_pending(self, flow_run) -> bool:
        self.claims.append(flow_run.id)
        if self.during:
            self.during()
        return True


class _Client:
    def __init__(self) -> None:
        self.states: list[tuple[str, str, bool]] = []

    async def set_flow_run_state(self, flow_run_id, state, force=False) -> None:
        self.states.append((flow_run_id, state.type.value, force))


def _runner(during=None):
    from flows.draining import DrainingRunner

    runner = DrainingRunner(limit=None, query_seconds=1, pause_on_shutdown=False)
    runner._state_proposer, runner._client = _Proposer(during), _Client()
    runner._guard_claims()
    return runner


RUN = SimpleNamespace(id="run-1", name="tiny-attempt-2")


def test_a_machine_that_is_not_draining_claims_as_prefect_does():
    runner = _runner()
    assert asyncio.run(runner._state_proposer.propose_pending(RUN)) is True
    assert runner._state_proposer.claims == ["run-1"] and runner._client.states == []


def test_after_the_notice_nothing_is_claimed_and_the_run_stays_scheduled_for_another_machine():
    runner = _runner()
    runner.begin_drain("spot interruption notice")  # not started: recorded, drained once the loop runs
    assert runner.draining_since is not None
    assert asyncio.run(runner._state_proposer.propose_pending(RUN)) is False
    assert runner._state_proposer.claims == [] and runner._client.states == []


def test_a_claim_under_way_when_the_notice_comes_is_handed_back():
    runner = None

    def notice() -> None:
        runner.begin_drain("SIGTERM")

    runner = _runner(during=notice)
    assert asyncio.run(runner._state_proposer.propose_pending(RUN)) is False
    # Claimed (Pending) on the server as the notice came: set Scheduled again, so another machine takes it.
    assert runner._state_proposer.claims == ["run-1"] and runner._client.states == [("run-1", "SCHEDULED", True)]
