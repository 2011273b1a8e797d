"""memory.lean_layers: the SwiGLU MLP and RMSNorm functions give the model's own numbers and save less."""

from __future__ import annotations

import copy

import pytest
import torch
from memory_support import tiny

from memfit.memory.techniques.lean_layers import apply_lean_layers

pytestmark = pytest.mark.unit


def _grads(model, batch, dtype=None):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=dtype, cache_enabled=False) if dtype else torch.enable_grad()
    with ctx:
        loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def _batch(seed=1, rows=3, seq=40):
    ids = torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_llama_layers_are_recognised_and_gpt2_left_as_it_is(caplog):
    assert apply_lean_layers(tiny("llama", layers=3)) == {"mlp": 3, "rmsnorm": 7}  # 2 per block + the final
    assert apply_lean_layers(tiny("gpt2", layers=2)) == {"mlp": 0, "rmsnorm": 0}  # GELU MLP, LayerNorm
    assert "nothing changed" in caplog.text


def test_fp32_loss_and_gradients_equal_the_models_own():
    model = tiny("llama", layers=2)
    lean = copy.deepcopy(model)
    apply_lean_layers(lean)
    batch = _batch()
    loss, grads = _grads(model, batch)
    lean_loss, lean_grads = _grads(lean, batch)
    assert torch.equal(lean_loss, loss)  # the forward runs the same ops
    assert grads.keys() == lean_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        assert torch.allclose(lean_grads[name], g, rtol=1e-5, atol=1e-7), name


def test_bf16_gradients_are_as_close_to_fp32_as_the_models_own():
    """In bf16 neither is exact: the lean backward rounds in other places, never further from the fp32 truth."""
    model = tiny("llama", layers=2)
    _, truth = _grads(copy.deepcopy(model), _batch(2))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    lean = copy.deepcopy(bf16)
    apply_lean_layers(lean)
    _, own = _grads(bf16, _batch(2), torch.bfloat16)
    _, mine = _grads(lean, _batch(2), torch.bfloat16)

    def error(grads):
        return sum(float((grads[n] - truth[n]).norm()) for n in truth) / sum(float(t.norm()) for t in truth.values())

    assert error(mine) < 1.25 * error(own) and error(mine) < 0.02, (error(mine), error(own))


def test_under_gradient_checkpointing_and_lora_the_gradients_are_the_same():
    from memfit.config import LoraConfig
    from memfit.memory.techniques.policies import make_policy
    from memfit.models.lora import prepare_lora_model

    model = prepare_lora_model(tiny("llama", layers=2), LoraConfig(enabled=True, r=4), "fp32", seed=0)
    lean = copy.deepcopy(model)
    apply_lean_layers(lean)
    for m in (model, lean):
        make_policy("full").apply(m)
    loss, grads = _grads(model, _batch(3))
    lean_loss, lean_grads = _grads(lean, _batch(3))
    assert torch.equal(lean_loss, loss) and grads and all("lora_" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(lean_grads[name], g, rtol=1e-5, atol=1e-7), name


def _saved_bytes(model, batch, dtype):
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        model(**batch).loss.backward()
    return sum(saved.values())


def test_bf16_saves_one_intermediate_per_mlp_and_the_norms_fp32_copies_less():
    """What backward keeps: without silu(gate) ([tokens, intermediate]) and without each norm's fp32 input copy."""
    model = tiny("llama", layers=2).to(torch.bfloat16)
    lean = copy.deepcopy(model)
    apply_lean_layers(lean)
    batch = _batch(4, rows=2, seq=32)
    tokens, inter, hidden = 2 * 32, model.config.intermediate_size, model.config.hidden_size
    saving = _saved_bytes(model, batch, torch.bfloat16) - _saved_bytes(lean, batch, torch.bfloat16)
    # per block: one bf16 intermediate; per norm (2 a block + the final one): fp32 copy (4 B) for at most bf16 (2 B)
    assert saving >= 2 * tokens * inter * 2 + 5 * tokens * hidden * 2, saving


def test_eval_runs_the_models_own_forward():
    model = tiny("llama", layers=2)
    lean = copy.deepcopy(model)
    apply_lean_layers(lean)
    batch = _batch(5)
    with torch.no_grad():
        assert torch.equal(lean(**batch).logits, model(**batch).logits)


def test_a_second_backward_through_the_overwritten_tensors_fails_loudly():
    """Backward writes the gradients into the saved projections; retain_graph would reuse them: refused."""
    model = tiny("llama", layers=1)
    apply_lean_layers(model)
    loss = model(**_batch(6)).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
