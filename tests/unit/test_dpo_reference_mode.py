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
    # FSDP2 / ZeRO-3: each rank holds a slice of the weights, so no copy: the pass before step 1 instead.
    assert reference_mode("auto", "sigmoid", lora=False, coverage=part, sharded=True) == "precompute"
    assert reference_mode("auto", "sigmoid", lora=True, coverage=part, sharded=True) == "adapter_off"


def test_copy_of_a_sharded_model_is_refused_in_one_line_naming_the_field():
    from memfit import config

    for strategy in ("fsdp2", "deepspeed_zero3"):
        with pytest.raises(ConfigError, match=rf"\(root\): dpo\.reference: copy is not supported with "
                                              rf"distributed\.strategy {strategy} .* use precompute"):
            config.load(None, [f"distributed.strategy={strategy}", "distributed.nproc_per_node=2",
                               "train.objective=dpo", "data.format=preference", "dpo.reference=copy"])
    # ZeRO-2 keeps whole parameters on every rank: a copy is allowed there.
    cfg = config.load(None, ["distributed.strategy=deepspeed_zero2", "distributed.nproc_per_node=2",
                             "train.objective=dpo", "data.format=preference", "dpo.reference=copy"])
    assert cfg.dpo.reference == "copy"


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


def test_the_plan_counts_no_copy_where_the_run_would_shard_the_model():
    """The estimate resolves auto as the run does: a copy on whole replicas (ddp, ZeRO-2), precompute on FSDP2 and
    ZeRO-3, whose ranks each hold a slice (objective.make_reference refuses to copy those)."""
    from memfit import config
    from memfit.config.devices import get_profile
    from memfit.memory.planner.candidates import configured_stack
    from memfit.memory.planner.search import make_estimator

    for strategy, want in (("ddp", "copy"), ("deepspeed_zero2", "copy"), ("fsdp2", "precompute"),
                           ("deepspeed_zero3", "precompute")):
        cfg = config.load(None, ["train.objective=dpo", "data.format=preference", "lora.enabled=false",
                                 f"distributed.strategy={strategy}", "distributed.nproc_per_node=2"])
        est = make_estimator(cfg, get_profile("cpu"))
        assert est._reference(configured_stack(cfg)) == want, strategy
