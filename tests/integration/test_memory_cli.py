"""`memfit estimate` and `memfit plan` as a user runs them, and LoRA + checkpointing through the phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests_support import cli_in_process as memfit

from memfit import phases, run_context
from memfit.errors import MemoryBudgetError
from memfit.reports import PlanReport

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _json(res) -> dict:
    assert res.exit_code == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_clean_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.stderr[-2000:]
    for n in needles:
        assert n in res.stderr, (n, res.stderr[-2000:])


def test_plan_between_full_and_none_fits_with_checkpointing():
    none = _json(memfit("estimate", TINY, "--policy", "none", "--json"))
    full = _json(memfit("estimate", TINY, "--policy", "full", "--json"))
    for e in (none, full):
        assert set(e["breakdown"]) == {"params", "grads", "optimizer", "activations", "other"}
        assert e["total_bytes"] == sum(e["breakdown"].values())
    assert full["total_bytes"] < none["total_bytes"] and full["activation_bytes"] < none["activation_bytes"]
    budget_gb = (full["total_bytes"] + none["total_bytes"]) / 2 / 1e9
    plan = _json(memfit("plan", TINY, "--budget-gb", f"{budget_gb:.9f}", "--json"))
    assert plan["fits"] is True and plan["policy"] != "none"
    assert plan["predicted_peak_bytes"] <= budget_gb * 1e9
    assert plan["predicted_overhead"] < next(a["predicted_overhead"] for a in plan["alternatives"]
                                             if a["policy"] == "full" and a["micro_batch_size"] == 8)
    for key in ("precision", "micro_batch_size", "grad_accum_steps", "lora", "alternatives"):
        assert key in plan
    assert all(a["predicted_peak_bytes"] > plan["limit_bytes"] for a in plan["alternatives"] if not a["fits"])


def test_plan_falls_back_to_lean_layers_only_where_nothing_fits_without_them():
    fixed = ["--set", "memory.allow_smaller_micro_batch=false"]
    plain = _json(memfit("estimate", TINY, "--policy", "full", "--json", *fixed))
    lean = _json(memfit("estimate", TINY, "--policy", "full", "--json", *fixed, "--set", "memory.lean_layers=true"))
    assert lean["total_bytes"] < 0.95 * plain["total_bytes"]  # silu(gate) no longer saved in each block
    roomy = _json(memfit("plan", TINY, "--json", *fixed, "--budget-gb", f"{2 * plain['total_bytes'] / 1e9:.9f}"))
    assert roomy["fits"] and roomy["lean_layers"] is False  # where the model's own layers fit, they train
    budget = (plain["total_bytes"] + lean["total_bytes"]) / 2 / 0.95 / 1e9  # above lean, below plain after the margin
    tight = _json(memfit("plan", TINY, "--json", *fixed, "--budget-gb", f"{budget:.9f}"))
    assert tight["fits"] and tight["lean_layers"] is True, tight
    assert lean["total_bytes"] <= tight["predicted_peak_bytes"] <= tight["limit_bytes"] < plain["total_bytes"]
    res = memfit("plan", TINY, *fixed, "--budget-gb", f"{budget:.9f}")
    assert "lean layers" in res.stdout  # the candidate table names the technique


def test_plan_max_seq_reports_the_longest_sequence_that_fits():
    budget = 0.05
    out = _json(memfit("plan", TINY, "--budget-gb", str(budget), "--max-seq", "--set", "memory.policy=full",
                       "--json"))
    seq, limit = out["max_seq_len"], out["limit_bytes"]
    assert seq > 0 and seq % 64 == 0 and out["predicted_peak_bytes"] <= limit
    # What the user checks: that length fits by `memfit estimate`, 64 tokens more does not.
    at = _json(memfit("estimate", TINY, "--budget-gb", str(budget), "--set", "memory.policy=full", "--set",
                      f"data.seq_len={seq}", "--json"))
    over = _json(memfit("estimate", TINY, "--budget-gb", str(budget), "--set", "memory.policy=full", "--set",
                        f"data.seq_len={seq + 64}", "--json"))
    assert at["total_bytes"] <= limit < over["total_bytes"]
    _assert_clean_error(memfit("plan", TINY, "--max-seq"), "--max-seq needs a memory budget")


def test_plan_and_estimate_bad_input():
    _assert_clean_error(memfit("plan", TINY, "--device", "tpu-v5"), "--device", "tpu-v5")
    _assert_clean_error(memfit("estimate", TINY, "--policy", "sometimes"), "--policy")
    _assert_clean_error(memfit("plan", TINY, "--set", "memory.budget_gb=0.0001"),
                        "memory.budget_gb", "below the model's weights alone")
    _assert_clean_error(memfit("estimate", TINY, "--set", "lora.enabled=true", "--set",
                               "lora.target_modules=[nope_proj]"), "lora.target_modules", "nope_proj")
    _assert_clean_error(memfit("estimate", TINY, "--set", "lora.quantize=nf4"), "lora.quantize", "lora.enabled")


def test_lora_with_checkpointing_trains_adapters_and_exports_merged(tiny_config):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(**{"lora.enabled": "true", "lora.r": 4, "memory.policy": "full", "train.max_steps": 2,
                         "train.eval_batches": 1, "tracking.backend": "null"})
    report = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, report)
    assert plan.lora is True and plan.policy == "full" and plan.predicted_peak_bytes > 0
    result = phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), report)
    assert result.steps == 2
    exported = phases.evaluate_and_release(cfg, result)
    model = AutoModelForCausalLM.from_pretrained(exported.safetensors_dir)
    assert not any("lora" in k for k in model.state_dict())
    assert exported.final_val_loss < 50
    # Even a forced policy cannot run when the budget is below the weights themselves.
    with pytest.raises(MemoryBudgetError, match="memory.budget_gb.*below the model's weights alone"):
        phases.plan_stack(tiny_config(**{"memory.policy": "full", "memory.budget_gb": 1e-5}), report)


def test_a_planned_mix_is_applied_block_by_block(tiny_config):
    cfg = tiny_config()
    inputs = run_context.load_inputs(cfg)
    plan = PlanReport(policy="mixed", every_k=2, precision="fp32", micro_batch_size=8, grad_accum_steps=2,
                      reason="test", description="", block_kinds=["full", "selective"])
    model = run_context.build_training_model(cfg, inputs.model, plan)
    flags = [b.gradient_checkpointing for b in model.model.layers]
    funcs = [b._gradient_checkpointing_func for b in model.model.layers]
    assert flags == [True, True] and funcs[0] is not funcs[1]
    batch = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
