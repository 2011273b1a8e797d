"""memory.loss fused: Liger's chunk size, its plain-torch twin against plain cross-entropy, the fallbacks' one line."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from memory_support import tiny

from memfit import config
from memfit.errors import ConfigError
from memfit.memory.techniques import fused_loss
from memfit.memory.techniques.fused_loss import fused_unavailable, liger_chunk_rows
from memfit.memory.techniques.loss import FusedLoss, PlainLoss, loss_by_name, make_loss, resolve_loss


def test_the_chunk_is_sized_as_liger_sizes_it():
    # Llama-3.2-1B's head at 4 x 2048 tokens: ceil(128256 / 2048) = 63 chunks' worth -> 131 rows -> 256.
    assert liger_chunk_rows(8192, 2048, 128256) == 256
    assert liger_chunk_rows(100, 64, 64) == 100  # one chunk covers every token when the vocabulary is small
    assert liger_chunk_rows(48, 64, 4096) == 1


def _loss_and_grads(loss_fn, labels_masked: bool = False):
    model = tiny("llama", layers=2)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    if labels_masked:
        labels[:, :5] = -100  # a prompt whose tokens train nothing
    loss = loss_fn(model, {"input_ids": ids, "labels": labels})
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("masked", [False, True])
def test_the_twin_gives_plain_cross_entropys_loss_and_gradients(masked):
    plain, plain_grads = _loss_and_grads(PlainLoss(), masked)
    fused, fused_grads = _loss_and_grads(FusedLoss(emulate=True), masked)
    assert fused == pytest.approx(plain.item(), rel=1e-6)
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_off_cuda_says_why_in_one_line_and_runs_the_next_best(caplog):
    loss = FusedLoss()
    with caplog.at_level(logging.WARNING, logger="memfit.memory.techniques.loss"):
        first, grads = _loss_and_grads(loss)
        _loss_and_grads(loss)  # said once, not every step
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["memory.loss: fused runs Liger's Triton kernel on CUDA only; this run is on cpu: "
                     "the plain loss instead"]  # the tiny vocabulary: plain is what auto would take
    plain, plain_grads = _loss_and_grads(PlainLoss())
    assert first == plain and all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_fused_without_liger_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    assert fused_unavailable("cuda") == ("memory.loss: fused needs liger-kernel (pip install 'memfit[gpu]', or pip "
                                         "install liger-kernel)")
    assert fused_unavailable("cpu").endswith("on CUDA only; this run is on cpu")


@pytest.mark.parametrize(("liger", "device", "expected"), [
    (True, "cuda", "fused"), (False, "cuda", "chunked"), (True, "cpu", "chunked")])
def test_auto_takes_fused_only_on_cuda_with_liger_installed(monkeypatch, liger, device, expected):
    monkeypatch.setattr(fused_loss, "fused_unavailable",
                        lambda d: None if (liger and d == "cuda") else "memory.loss: fused cannot run here")
    assert resolve_loss("auto", 128256, 1, device) == expected
    assert resolve_loss("auto", 384, 1, device) == "plain"  # a small vocabulary: plain logits are cheap
    assert resolve_loss("auto", 128256, 2, device) == "plain"  # several ranks: the model's own forward


def test_fused_set_for_a_cpu_run_resolves_to_the_next_best_and_is_refused_across_ranks():
    assert resolve_loss("fused", 128256, 1, "cpu") == "chunked"
    assert resolve_loss("fused", 128256, 1, "cuda") == "fused"  # an estimate for a CUDA target keeps it
    assert isinstance(make_loss(config.from_dict({"memory": {"loss": "fused"}})), FusedLoss)
    assert isinstance(loss_by_name("fused", emulate=True), FusedLoss)
    with pytest.raises(ConfigError, match="memory.loss: fused runs in one process only"):
        config.from_dict({"memory": {"loss": "fused"}, "distributed": {"nproc_per_node": 2}})


# -- on CUDA with liger-kernel: the real kernel -------------------------------------------------------------------
def _cuda_step(loss_fn, vocab: int, precision_bf16: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(cfg).cuda().train()
    ids = torch.randint(0, vocab, (4, 512), generator=torch.Generator().manual_seed(3)).cuda()
    labels = ids.clone()
    labels[:, :100] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision_bf16):
        loss = loss_fn(model, {"input_ids": ids, "labels": labels})
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_gives_plain_cross_entropys_loss_and_gradients_and_its_twins_peak():
    pytest.importorskip("liger_kernel")
    plain, plain_grads, plain_peak = _cuda_step(PlainLoss(), 32000, False)
    fused, fused_grads, _ = _cuda_step(FusedLoss(), 32000, False)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-4)
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-3, atol=1e-5, msg=name)
    # bf16 autocast, as memfit trains: the loss agrees to bf16's precision, and the twin the estimator traces
    # allocates what the kernel does (within 10 %), well under the plain loss's full logits.
    plain16, _, plain16_peak = _cuda_step(PlainLoss(), 32000, True)
    liger16, _, liger16_peak = _cuda_step(FusedLoss(), 32000, True)
    _, _, twin16_peak = _cuda_step(FusedLoss(emulate=True), 32000, True)
    assert liger16.item() == pytest.approx(plain16.item(), rel=2e-2)
    assert twin16_peak == pytest.approx(liger16_peak, rel=0.10), (twin16_peak, liger16_peak)
    assert liger16_peak < plain16_peak and plain_peak > 0
