"""LoRA through peft: with checkpointing on, only adapters train and their gradients are non-zero."""

from __future__ import annotations

import pytest
import torch
from memory_support import SAVE_OPS, VOCAB, tiny

from memfit.config import LoraConfig, from_dict
from memfit.errors import ConfigError
from memfit.memory.estimator.step import make_optimizer, run_step
from memfit.memory.techniques.policies import apply_policy, make_policy
from memfit.models.lora import apply_lora, is_lora_state, merge_lora

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch, policy", [("llama", "full"), ("gpt2", "full"), ("llama", "selective")])
def test_lora_with_checkpointing_trains_only_adapters(arch, policy):
    model = apply_lora(tiny(arch), LoraConfig(r=4, alpha=8))
    apply_policy(model, make_policy(policy, save_ops=SAVE_OPS))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = make_optimizer(model)
    optimizer.param_groups[0]["lr"] = optimizer.param_groups[1]["lr"] = 1e-2
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    for step in range(2):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        # lora_B starts at zero, so lora_A's first gradient is zero; after one step both are non-zero.
        b_norm = sum(float(g.abs().sum()) for n, g in grads.items() if ".lora_B." in n)
        a_norm = sum(float(g.abs().sum()) for n, g in grads.items() if ".lora_A." in n)
        assert b_norm > 0
        if step == 1:
            assert a_norm > 0
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), n


def test_merge_folds_adapters_into_the_plain_model():
    model = apply_lora(tiny("llama", layers=2), LoraConfig(r=4, alpha=8))
    optimizer = make_optimizer(model)
    optimizer.param_groups[0]["lr"] = 5e-2
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        run_step(model, optimizer, [batch], "fp32")
    assert is_lora_state(model.state_dict())
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=batch).logits
    merged = merge_lora(model)
    assert type(merged).__name__ == "LlamaForCausalLM" and not is_lora_state(merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=batch).logits, adapted, atol=1e-5)


def test_lora_targets_matching_nothing_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"lora.target_modules.*q_proj"):
        apply_lora(tiny("llama", layers=1), LoraConfig(target_modules=["no_such_proj"]))
    with pytest.raises(ConfigError, match="lora.target_modules"):
        from_dict({"lora": {"target_modules": []}})
    with pytest.raises(ConfigError, match="lora.r"):
        from_dict({"lora": {"r": 0}})


def test_qlora_gradients_do_not_change_after_an_evaluation():
    """An eval forward (the initial validation loss) must not change what training computes. bitsandbytes 0.50,
    on a CPU with AVX512-BF16, repacks the 4-bit codes at the first eval forward for a kernel with no backward:
    the adapters below a 4-bit layer then got no gradient through it, and a training checkpoint's save (which
    unpacks them) changed the numerics: a QLoRA resume was not bitwise on such a CPU."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.lora import prepare_lora_model

    torch.manual_seed(0)  # every projection 64 wide: bitsandbytes' packed CPU kernel takes these shapes
    base = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=4, max_position_embeddings=64))
    model = prepare_lora_model(base, LoraConfig(enabled=True, r=4, alpha=8, quantize="nf4"), "bf16-mixed")
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))

    def adapter_grads() -> dict[str, torch.Tensor]:
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}

    with torch.no_grad():  # lora_B starts at zero: one nudge so that lora_A's gradient is not zero either
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.add_(0.01)
    before = adapter_grads()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=batch)
    after = adapter_grads()
    assert before.keys() == after.keys() and any(".layers.0." in n and ".lora_A." in n for n in before)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"an evaluation changed the adapters' gradients: {changed[:4]}"
