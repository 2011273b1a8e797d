"""Chunked loss, the AdamW variants and the optimizer step in backward: same numbers, clear refusals."""

from __future__ import annotations

import pytest
import torch
from memory_support import tiny

from memfit import config
from memfit.errors import ConfigError
from memfit.memory.techniques.loss import ChunkedLoss, PlainLoss, make_loss, resolve_loss

pytestmark = pytest.mark.unit


def _loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(arch):
    model = tiny(arch, layers=2)
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :7] = -100  # masked prompt tokens (chat data) are not learned
    labels[2, 30:] = -100
    batch = {"input_ids": ids, "labels": labels}
    plain, g_plain = _loss_and_grads(model, PlainLoss(), batch)
    # 120 tokens in chunks of 16: the last chunk is partial, and some chunks hold only ignored labels.
    chunked, g_chunked = _loss_and_grads(model, ChunkedLoss(chunk_tokens=16), batch)
    assert torch.allclose(chunked, plain, rtol=0, atol=1e-5), (float(chunked), float(plain))
    assert g_plain.keys() == g_chunked.keys() and len(g_plain) == len(list(model.parameters()))
    for name in g_plain:
        assert torch.allclose(g_chunked[name], g_plain[name], rtol=0, atol=1e-5), name
    with torch.no_grad():  # validation runs the same policy without the recompute
        assert torch.allclose(ChunkedLoss(16)(model, batch), plain, atol=1e-5)


def test_chunked_loss_never_holds_full_vocabulary_logits():
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, LlamaConfig

    vocab = 300  # unlike any other width of this model
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=4))
    ids = torch.randint(0, vocab, (2, 64))
    widest = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, tuple | list) else (out,)):
                if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == vocab:
                    widest.append(t.numel() // vocab)  # tokens of a [..., vocab] tensor
            return out

    with Shapes():
        ChunkedLoss(chunk_tokens=32)(model, {"input_ids": ids, "labels": ids}).backward()
    assert widest and max(widest) <= 32  # never more than one chunk of tokens wide, forward or backward
    with Shapes():
        widest.clear()
        PlainLoss()(model, {"input_ids": ids, "labels": ids}).backward()
    assert max(widest) == 128  # the plain loss does hold all 2 x 64 tokens' logits


def test_chunked_loss_backward_holds_one_fp32_chunk_of_logits():
    """The head's backward turns the recomputed logits into their gradient in place: one fp32 [chunk, vocab]
    buffer at a time, where autograd through log_softmax holds the log-probabilities and two gradients."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
    from memfit.memory.estimator.tracker import StepTracker

    vocab, chunk = 4096, 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    model.lm_head.weight.requires_grad_(False)  # frozen, as under LoRA: no weight gradient beside the logits
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker = StepTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        run_step(model, optimizer, [torch.randint(0, vocab, (2, 128))], "fp32", tracker, None, ChunkedLoss(chunk))
    head_backward = next(s for s in tracker.segments if s.label.endswith(".bpost"))
    one_chunk = chunk * vocab * 4
    assert one_chunk <= head_backward.peak["other"] < 1.5 * one_chunk, head_backward.peak["other"] / one_chunk


def test_chunked_loss_under_bf16_autocast_matches_the_plain_loss():
    model = tiny("llama", layers=1)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        plain, g_plain = _loss_and_grads(model, PlainLoss(), batch)
        chunked, g_chunked = _loss_and_grads(model, ChunkedLoss(chunk_tokens=16), batch)
    assert torch.allclose(chunked, plain, atol=1e-2), (float(chunked), float(plain))
    for name in g_plain:  # the same bf16 matmuls, summed in another order
        assert torch.allclose(g_chunked[name], g_plain[name], rtol=0.05, atol=2e-3), name


def test_auto_loss_chunks_large_vocabularies_in_one_process():
    assert resolve_loss("auto", 128_256) == "chunked"
    assert resolve_loss("auto", 512) == "plain"
    assert resolve_loss("auto", 128_256, world_size=2) == "plain"
    assert resolve_loss("plain", 128_256) == "plain"
    assert make_loss(config.from_dict({"memory": {"loss": "chunked", "loss_chunk_tokens": 64}})).chunk_tokens == 64
    auto = make_loss(config.from_dict({}))
    ids = torch.randint(0, 128, (1, 16))
    auto(tiny("llama", 1), {"input_ids": ids, "labels": ids})
    assert auto.chosen.name == "plain"  # a 128-entry vocabulary


def test_chunked_loss_with_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="memory.loss"):
        config.from_dict({"memory": {"loss": "chunked"}, "distributed": {"nproc_per_node": 2}})


# -- optimizers ------------------------------------------------------------------------------------------------
def _train_steps(kind: str, in_backward: bool, steps: int = 3):
    from memfit.memory.techniques.optim import StepInBackward, make_adamw

    model = tiny("llama", layers=2)
    opt = make_adamw(model, 1e-2, 0.01, kind=kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # the groups' lr changes per step
    hooks = StepInBackward(opt) if in_backward else None
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        PlainLoss()(model, {"input_ids": ids, "labels": ids}).backward()
        if hooks is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            assert all(p.grad is None for p in model.parameters())  # freed as soon as stepped
            hooks.finish()
        sched.step()
    return model, opt


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "adamw-8bit"])
def test_step_in_backward_is_bitwise_the_ordinary_step(kind):
    pytest.importorskip("bitsandbytes") if kind == "adamw-8bit" else None
    a, opt_a = _train_steps(kind, in_backward=False)
    b, opt_b = _train_steps(kind, in_backward=True)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # The state a training checkpoint holds is the same too (same keys, same tensors).
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert _same(sa, sb) and len(sa) == len(list(a.parameters()))


def _same(x, y) -> bool:
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    return x == y


def test_optimizer_variants_train_and_keep_their_state_kind():
    pytest.importorskip("bitsandbytes")
    plain, _ = _train_steps("adamw", False)
    fused, _ = _train_steps("adamw-fused", False)
    eight, opt8 = _train_steps("adamw-8bit", False)
    start = tiny("llama", layers=2)
    for p0, pa, pf, p8 in zip(start.parameters(), plain.parameters(), fused.parameters(), eight.parameters(),
                              strict=True):
        assert torch.allclose(pf, pa, atol=1e-5)  # the same AdamW, another kernel
        moved = (pa - p0).abs().max()
        assert (p8 - p0).abs().max() > 0.5 * moved  # 8-bit moves the weights as far
    big = max(opt8.state.values(), key=lambda st: st["state1"].numel())
    assert big["state1"].dtype == torch.uint8 and big["state2"].dtype == torch.uint8


def test_cpu_offload_optimizer_without_cuda_is_a_clear_error():
    from memfit.memory.techniques.optim import make_adamw, resolve_optimizer

    with pytest.raises(ConfigError, match=r"^memory.optimizer: adamw-cpu-offload .* CUDA"):
        make_adamw(tiny("llama", 1), 1e-3, 0.0, kind="adamw-cpu-offload")
    assert resolve_optimizer("auto", "cuda") == "adamw-fused"
    assert resolve_optimizer("auto", "cpu") == "adamw"  # the golden losses' numbers


@pytest.mark.parametrize(("extra", "named"), [
    ({"train": {"grad_accum_steps": 2}}, "train.grad_accum_steps"),
    ({"train": {"max_grad_norm": 1.0}}, "train.max_grad_norm"),
    ({"train": {"precision": "fp16-mixed"}}, "fp16-mixed"),
    ({"distributed": {"nproc_per_node": 2}}, "one process"),
])
def test_step_in_backward_refuses_what_needs_every_gradient_first(extra, named):
    base = {"train": {"max_grad_norm": None}, "memory": {"optimizer_in_backward": True}}
    for section, values in extra.items():
        base[section] = {**base.get(section, {}), **values}
    with pytest.raises(ConfigError, match="memory.optimizer_in_backward") as err:
        config.from_dict(base)
    assert named in str(err.value) and len(str(err.value).splitlines()) == 2  # the header and one line
    assert "got" not in str(err.value)  # not the whole config tree echoed back
    config.from_dict({"train": {"max_grad_norm": None}, "memory": {"optimizer_in_backward": True}})


# -- activation offload overlapped with compute (CUDA) ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_blocks_give_the_gradients_of_full_checkpointing_with_less_on_the_gpu(monkeypatch):
    from memfit.memory.techniques import activation_offload
    from memfit.memory.techniques.policies import apply_policy, make_policy

    def step(policy: str):
        model = tiny("llama", layers=4).cuda()
        apply_policy(model, make_policy(policy))
        ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(2)).cuda()
        with torch.no_grad():  # a forward without grad parks nothing (and leaves no empty block behind)
            model(input_ids=ids)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = PlainLoss()(model, {"input_ids": ids, "labels": ids})
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - base
        parked = [len(b) for b in activation_offload.offloader().blocks] if policy == "offload" else []
        loss.backward()
        return after_forward, {n: p.grad for n, p in model.named_parameters()}, parked

    # This test's own offloader (a gpu test before it may have left blocks in the process's one), and block inputs
    # parked whatever their size (the tiny model's are small).
    monkeypatch.setattr(activation_offload, "_OFFLOADER", None)
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 0)
    step("full")  # once first: one-off allocations (cuBLAS workspace) would otherwise count against the first run
    full_mem, full_grads, _ = step("full")
    off_mem, off_grads, parked = step("offload")
    # Each block's input hidden state (8 x 64 x 32 fp32, 64 KiB) waits in host memory: one per block.
    assert parked == [1, 1, 1, 1], parked
    assert full_mem - off_mem >= 4 * 8 * 64 * 32 * 4, (full_mem, off_mem)
    assert all(torch.equal(off_grads[n], full_grads[n]) for n in full_grads)


def test_chunked_loss_under_bf16_keeps_no_16_bit_copy_of_a_whole_chunk():
    """Under bf16 autocast the logits are computed in bf16 and held in fp32: the bf16 matmul fills the fp32
    buffer slice by slice, and backward makes its bf16 copy of the gradient slice by slice, so the head's
    backward peak stays near one fp32 chunk (a whole bf16 copy beside it would be 1.5 x)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
    from memfit.memory.estimator.tracker import StepTracker
    from memfit.memory.techniques.loss import SLICE_ROWS

    vocab, chunk = 4096, 8 * SLICE_ROWS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    model.lm_head.weight.requires_grad_(False)
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker = StepTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        run_step(model, optimizer, [torch.randint(0, vocab, (2, chunk))], "bf16-mixed", tracker, None,
                 ChunkedLoss(chunk))
    one_chunk = chunk * vocab * 4
    backward = next(s for s in tracker.segments if s.label.endswith(".bpost"))  # no blocks given: all of it
    assert one_chunk <= backward.peak["other"] < 1.2 * one_chunk, backward.peak["other"] / one_chunk
