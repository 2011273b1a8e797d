"""The step-time clock against measured steps: the estimator's predicted s/step on an H200 within 15 % of what the
H200 measured, and each row's time relative to another within 10 % of the measured ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit import config
from memfit.config.devices import get_profile
from memfit.memory.estimator.clock import NO_KERNEL, attention_flops, op_cost_model
from memfit.memory.planner.search import estimate_policy

pytestmark = pytest.mark.unit

SOURCE = "FACTS.md 'GPU, measured 2026-12-04', one H200, memfit profile (median s/step)"
# Llama-3-8B's config.json, and Llama-3.2-1B's shape on it (the GPU check made both with random weights).
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
            "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA_1B = {**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "tie_word_embeddings": True}
BF16 = ["data.seq_len=2048", "train.grad_accum_steps=1", "train.precision=bf16-mixed"]
# name: (model, policy, overrides, measured s/step on the H200): every figure from SOURCE's table
ROWS = {
    "1b-full-ft-none": ("1b", "none", ["train.batch_size=4"], 0.236),  # loss auto = chunked
    "1b-plain-adamw-fused": ("1b", "none", ["train.batch_size=4", "memory.loss=plain",
                                            "memory.optimizer=adamw-fused"], 0.188),
    "1b-full-ft-full": ("1b", "full", ["train.batch_size=4"], 0.274),
    "1b-lora-full": ("1b", "full", ["train.batch_size=4", "lora.enabled=true"], 0.255),
    "8b-lora-full": ("8b", "full", ["train.batch_size=2", "lora.enabled=true"], 0.501),
    "8b-lora-offload": ("8b", "offload", ["train.batch_size=2", "lora.enabled=true"], 0.560),
}
RATIOS = [("1b-plain-adamw-fused", "1b-full-ft-none"), ("1b-full-ft-full", "1b-full-ft-none"),
          ("1b-lora-full", "1b-full-ft-full"), ("8b-lora-full", "1b-lora-full"),
          ("8b-lora-offload", "8b-lora-full"), ("8b-lora-full", "1b-full-ft-none")]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Model folders holding only config.json: 1b/ and 8b/."""
    root = tmp_path_factory.mktemp("shapes")
    for name, cfg in (("1b", LLAMA_1B), ("8b", LLAMA_8B)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


def load(shapes: Path, model: str, sets: list[str]) -> config.MemfitConfig:
    return config.load(None, [f"model.name_or_path={shapes / model}", "model.preset=null", "tracking.backend=null",
                              *BF16, *sets])


@pytest.fixture(scope="module")
def predicted(shapes: Path) -> dict[str, float]:
    """Each row's predicted s/step for `memfit estimate --device h200 --policy P` (composed from proxy blocks)."""
    return {row: estimate_policy(load(shapes, model, sets), get_profile("h200"), policy).step_seconds
            for row, (model, policy, sets, _) in ROWS.items()}


@pytest.mark.parametrize("row", list(ROWS))
def test_predicted_step_time_is_within_15_percent_of_the_h200(row: str, predicted: dict[str, float]) -> None:
    measured = ROWS[row][3]
    assert predicted[row] / measured == pytest.approx(1.0, abs=0.15), (row, predicted[row], measured, SOURCE)


@pytest.mark.parametrize(("a", "b"), RATIOS)
def test_time_ratios_are_within_10_percent_of_the_h200(a: str, b: str, predicted: dict[str, float]) -> None:
    want = ROWS[a][3] / ROWS[b][3]
    got = predicted[a] / predicted[b]
    assert got / want == pytest.approx(1.0, abs=0.10), (a, b, got, want, SOURCE)


def test_metadata_ops_cost_nothing_and_causal_attention_half() -> None:
    import torch

    clock = op_cost_model(get_profile("h200"))
    x = torch.empty(4, 8)
    assert clock(torch.ops.prim.device.default, (x,), {}, x.device) == 0.0
    assert "aten.empty.memory_format" in NO_KERNEL
    assert clock(torch.ops.aten.add.Tensor, (x, x), {}, x) > 0.0  # a real kernel: its launch at least
    q = torch.empty(1, 2, 16, 8)
    name = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    full = attention_flops(name, (q, q, q), {})
    assert full == 2 * 2 * 16 * 16 * 8 * 2
    assert attention_flops(name, (q, q, q, 0.0, True), {}) == full // 2
    assert attention_flops("aten.mm.default", (q,), {}) is None



def test_plan_on_an_h200_takes_the_faster_plain_loss(shapes: Path) -> None:
    """The 1B row fits an H200 without checkpointing either way: the loss is weighed by time (FACTS: chunked 0.236 s,
    plain 0.188 s), not left at auto's chunked with "+0.0 %". fused needs liger-kernel, absent here: not offered."""
    from memfit.memory.planner.search import plan_report

    plan, out = plan_report(load(shapes, "1b", ["train.batch_size=4"]), "h200")
    assert plan.fits and out["loss"] == "plain" and out["kinds"] == ["none"] * 16
    times = {r["loss"]: r["predicted_step_seconds"] for r in [out, *out["alternatives"]]}
    assert set(times) == {"plain", "chunked"} and times["plain"] < times["chunked"]
    assert f"predicted step {times['plain']:.3g} s" in out["reason"]
    from memfit.memory.planner.plan import fit_margin

    assert out["limit_bytes"] == int(out["budget_bytes"] * (1 - fit_margin(0.05, "cuda")))  # the bias, applied


@pytest.mark.integration
@pytest.mark.slow
def test_plan_on_a_24gb_card_still_fits(shapes: Path) -> None:
    from memfit.memory.planner.search import plan_report

    plan, out = plan_report(load(shapes, "1b", ["train.batch_size=4"]), "rtx-4090")
    assert plan.fits and out["predicted_peak_bytes"] <= out["limit_bytes"]


def test_a_cuda_target_keeps_room_for_the_estimators_bias() -> None:
    """FACTS 2026-12-04: the estimate was up to 3.2 % under the allocator's peak on CUDA; a peak at the CUDA limit,
    grown by that bias, still fits what the safety margin leaves. CPU targets keep the margin as set."""
    from memfit.memory.planner.plan import CUDA_ESTIMATE_UNDER, fit_margin

    assert CUDA_ESTIMATE_UNDER == 0.032
    assert fit_margin(0.05, "cpu") == 0.05
    budget = 24e9
    limit = budget * (1 - fit_margin(0.05, "cuda"))
    assert limit * (1 + CUDA_ESTIMATE_UNDER) == pytest.approx(budget * 0.95)


def test_emulated_optimizer_steps_are_charged() -> None:
    """The variants the trace emulates (no kernels on fake tensors) are not free: 8-bit AdamW a memory-bound pass,
    the CPU-offloaded one the host link both ways."""
    from memfit.memory.estimator.clock import emulated_step_seconds

    h200 = get_profile("h200")
    params = [(1_000_000_000, 4)]  # 1 B fp32 trainable values
    assert emulated_step_seconds("adamw-cpu-offload", params, h200) == pytest.approx(8e9 / h200.host_bandwidth)
    eight = emulated_step_seconds("adamw-8bit", params, h200)
    assert eight == pytest.approx(16e9 / (h200.bandwidth * h200.bandwidth_efficiency) + h200.op_overhead_s)
    assert emulated_step_seconds("adamw-fused", params, h200) == 0.0  # traced: its own kernels are charged


def test_lean_layers_compete_on_time_only_beside_the_same_stacks() -> None:
    """Once a tier fits with recompute, the tier after it joins the race only when it is the same stacks with lean
    layers (they may let fewer blocks recompute); another optimizer, LoRA or precision stays a fallback."""
    from dataclasses import replace

    from memfit.memory.estimator.compose import Stack
    from memfit.memory.planner.candidates import lean_rival

    tier = [Stack("bf16-mixed", 4, 1, False, loss="plain", optimizer="adamw-fused")]
    lean = [replace(s, lean_layers=True) for s in tier]
    assert lean_rival(tier, [lean])
    assert not lean_rival(tier, [[replace(s, optimizer="adamw-8bit") for s in tier]])
    assert not lean_rival(tier, [[replace(s, lora=True, lean_layers=True) for s in tier]])
    assert not lean_rival(lean, [lean]) and not lean_rival(tier, [])
