"""Gradient-checkpointing policies: same loss and gradients as none, less activation memory, clear errors."""

from __future__ import annotations

import pytest
import torch
from memory_support import SAVE_OPS, VOCAB, tiny
from torch import nn

from memfit.errors import ConfigError
from memfit.memory.estimator.step import run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.techniques.policies import (
    EveryKCheckpointing,
    apply_policy,
    find_blocks,
    make_policy,
    mixed_kinds,
    remove_checkpointing,
    spread,
)

pytestmark = pytest.mark.unit
SEQ = 32


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


POLICIES = [("full", {}), ("every_k", {"every_k": 2}), ("selective", {"save_ops": SAVE_OPS}),
            ("mixed", {"kinds": ["full", "selective", "none", "full"], "save_ops": SAVE_OPS})]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_policy_gives_the_loss_and_gradients_of_none(arch):
    model = tiny(arch)
    batch = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    apply_policy(model, make_policy("none"))
    ref_loss, ref_grads = loss_and_grads(model, batch)
    for name, kw in POLICIES:
        apply_policy(model, make_policy(name, **kw))
        assert any(getattr(b, "gradient_checkpointing", False) for b in find_blocks(model)), name
        loss, grads = loss_and_grads(model, batch)
        assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6), (name, loss, ref_loss)
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6), (name, n)
    remove_checkpointing(model)
    assert not any(getattr(b, "gradient_checkpointing", False) for b in find_blocks(model))
    assert model.config.use_cache is True


def activation_bytes(model, kinds) -> int:
    """Activations alive at the end of the forward, from the tracker on real tensors."""
    from memfit.memory.techniques.policies import assign_blocks

    assign_blocks(model, kinds, save_ops=SAVE_OPS)
    batch = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))
    tracker = StepTracker(find_blocks(model))
    tracker.track_external(model)
    with tracker:
        run_step(model, None, [batch], "fp32", tracker)
    return next(s.end["activations"] for s in tracker.segments if s.label == "m0.fpost")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_activation_bytes_order_none_every2_full_with_selective_between(arch):
    model = tiny(arch)
    n = len(find_blocks(model))
    none = activation_bytes(model, ["none"] * n)
    every2 = activation_bytes(model, EveryKCheckpointing(k=2).block_kinds(n))
    full = activation_bytes(model, ["full"] * n)
    selective = activation_bytes(model, ["selective"] * n)
    assert none > every2 > full
    assert none > selective > full
    # Recomputing every block keeps only block inputs: a small fraction of what plain training keeps.
    assert full < 0.35 * none


def test_every_k_and_mixed_spread_evenly():
    assert EveryKCheckpointing(k=3).block_kinds(8) == ["full", "none", "none", "full", "none", "none", "full", "none"]
    assert spread(3, 8) == [0, 2, 5] and spread(0, 8) == [] and spread(9, 4) == [0, 1, 2, 3]
    kinds = mixed_kinds(8, {"full": 2, "selective": 3, "none": 3})
    assert kinds.count("full") == 2 and kinds.count("selective") == 3 and kinds.count("none") == 3
    assert kinds[0] == "full" and kinds[4] == "full"  # the recompute-heaviest kind spread over the stack
    with pytest.raises(ConfigError, match="memory.every_k"):
        EveryKCheckpointing(k=0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) + x


class Custom(nn.Module):
    """A model transformers knows nothing about: blocks found through memory.block_class."""

    def __init__(self):
        super().__init__()
        self.stack = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.stack:
            x = b(x)
        return self.head(x).sum()


def test_configurable_block_class_checkpoints_any_model():
    torch.manual_seed(0)
    model, x = Custom(), torch.randn(4, 8)
    model(x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apply_policy(model, make_policy("full", block_class="Block"))
    for b in model.stack:
        b.calls = 0
    model(x).backward()
    assert [b.calls for b in model.stack] == [2, 2, 2]  # forward + recompute in backward
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n
    apply_policy(model, make_policy("none", block_class="Block"))
    for b in model.stack:
        b.calls = 0
    model(x).backward()
    assert [b.calls for b in model.stack] == [1, 1, 1]


def test_offload_applies_before_the_move_to_the_gpu_but_never_runs_on_cpu(monkeypatch):
    # The trainer moves the model to the GPU after the policy is applied: a CPU model passes where CUDA
    # exists, and a block that still runs on the CPU is refused when it runs, with the same clear error.
    model = tiny("llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    apply_policy(model, make_policy("offload"))
    model.train()
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        model(input_ids=torch.randint(0, VOCAB, (2, 8)), labels=torch.randint(0, VOCAB, (2, 8)))


def test_weights_that_do_not_fit_become_an_oom_reading(monkeypatch):
    from memfit.memory.estimator.probe import weights_to_device

    class Huge(nn.Module):
        def to(self, *args, **kwargs):
            if args and str(args[0]) != "cpu":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
            return self

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    step = weights_to_device(Huge(), torch.device("cuda"))
    assert step is not None and step.oom and step.peak_bytes == 123
    assert step.error.startswith("the weights alone do not fit on cuda: CUDA out of memory")
    assert weights_to_device(nn.Linear(2, 2), torch.device("cpu")) is None


def test_block_class_not_found_and_offload_on_cpu_are_clear_errors():
    model = tiny("llama", layers=2)
    with pytest.raises(ConfigError, match="memory.block_class.*NoSuchLayer.*LlamaDecoderLayer"):
        apply_policy(model, make_policy("full", block_class="NoSuchLayer"))
    with pytest.raises(ConfigError, match="memory.policy.*CUDA"):
        apply_policy(model, make_policy("offload"))
    with pytest.raises(ConfigError, match="memory.policy.*unknown policy"):
        make_policy("sometimes")
    with pytest.raises(ConfigError, match="memory.selective_save_ops"):
        apply_policy(model, make_policy("selective", save_ops=("not_an_op",)))
    with pytest.raises(ConfigError, match="memory.block_class"):
        apply_policy(Custom(), make_policy("full"))
