"""The estimator: fake-tensor predictions against real measurements, composition, big models from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from memory_support import SAVE_OPS, VOCAB, tiny

from memfit import config
from memfit.config.devices import PROFILES, get_profile
from memfit.memory.estimator.compose import Stack
from memfit.memory.estimator.estimate import Estimator, trace_whole_step
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.techniques.policies import assign_blocks, find_blocks, mixed_kinds

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SEQ = 48
# The estimator runs the very ops a real step runs, on fake tensors: measured and predicted bytes agree to
# within this (they agree exactly on these models; the margin covers kernels whose workspace differs).
TOLERANCE = 0.03


def measure(model, kinds, stack: Stack) -> tuple[int, int]:
    """(peak, activations after the last forward) of one real steady-state step, from the tracker."""
    assign_blocks(model, kinds, save_ops=SAVE_OPS)
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (stack.micro_batch_size, SEQ), generator=gen)
               for _ in range(stack.grad_accum_steps)]
    tracker = StepTracker(find_blocks(model))
    tracker.track_external(model, optimizer)
    with tracker:
        run_step(model, optimizer, batches, stack.precision, tracker)
    res = tracker.result()
    act = [s.end["activations"] for s in res.segments if s.label.endswith(".fpost")][-1]
    return res.peak_bytes, act


@pytest.mark.parametrize("arch, stack, policies", [
    ("llama", Stack("fp32", 4, 1, False), ["none", "every_2"]),
    ("gpt2", Stack("bf16-mixed", 2, 2, False), ["none", "selective"]),
])
def test_estimate_matches_the_measured_step(arch, stack, policies):
    model = tiny(arch)
    n = len(find_blocks(model))
    est = Estimator(model.config, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS)
    for policy in policies:
        kinds = ["full" if i % 2 == 0 else "none" for i in range(n)] if policy == "every_2" else [policy] * n
        predicted = est.estimate(stack, kinds)
        peak, act = measure(model, kinds, stack)
        assert predicted.peak_bytes == pytest.approx(peak, rel=TOLERANCE), policy
        assert predicted.activation_bytes == pytest.approx(act, rel=TOLERANCE), policy
        b = predicted.breakdown
        assert b["params"] > 0 and b["optimizer"] > 0 and sum(b.values()) == predicted.peak_bytes


def test_composed_estimate_matches_a_whole_depth_trace():
    cfg = tiny("llama", layers=5).config
    stack = Stack("bf16-mixed", 2, 2, False)
    est = Estimator(cfg, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS)
    for kinds in (mixed_kinds(5, {"full": 2, "selective": 2, "none": 1}),):
        composed = est.estimate(stack, kinds)
        whole = trace_whole_step(cfg, stack, kinds, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS)
        assert composed.peak_bytes == pytest.approx(whole["peak_bytes"], rel=0.01)
        assert composed.activation_bytes == pytest.approx(whole["activation_bytes"], rel=0.01)


def test_interpolated_micro_batches_never_underestimate():
    cfg = tiny("llama", layers=2).config
    anchored = Estimator(cfg, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS, anchor_micro_batch=8)
    exact = Estimator(cfg, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS)
    for kind in ("none", "full"):
        stack = Stack("fp32", 4, 4, False)
        a, e = anchored.estimate(stack, [kind] * 2), exact.estimate(stack, [kind] * 2)
        assert e.peak_bytes <= a.peak_bytes <= e.peak_bytes * 1.01
        assert a.activation_bytes == pytest.approx(e.activation_bytes, rel=0.001)


def test_offload_estimate_parks_block_inputs_on_the_host():
    cfg = tiny("llama").config
    est = Estimator(cfg, SEQ, get_profile("a100-40gb"), save_ops=SAVE_OPS)
    stack = Stack("bf16-mixed", 4, 1, False)
    full, off = est.estimate(stack, ["full"] * 4), est.estimate(stack, ["offload"] * 4)
    assert off.activation_bytes < full.activation_bytes and off.host_bytes > 0


def test_llama3_8b_from_config_json_alone(tmp_path):
    """Full fine-tuning of Llama-3-8B in bf16-mixed needs > 80 GB for weights + grads + AdamW; LoRA with full
    checkpointing at batch 4 x 2048 fits an 80 GB device. Nothing is allocated: config.json is all there is."""
    from memfit.memory.planner.search import estimate_report

    folder = tmp_path / "llama-3-8b"
    folder.mkdir()
    (folder / "config.json").write_text((REPO / "configs" / "models" / "llama-3-8b" / "config.json").read_text())
    cfg = config.load(REPO / "configs" / "llama-3-8b-lora.yaml", [f"model.name_or_path={folder}"])
    assert (cfg.train.batch_size, cfg.data.seq_len, cfg.memory.policy) == (4, 2048, "full")
    full_ft = estimate_report(cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"enabled": False})}))
    b = full_ft["breakdown"]
    assert full_ft["n_params"] == pytest.approx(8.03e9, rel=0.01)
    assert b["params"] + b["grads"] + b["optimizer"] > 80e9 and full_ft["fits"] is False
    lora = estimate_report(cfg)
    assert lora["lora"] is True and lora["n_trainable"] < 0.01 * lora["n_params"]
    assert lora["total_bytes"] <= 80e9 and lora["fits"] is True
    assert lora["breakdown"]["activations"] > 1e9  # 32 checkpointed block inputs at 4 x 2048 x 4096, logits...
    json.dumps(lora)  # what `memfit estimate --json` prints


@pytest.mark.parametrize("quantize,lean", [("none", False), ("nf4", False), ("none", True), ("nf4", True)])
def test_lora_estimate_matches_the_measured_step_with_a_16_bit_or_4_bit_base(quantize, lean):
    """The frozen base in bf16 (or NF4) and the adapters in fp32, as prepare_lora_model builds the training
    model (with or without the lean layers): the estimate on fake tensors equals the tracker's measurement of
    the real step."""
    from memfit.memory.techniques.lean_layers import apply_lean_layers
    from memfit.models.lora import prepare_lora_model

    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    lora_cfg = config.LoraConfig(enabled=True, r=4, quantize=quantize)
    model = prepare_lora_model(tiny("llama"), lora_cfg, "bf16-mixed")
    if lean:
        assert apply_lean_layers(model)["mlp"] == len(find_blocks(model))
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == ({torch.bfloat16} if quantize == "none" else {torch.bfloat16, torch.uint8})
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    stack = Stack("bf16-mixed", 4, 1, True, quantize=quantize, lean_layers=lean)
    est = Estimator(tiny("llama").config, SEQ, PROFILES["cpu"], lora_cfg=lora_cfg, save_ops=SAVE_OPS)
    n = len(find_blocks(model))
    predicted = est.estimate(stack, ["full"] * n)
    peak, act = measure(model, ["full"] * n, stack)
    assert predicted.peak_bytes == pytest.approx(peak, rel=TOLERANCE)
    assert predicted.activation_bytes == pytest.approx(act, rel=TOLERANCE)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert predicted.weight_bytes == weights


MOE = {"qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16},
       "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}


@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_estimate_is_within_two_percent_of_the_measured_step(family):
    """Random routing (untrained router) against the estimator's: grouped_mm holds tokens x top-k expert rows
    however the router spreads them, so the prediction holds for any routing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.models import experts

    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                               **MOE[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    experts.apply(model, "train", "cpu", torch.float32)  # as a run holds it: grouped_mm, router loss on
    stack = Stack("fp32", 2, 1, False)
    est = Estimator(model.config, SEQ, PROFILES["cpu"], save_ops=SAVE_OPS)
    n = len(find_blocks(model))
    for kinds in (["none"] * n, ["full"] * n):
        predicted = est.estimate(stack, kinds)
        peak, act = measure(model, kinds, stack)
        assert predicted.peak_bytes == pytest.approx(peak, rel=0.02), kinds[0]
        assert predicted.activation_bytes == pytest.approx(act, rel=0.02), kinds[0]


def test_qwen3_30b_a3b_estimate_from_config_json_alone_with_lora_and_qlora_rows(tmp_path):
    """`memfit estimate` as a user types it, on the shipped 30B mixture-of-experts shape: total and active
    parameters (checked against the config's arithmetic), and LoRA / QLoRA rows; nothing is allocated."""
    import subprocess
    import sys

    shape = json.loads((REPO / "configs" / "models" / "qwen3-30b-a3b" / "config.json").read_text())
    v, h, n, e, mi = (shape[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
                                         "moe_intermediate_size"))
    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    attention = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd
    routed = e * (2 * mi * h + h * mi)
    total = 2 * v * h + h + n * (attention + routed + e * h + 2 * h)
    active = total - n * routed + n * routed * shape["num_experts_per_tok"] // e
    done = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", "configs/qwen3-30b-a3b-lora.yaml", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["params_total"], out["params_active"]) == (total, active)
    assert out["params_total"] == pytest.approx(30.5e9, rel=0.01) and out["params_active"] == pytest.approx(3.35e9,
                                                                                                          rel=0.01)
    assert out["experts"] == {"routed": 128, "per_token": 8}
    lora, qlora = out["adapter_rows"]
    assert (lora["stack"], qlora["stack"]) == ("LoRA", "QLoRA (NF4 base)")
    assert lora["peak_bytes"] == out["total_bytes"] and lora["n_trainable"] == qlora["n_trainable"] > 0
    # bitsandbytes quantizes Linear layers: attention shrinks to 4 bits, the fused 3-D expert weights do not.
    assert 0 < lora["weight_bytes"] - qlora["weight_bytes"] < 0.05 * lora["weight_bytes"]
    assert qlora["peak_bytes"] < lora["peak_bytes"]


UNLIKE_BLOCKS = {  # blocks that differ, or layer types that add state outside the blocks past the third layer
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4},
    "gemma3_text": {"head_dim": 16},
}


@pytest.mark.parametrize("family", ["qwen3_moe", *sorted(UNLIKE_BLOCKS)])
@pytest.mark.parametrize("device", ["cpu", "h100-80gb"])
def test_weights_and_optimizer_from_shallow_traces_equal_the_full_depth_trace(family, device):
    """Alike blocks: weights, gradients, optimizer state and the optimizer step's peak traced at depths 1-3 and
    extrapolated, byte for byte what the full-depth trace gives (foreach scratch on CUDA targets included);
    unlike blocks are traced at full depth."""
    from transformers import AutoConfig

    extra = UNLIKE_BLOCKS.get(family, {"num_key_value_heads": 2, **MOE["qwen3_moe"]})
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                               intermediate_size=128, **extra)
    stacks = [Stack("fp32", 1, 1, False), Stack("bf16-mixed", 1, 1, True),
              Stack("bf16-mixed", 1, 1, True, quantize="nf4")]
    for stack in stacks if family == "qwen3_moe" else stacks[:1]:
        est = Estimator(cfg, SEQ, PROFILES[device], lora_cfg=config.LoraConfig(enabled=True, r=4))
        assert est.uniform_blocks() == (family == "qwen3_moe")
        fast = est.static(stack)
        full = est._trace_static_at(est.n_blocks, est.resolved(stack))
        for field in ("before_opt", "after_opt", "opt_peak", "n_params", "n_trainable", "weight_bytes", "n_blocks"):
            assert getattr(fast, field) == getattr(full, field), (stack.label(), field)


def test_a_model_whose_own_forward_fails_is_one_line_naming_its_folder(tmp_path):
    """A DeepSeek-V3 config.json whose head_dim disagrees with qk_rope_head_dim: transformers' own forward raises
    on real tensors, and `memfit estimate` says so in one line (not the fake-tensor trace's traceback)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, DeepseekV3Config

    folder = tmp_path / "broken-dsv3"
    shape = DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                             q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=64,
                             n_group=1, topk_group=1, max_position_embeddings=256)
    shape.save_pretrained(folder)
    with pytest.raises(RuntimeError, match="must match the size"):  # the library itself, on real tensors
        AutoModelForCausalLM.from_config(shape)(input_ids=torch.zeros(1, 8, dtype=torch.long))
    done = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", "--set", f"model.name_or_path={folder}",
                           "--set", "model.preset=null"], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith(f"error: model.name_or_path: the model in {folder} fails in its own forward "
                               "(models/deepseek_v3/modeling_deepseek_v3.py, line "), lines[0]
    assert "RuntimeError: Attempting to broadcast a dimension" in lines[0]  # fake tensors word the same mismatch so
