"""Today's plans for the shipped 8B/30B-shaped configs, recorded (tests/fixtures/shipped_plans.json): minutes of
fake-tensor traces, so apart from the tiny configs' unit test."""

from __future__ import annotations

import pytest
from fixtures.shipped_plans import LARGE, check

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("name", LARGE)
def test_shipped_large_plan_is_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check(name, monkeypatch)
