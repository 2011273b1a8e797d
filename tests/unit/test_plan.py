"""The planner as a pure function: estimates and a budget in, the fastest stack that fits out."""

from __future__ import annotations

import pytest

from memfit import config
from memfit.config.devices import PROFILES, get_profile
from memfit.errors import ConfigError
from memfit.memory.estimator.compose import Estimate, Stack, policy_name
from memfit.memory.planner.plan import assignments, choose, every_k_kinds

pytestmark = pytest.mark.unit
GB = 10**9
BASE = Stack("fp32", 8, 1, False)
N = 8


def est(kinds, *, stack=BASE, weights=2 * GB, act_per_block=1 * GB, opt=4 * GB) -> Estimate:
    """A made-up estimate: each kind keeps a share of a block's activations and costs a share of recompute."""
    keep = {"none": 1.0, "selective": 0.5, "full": 0.1, "offload": 0.02}
    cost = {"none": 0.0, "selective": 0.02, "full": 0.035, "offload": 0.05}
    scale = stack.micro_batch_size / 8
    act = int(sum(keep[k] for k in kinds) * act_per_block * scale)
    grads = 0 if stack.lora else weights
    optimizer = int(0.01 * opt) if stack.lora else opt
    seconds = (1.0 + sum(cost[k] for k in kinds)) * (1 + 0.3 * (8 / stack.micro_batch_size - 1))
    name, k = policy_name(tuple(kinds))
    breakdown = {"params": weights, "grads": grads, "optimizer": optimizer, "activations": act, "other": 0}
    return Estimate(stack=stack, kinds=tuple(kinds), policy=name, every_k=k, peak_bytes=sum(breakdown.values()),
                    breakdown=breakdown, activation_bytes=act, peak_at="backward, block 7", step_seconds=seconds,
                    host_bytes=0, weight_bytes=weights, n_params=weights // 4, n_trainable=weights // 4)


def candidates(stacks=(BASE,), kinds=("none", "selective", "full")):
    return [est(a, stack=s) for s in stacks for a in assignments(N, kinds)]


def plan(cands, budget, **kw):
    return choose(cands, budget, configured=BASE, baseline=est(["none"] * N), safety_margin=0.0, **kw)


def test_assignments_cover_every_count_of_each_kind():
    every = assignments(N)
    assert len(every) == (N + 1) * (N + 2) // 2 and len(set(every)) == len(every)
    assert ("none",) * N in every and ("full",) * N in every and every_k_kinds(N, 2) in every
    assert ("offload",) * N in assignments(N, ("none", "full", "offload"))
    deep = assignments(128)
    assert len(deep) < 700 and ("full",) * 128 in deep  # deep models: counts in steps


def test_ample_budget_picks_no_checkpointing():
    p = plan(candidates(), 100 * GB)
    assert p.fits and p.chosen.policy == "none" and p.overhead(p.chosen) == 0


def test_tight_budget_picks_the_fastest_checkpointing_that_fits_never_one_over_budget():
    cands = candidates()
    full, none = est(["full"] * N), est(["none"] * N)
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        budget = int(full.peak_bytes + frac * (none.peak_bytes - full.peak_bytes))
        p = plan(cands, budget)
        assert p.fits and p.chosen.policy != "none" and p.chosen.peak_bytes <= budget
        fitting = [c for c in cands if c.peak_bytes <= budget]
        assert p.chosen.step_seconds == min(c.step_seconds for c in fitting)
        # Beats checkpointing every layer: faster than full while fitting the same budget.
        assert p.chosen.step_seconds < full.step_seconds
        assert all(r["fits"] == (r["predicted_peak_bytes"] <= budget) for r in p.to_dict()["alternatives"])


def test_safety_margin_is_kept_free():
    cands = candidates()
    none = est(["none"] * N)
    p = choose(cands, none.peak_bytes, configured=BASE, baseline=none, safety_margin=0.05)
    assert p.chosen.policy != "none" and p.chosen.peak_bytes <= 0.95 * none.peak_bytes


def test_smaller_micro_batch_when_no_policy_fits_at_the_configured_one():
    small = Stack("fp32", 2, 4, False)
    cands = candidates((BASE, small))
    budget = int(est(["full"] * N).peak_bytes * 0.97)
    p = plan(cands, budget)
    assert p.fits and p.chosen.stack == small and p.chosen.peak_bytes <= budget


def test_precision_and_lora_are_fallbacks_only():
    bf16 = Stack("bf16-true", 8, 1, False)
    lora = Stack("fp32", 8, 1, True)
    cands = candidates((BASE,)) + [est(a, stack=bf16, weights=GB, opt=2 * GB) for a in assignments(N)] + \
        [est(a, stack=lora) for a in assignments(N)]
    assert plan(cands, 100 * GB).chosen.stack == BASE
    budget = est(["full"] * N).peak_bytes - 1
    p = plan(cands, budget)
    assert p.chosen.stack == bf16  # the precision fallback before LoRA
    p = plan([c for c in cands if c.stack != bf16], budget)
    assert p.chosen.stack == lora


def test_nothing_fits_names_the_budget_the_leanest_stack_and_a_knob():
    cands = candidates()
    p = plan(cands, 7 * GB)  # weights + grads + AdamW alone are 8 GB
    assert not p.fits and p.chosen is None
    assert "memory.budget_gb" in p.error and "full" in p.error and "lora.enabled" in p.error
    p = plan(cands, 1 * GB)  # below the weights themselves
    assert "below the model's weights alone" in p.error and "memory.budget_gb" in p.error
    d = p.to_dict()
    assert d["fits"] is False and d["error"] and d["alternatives"]


def test_fixed_policy_is_reported_even_when_it_does_not_fit():
    full = est(["full"] * N)
    p = plan([full], full.peak_bytes - 1, fixed_policy="full")
    assert not p.fits and p.chosen is full and "memory.budget_gb" in p.error


def test_device_profiles_and_unknown_devices():
    assert get_profile("A100-80GB").memory_bytes > get_profile("a100-40gb").memory_bytes
    assert get_profile("RTX 4090").name == "rtx-4090" and not get_profile("t4").bf16
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "rtx-4090", "t4", "cpu"} <= set(PROFILES)
    assert 80e9 < get_profile("h100-80gb").usable_bytes < get_profile("h100-80gb").memory_bytes
    with pytest.raises(ConfigError, match="--device.*tpu-v5"):
        get_profile("tpu-v5")
    with pytest.raises(ConfigError, match="memory.device"):
        config.load(None, ["memory.device=tpu-v5"])
    assert config.load(None, ["memory.device=H100-80GB"]).memory.device == "h100-80gb"


@pytest.mark.parametrize("cuda_name, profile", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-80gb"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla T4", "t4"),
])
def test_a_detected_gpu_gets_its_own_speeds(cuda_name, profile):
    from memfit.config.devices import profile_for_report

    found = profile_for_report({"type": "cuda", "name": cuda_name, "memory_total_bytes": 40 * 2**30,
                                "bf16_supported": True})
    assert found.flops_per_s("bfloat16") == PROFILES[profile].flops_per_s("bfloat16")
    assert found.memory_bytes == 40 * 2**30  # what the device reports, not the profile's nominal size


def test_a_4_bit_base_is_the_last_fallback_after_16_bit_lora():
    lora = Stack("fp32", 8, 1, True)
    qlora = Stack("fp32", 8, 1, True, quantize="nf4")
    cands = candidates((BASE,)) + [est(a, stack=lora) for a in assignments(N)] + \
        [est(a, stack=qlora, weights=GB // 2) for a in assignments(N)]
    budget = est(["full"] * N).peak_bytes - 1  # full fine-tuning does not fit; LoRA and QLoRA do
    p = plan(cands, budget)
    assert p.chosen.stack == lora
    lean = est(["full"] * N, stack=lora).peak_bytes - 1  # only the 4-bit base fits
    p = plan(cands, lean)
    assert p.fits and p.chosen.stack == qlora and p.chosen.peak_bytes <= lean
    assert p.to_dict()["quantize"] == "nf4"


@pytest.mark.parametrize("enabled, quantize, expected", [
    ("auto", "nf4", [(False, "none"), (True, "none"), (True, "nf4")]),
    ("auto", "none", [(False, "none"), (True, "none")]),
    (True, "nf4", [(True, "nf4")]),
    (False, "none", [(False, "none")]),
])
def test_lora_fallbacks_follow_lora_enabled_and_quantize(enabled, quantize, expected):
    from memfit.memory.planner.search import lora_fallbacks

    assert lora_fallbacks(config.LoraConfig(enabled=enabled, quantize=quantize)) == expected


def test_technique_choices_multiply_the_candidates_of_a_tier():
    from memfit.memory.planner.search import technique_variants

    assert technique_variants(BASE, {}) == [BASE]
    got = technique_variants(BASE, {"loss": ("plain", "chunked"), "optimizer": ("adamw", "adamw-8bit")})
    assert len(got) == 4 and len(set(got)) == 4
    assert {(s.loss, s.optimizer) for s in got} == {(a, b) for a in ("plain", "chunked")
                                                    for b in ("adamw", "adamw-8bit")}
    assert all(s.micro_batch_size == BASE.micro_batch_size and s.precision == BASE.precision for s in got)


class _CurveEstimator:
    """Peak = weights (and their gradients) of `fixed + curve(sequence)` bytes: the search must find the largest
    multiple of the step under the limit, whatever the curve."""

    def __init__(self, fixed: int, curve, seq: int = 0, calls: list[int] | None = None) -> None:
        self.fixed, self.curve, self.seq = fixed, curve, seq
        self.calls = [] if calls is None else calls

    def at_seq_len(self, seq: int):
        self.calls.append(seq)
        return _CurveEstimator(self.fixed, self.curve, seq, self.calls)

    def estimate(self, stack, kinds):
        return est(kinds, stack=stack, weights=self.fixed + self.curve(self.seq), act_per_block=0, opt=0)


# Linear (SDPA activations), quadratic (eager attention scores), and a staircase no curve fits (chunked buffers).
CURVES = {"linear": (lambda s: 100_000 * s, 4), "quadratic": (lambda s: 20_000 * s + s * s // 3, 6),
          "staircase": (lambda s: 400 * GB // 1000 * (1 + s // 3000), 15)}


@pytest.mark.parametrize("shape", CURVES)
def test_max_seq_search_finds_the_longest_length_that_fits(shape):
    from memfit.memory.planner.max_seq import longest_seq_len

    curve, most_calls = CURVES[shape]
    fake = _CurveEstimator(GB, curve)
    limit = 5 * GB
    seq, e = longest_seq_len(fake, BASE, ("full",) * N, limit, hi=131072, step=64)
    peak = lambda s: 2 * (GB + curve(s))  # noqa: E731 - weights + their gradients in est()
    assert seq % 64 == 0 and peak(seq) <= limit < peak(seq + 64)
    # Each call is a traced step (seconds on a large model): bisection over 2048 steps takes 12.
    assert e.peak_bytes == peak(seq) and len(fake.calls) <= most_calls, fake.calls
    assert longest_seq_len(fake, BASE, ("full",) * N, GB, hi=131072) == (0, None)
    assert longest_seq_len(fake, BASE, ("full",) * N, 10**15, hi=131072)[0] == 131072


def test_quantize_without_lora_and_missing_bitsandbytes_are_one_line_errors(monkeypatch):
    import sys

    from memfit.models.quantization import require_bitsandbytes

    with pytest.raises(ConfigError, match=r"lora.quantize=nf4 .* set lora.enabled=true"):
        config.load(None, ["lora.quantize=nf4"])
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"lora.quantize=nf4 needs bitsandbytes.*pip install bitsandbytes") as err:
        require_bitsandbytes()
    assert "\n" not in str(err.value)


def test_nf4_bytes_equal_what_bitsandbytes_holds_for_a_layer():
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    from memfit.models.quantization import NF4Quantization, nf4_bytes

    layer = torch.nn.Linear(256, 192, bias=False)
    q = NF4Quantization(torch.bfloat16)._linear4bit(bnb, layer)
    qs = q.weight.quant_state
    held = [q.weight.data, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
    assert nf4_bytes(layer.weight.numel()) == sum(t.numel() * t.element_size() for t in held)


def test_only_auto_techniques_are_left_to_the_planner():
    from memfit.memory.planner.search import technique_choices

    assert technique_choices(config.from_dict({"memory": {"loss": "plain"}})) == {}
    auto = technique_choices(config.from_dict({"memory": {"optimizer_in_backward": "auto"},
                                               "train": {"max_grad_norm": None}}))
    assert auto == {"loss": ("plain", "chunked"), "optimizer_in_backward": (False, True)}
    # A global clip needs every gradient before any step: no step in backward; several ranks: no chunked loss.
    assert "optimizer_in_backward" not in technique_choices(config.from_dict({"memory": {"optimizer_in_backward":
                                                                                          "auto"}}))
    ranks = config.from_dict({"distributed": {"nproc_per_node": 2}})
    assert "loss" not in technique_choices(ranks)


def test_step_in_backward_only_without_accumulation_or_fp16_scaling():
    from memfit.memory.planner.search import technique_variants

    choices = {"optimizer_in_backward": (False, True)}
    assert {s.optimizer_in_backward for s in technique_variants(BASE, choices)} == {False, True}
    for stack in (Stack("fp32", 4, 2, False), Stack("fp16-mixed", 8, 1, False)):
        assert [s.optimizer_in_backward for s in technique_variants(stack, choices)] == [False]


def test_lean_optimizers_are_fallbacks_after_the_configured_one(monkeypatch):
    import importlib.util

    from memfit.memory.planner.search import candidate_tiers, optimizer_fallbacks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "bitsandbytes" else real(n, *a))
    cfg = config.from_dict({})
    assert optimizer_fallbacks(cfg, PROFILES["cpu"]) == ["adamw", "adamw-8bit"]
    assert optimizer_fallbacks(cfg, get_profile("a100-40gb", "x")) == ["adamw-fused", "adamw-8bit",
                                                                      "adamw-cpu-offload"]
    assert optimizer_fallbacks(config.from_dict({"memory": {"optimizer": "adamw"}}), PROFILES["cpu"]) == ["adamw"]
    tiers = candidate_tiers(cfg, PROFILES["cpu"])
    # One LoRA-free tier per optimizer, each without and then with the lean layers (memory.lean_layers auto).
    assert [(t[0].optimizer, t[0].lean_layers) for t in tiers] == [("adamw", False), ("adamw", True),
                                                                    ("adamw-8bit", False), ("adamw-8bit", True)]
    assert {s.loss for s in tiers[0]} == {"plain", "chunked"}
    assert len(candidate_tiers(config.from_dict({"memory": {"lean_layers": False}}), PROFILES["cpu"])) == 2


def test_plan_table_shows_loss_and_optimizer():
    from memfit.memory.planner.plan import plan_table_markdown

    chunked = Stack("fp32", 8, 1, False, loss="chunked", optimizer="adamw-8bit")
    p = plan(candidates((BASE,)) + [est(["full"] * N, stack=chunked)], est(["none"] * N).peak_bytes)
    table = plan_table_markdown(p)
    assert "loss / optimizer" in table.splitlines()[0]
    assert "| plain / adamw |" in table and "| chunked / adamw-8bit |" in table


def test_max_seq_takes_the_leanest_per_token_stack_the_config_leaves_open():
    from memfit.memory.planner.max_seq import longest_context_stack

    planned = est(["none"] * 6 + ["full"] * 2)
    cuda, cpu = get_profile("t4", "x"), PROFILES["cpu"]
    stack, kinds = longest_context_stack(config.from_dict({}), cuda, planned, 128_256)
    assert kinds == ("offload",) * N and stack.loss == "chunked"  # auto policy, and auto loss at a large vocab
    assert stack.lean_layers  # and under memory.lean_layers auto, the lean layers
    assert longest_context_stack(config.from_dict({}), cuda, planned, 512)[0].loss == "plain"  # as a run has it
    assert longest_context_stack(config.from_dict({}), cpu, planned, 512)[1] == ("full",) * N  # offload: CUDA only
    fixed = config.from_dict({"memory": {"policy": "selective", "loss": "plain", "lean_layers": False}})
    assert longest_context_stack(fixed, cuda, planned, 128_256) == (planned.stack, planned.kinds)  # as set
