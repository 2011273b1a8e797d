"""The tiny shipped configs plan exactly as recorded (tests/fixtures/shipped_plans.py); the 8B/30B shapes trace
for minutes and run as tests/integration/test_shipped_plans_large.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.shipped_plans import LARGE, ROOT, SMALL, check

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", SMALL)
def test_shipped_plan_is_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check(name, monkeypatch)


def test_every_shipped_config_is_covered() -> None:
    shipped = {p.name for p in Path(ROOT, "configs").glob("*.yaml")}
    assert shipped - set(SMALL) - set(LARGE) == {"llama-3.2-1b.yaml"}
