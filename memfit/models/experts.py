"""Mixture-of-experts: the one place that picks the experts implementation per device, dtype and purpose."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memfit.errors import ConfigError

log = logging.getLogger("memfit.models")
Purpose = Literal["train", "export"]


@dataclass(frozen=True)
class ExpertsPolicy:
    """transformers 5 ships several experts implementations (transformers/integrations/moe.py); which runs where.

    Measured with torch 2.13 (CPU) and transformers 5.24 on tiny Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3:
    - grouped_mm: the CPU kernel runs fp32, bf16 and under bf16 autocast (transformers casts the input to the
      weights' dtype); its *meta* kernel (fake tensors: the estimator) accepts bf16 only, and torch.onnx cannot
      convert it. On CUDA the kernel itself is bf16 only (and needs SM80+).
    - eager: a Python loop over the experts hit; any dtype, but torch.export cannot trace its data-dependent loop.
    - batched_mm: gathers each token's expert weights (memory grows with tokens x top-k x expert size): the one
      torch.onnx exports, so exports only.
    """

    train_cpu: str = "grouped_mm"
    train_cuda_bf16: str = "grouped_mm"
    train_other: str = "eager"
    export: str = "batched_mm"

    def choose(self, purpose: Purpose, device_type: str, dtype: torch.dtype) -> str:
        if purpose == "export":
            return self.export
        if device_type == "cpu":
            return self.train_cpu
        if device_type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 8:
            return self.train_cuda_bf16
        return self.train_other


POLICY = ExpertsPolicy()


def is_moe(model: Any) -> bool:
    """Whether the model routes tokens to experts through transformers' experts interface."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return bool(can_set and can_set() and getattr(model.config, "_experts_implementation", None))


def keeps_padding_mask(config: Any) -> bool:
    """Pure: whether a padded row keeps its mask for this model (techniques/loss.blocks_batch drops it elsewhere: the
    padding is on the right, where no real token attends). An MoE's load-balancing loss counts only the real tokens
    by it (transformers' load_balancing_loss_func), and apply() turns the router logits on for training wherever
    the config has the switch."""
    return hasattr(config, "output_router_logits")


def apply(model: Any, purpose: Purpose, device_type: str = "cpu", dtype: torch.dtype | None = None) -> str | None:
    """Set the implementation POLICY picks on an MoE model (no-op on dense ones); the name set, or None."""
    if not is_moe(model):
        return None
    if purpose == "train" and hasattr(model.config, "output_router_logits"):
        # The router's load-balancing loss joins the loss as the model defines it (router_aux_loss_coef).
        model.config.output_router_logits = True
    dtype = dtype or next(model.parameters()).dtype
    choice = POLICY.choose(purpose, device_type, dtype)
    if model.config._experts_implementation != choice:
        try:
            model.set_experts_implementation(choice)
        except (ValueError, KeyError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"model.name_or_path: {type(model).__name__} cannot run its experts as {choice} "
                              f"for {purpose} on {device_type} in {dtype} ({first}); use train.precision "
                              "bf16-true, or another device") from None
        log.info("experts: %s for %s on %s (%s)", choice, purpose, device_type, dtype)
    return choice


@contextmanager
def for_export(model: Any) -> Iterator[None]:
    """An MoE model's experts as the ONNX exporter can trace them, then as they were."""
    before = model.get_experts_implementation() if is_moe(model) else None
    apply(model, "export")
    try:
        yield
    finally:
        if before is not None:
            model.set_experts_implementation(before)


@contextmanager
def traceable_experts() -> Iterator[None]:
    """grouped_mm on fake tensors through transformers' fallback op (its fake kernel takes every dtype).

    torch's meta kernel of aten._grouped_mm checks the CUDA kernel's rule (bf16 only) even for CPU tensors, so
    an fp32 or bf16-mixed step could not be traced; the fallback op computes the same output shape, saves the
    same inputs for backward, and is what transformers itself uses where grouped_mm cannot run.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from transformers.integrations import moe
    except ImportError:  # an older transformers without the experts interface: nothing to adapt
        yield
        return
    original = moe._can_use_grouped_mm

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        if isinstance(weight, FakeTensor) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def routing_stats(router_logits: Any, top_k: int) -> dict[str, float]:
    """Expert utilisation from the routers' logits: min and max share of routed tokens per expert (1/E balanced)."""
    layers = [r for r in (router_logits or ()) if isinstance(r, torch.Tensor) and r.dim() >= 2]
    if not layers:
        return {}
    with torch.no_grad():
        counts = None
        for logits in layers:
            chosen = logits.reshape(-1, logits.shape[-1]).topk(top_k, dim=-1).indices.reshape(-1)
            layer_counts = torch.bincount(chosen, minlength=logits.shape[-1]).double()
            counts = layer_counts if counts is None else counts + layer_counts
        share = counts / counts.sum()
    return {"experts_min_share": float(share.min()), "experts_max_share": float(share.max())}


def routed_experts(config: Any) -> tuple[int, int] | None:
    """(experts per MoE layer, experts each token is routed to) from a transformers config; None for a dense
    model. Families name them differently: num_experts (Qwen3-MoE), num_local_experts (Mixtral, gpt-oss),
    n_routed_experts (DeepSeek-V3); num_experts_per_tok everywhere."""
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, attr, None)
        if isinstance(n, int) and n > 1:
            return n, int(getattr(config, "num_experts_per_tok", 1) or 1)
    return None


def param_counts(named_numels: list[tuple[str, int]], experts: tuple[int, int] | None) -> dict[str, int]:
    """Pure: total parameters, and those one token uses (active): a routed expert's weights count top_k/E times.
    Routed experts are parameters under a module named exactly `experts` (shared experts, always active, are
    named otherwise: DeepSeek's shared_experts)."""
    total = sum(n for _, n in named_numels)
    routed = sum(n for name, n in named_numels if "experts" in name.split("."))
    if experts is None or routed == 0:
        return {"total": total, "active": total, "routed_experts": 0}
    n_experts, top_k = experts
    return {"total": total, "active": total - routed + routed * top_k // n_experts, "routed_experts": routed}


def model_param_counts(hf_config: Any, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Total and active parameters of the base model (a token uses top_k of E routed experts), from a meta-device
    build of its config (or the one given: the estimator's): shapes only, seconds even for a 30B mixture of
    experts."""
    from transformers import AutoModelForCausalLM

    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    experts = routed_experts(hf_config)
    counts = param_counts([(n, p.numel()) for n, p in model.named_parameters()], experts)
    return {"total": counts["total"], "active": counts["active"], "experts": experts}
