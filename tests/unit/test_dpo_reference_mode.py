"""dpo.reference auto: which reference a DPO run takes, from the stack and how often its steps go over the pairs."""

from __future__ import annotations

import pytest

from memfit.errors import ConfigError
from memfit.memory.estimator.preference import coverage, reference_mode

pytestmark = pytest.mark.unit


def test_auto_precomputes_once_the_run_goes_over_its_pairs_at_least_once():
    # 100 steps of 8 pairs over 800 pairs: one full pass; a per-step reference would compute each pair again.
    assert coverage(100, 8, 800) == 1.0
    assert reference_mode("auto", "sigmoid", lora=False, coverage=1.0) == "precompute"
    assert reference_mode("auto", "ipo", lora=True, coverage=3.5) == "precompute"


def test_auto_below_one_pass_or_unknown_keeps_a_reference_in_step():
    # 40 steps of 8 over 700 pairs: under half a pass; precomputing all 700 would do more forwards than 320.
    part = coverage(40, 8, 700)
    assert part == pytest.approx(320 / 700)
    assert reference_mode("auto", "sigmoid", lora=True, coverage=part) == "adapter_off"
    assert reference_mode("auto", "sigmoid", lora=False, coverage=part) == "copy"
    assert reference_mode("auto", "sigmoid", lora=False, coverage=None) == "copy"  # a plan before the data is read


def test_an_explicit_setting_and_the_reference_free_loss_are_kept():
    assert reference_mode("copy", "sigmoid", lora=True, coverage=10.0) == "copy"
    assert reference_mode("adapter_off", "ipo", lora=True, coverage=10.0) == "adapter_off"
    assert reference_mode("auto", "simpo", lora=False, coverage=10.0) == "none"
    assert coverage(5, 4, 0) == 20.0  # no pairs counted yet: no division by zero


def test_a_dpo_plan_counts_the_logits_it_forms_and_refuses_a_next_token_loss():
    """DPO's log-probs come from the logits: the estimate traces the plain loss whatever the stack says, the search
    does not weigh memory.loss, and chunked/fused set explicitly are refused in one line."""
    from memfit import config
    from memfit.memory.planner.candidates import technique_choices

    dpo = ["train.objective=dpo", "data.format=preference"]
    assert "loss" not in technique_choices(config.load(None, dpo))
    assert "loss" in technique_choices(config.load(None, []))
    for loss in ("chunked", "fused"):
        with pytest.raises(ConfigError, match=f"memory.loss: {loss} is a next-token loss, and train.objective dpo"):
            config.load(None, [*dpo, f"memory.loss={loss}"])
    config.load(None, [*dpo, "memory.loss=plain"])
