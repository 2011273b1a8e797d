"""GPU-only paths on one CUDA device (skipped without one): allocator probe, a real OOM, offload, bf16 + resume."""

from __future__ import annotations

import pytest
import torch

from memfit import phases, run_context

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(cfg):
    report = phases.check_environment_and_probe(cfg)
    plan = phases.plan_stack(cfg, report)
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), report)


def test_probe_measures_with_the_allocator_against_the_free_memory(tiny_config):
    report = phases.check_environment_and_probe(tiny_config(**{"train.device": "cuda"}))
    b, dev = report.baseline, report.environment["device"]
    assert dev["type"] == "cuda" and b["method"] == "cuda.max_memory_allocated"
    assert b["budget_source"].startswith("free memory of")
    # The free memory is read before the probe puts its weights on the device: the budget includes them.
    assert b["fits"] and 0 < b["peak_bytes"] <= b["budget_bytes"] <= dev["memory_total_bytes"]


def test_a_real_cuda_oom_is_a_verdict_with_the_estimators_breakdown(tiny_config):
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # 32 MiB for this process's allocator: the tiny weights fit, a step at 512 x 64 tokens does not.
    torch.cuda.set_per_process_memory_fraction(32 * 2**20 / total)
    try:
        report = phases.check_environment_and_probe(tiny_config(**{"train.device": "cuda", "train.batch_size": 512,
                                               "train.grad_accum_steps": 1}))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    b = report.baseline
    assert b["oom"] is True and b["fits"] is False
    assert b["message"].startswith("OOM") and "estimator" in b["message"]


def test_offload_gives_the_loss_and_gradients_of_none(tiny_config):
    from memfit.memory.techniques.policies import make_policy

    cfg = tiny_config(**{"train.device": "cuda"})
    model = run_context.load_inputs(cfg).model.cuda()
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def step(policy: str):
        make_policy(policy).apply(model)
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in both runs
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    loss_none, grads_none = step("none")
    loss_off, grads_off = step("offload")
    assert torch.allclose(loss_none, loss_off, atol=1e-6)
    for name, g in grads_none.items():
        assert torch.allclose(g, grads_off[name], rtol=1e-4, atol=1e-6), name


def test_bf16_mixed_trains_on_cuda_and_resumes(tiny_config, tmp_path):
    common = {"train.device": "cuda", "train.precision": "bf16-mixed", "tracking.backend": "null",
              "checkpoint.every_steps": 10, "checkpoint.uri": str(tmp_path / "ckpt")}
    first = _train(tiny_config(**common, **{"train.max_steps": 20}))
    assert first.steps == 20 and first.final_train_loss < first.initial_val_loss - 1.0
    assert first.peak_memory_bytes > 0  # the allocator's peak, not the host's RSS
    # A longer run resumes from the step-20 training checkpoint (CUDA RNG state included) and finishes.
    second = _train(tiny_config(**common, **{"train.max_steps": 24}))
    assert second.resumed_from == 20 and second.steps == 24


def test_a_cuda_run_logs_tflops_and_mfu_against_the_device_peak(tiny_config):
    MlflowClient = pytest.importorskip("mlflow").MlflowClient  # noqa: N806  the metrics are read back from MLflow

    cfg = tiny_config(**{"train.device": "cuda", "train.precision": "bf16-mixed", "train.max_steps": 8,
                         "train.log_every_steps": 2})
    result = _train(cfg)
    client = MlflowClient(cfg.tracking.resolved_uri())
    metrics = client.get_run(result.mlflow_run_id).data.metrics
    from memfit.config.devices import profile_for_report

    peak = profile_for_report({"type": "cuda", "name": torch.cuda.get_device_name()}).flops_per_s("bfloat16")
    assert metrics["tflops"] > 0 and 0 < metrics["mfu"] < 1
    assert metrics["mfu"] == pytest.approx(metrics["tflops"] * 1e12 / peak)  # the last logged step's
