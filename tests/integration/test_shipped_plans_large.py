"""Today's plans for the shipped 8B/30B-shaped configs, recorded (tests/fixtures/shipped_plans.json): minutes of
fake-tensor traces, so apart from the tiny configs' unit test."""

from __future__ import annotations

import pytest
from fixtures.shipped_plans import LARGE, check, planned

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("name", LARGE)
def test_shipped_large_plan_is_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check(name, monkeypatch)


def test_the_8b_dpo_lora_plan_fits_a_24gb_card_and_names_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped DPO recipe (the plan the test above traced, reused)."""
    from memfit.memory.planner.plan import plan_table_markdown

    plan, out = planned("llama-3-8b-dpo-lora.yaml", monkeypatch)
    assert out["fits"] and out["device"] == "rtx-4090" and out["lora"] and out["reference"] == "adapter_off"
    assert out["predicted_peak_bytes"] <= out["limit_bytes"]
    text = plan_table_markdown(plan)
    assert "reference counted: adapter_off: the policy with its LoRA adapters disabled" in text
