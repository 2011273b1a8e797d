"""The step-time clock: seconds per traced op on a device profile (roofline at achieved peaks, plus a launch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.config.devices import DeviceProfile
from memfit.memory.estimator.tracker import tensors_of

# Ops the trace dispatches that launch no kernel: metadata queries (the fake-tensor trace asks `prim.device` a few
# thousand times a step: charged as launches they were 62 ms of the chunked loss's 0.38 s on an H200), allocations
# without a fill, and views torch does not tag as views. Namespaces `prim` and `profiler` are metadata throughout.
NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten._unsafe_view.default", "aten.lift_fresh.default", "aten.detach_.default",
    "aten.set_.source_Storage_storage_offset", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
    "aten.sym_storage_offset.default", "aten.is_contiguous.default", "aten.is_same_size.default",
    "aten.is_nonzero.default", "aten.record_stream.default",
})
NO_KERNEL_NAMESPACES = ("prim.", "profiler.")

# Attention as a run on CUDA launches it (flash / memory-efficient kernels); the CPU trace dispatches the CPU
# flash kernel, which torch's FLOP registry does not list. Causal kernels skip the masked half of the scores.
_ATTENTION_FWD = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
                  "aten._scaled_dot_product_flash_attention.default",
                  "aten._scaled_dot_product_efficient_attention.default",
                  "aten._scaled_dot_product_cudnn_attention.default")
_ATTENTION_BWD = ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                  "aten._scaled_dot_product_flash_attention_backward.default",
                  "aten._scaled_dot_product_efficient_attention_backward.default",
                  "aten._scaled_dot_product_cudnn_attention_backward.default")


def attention_flops(name: str, args: tuple, kwargs: dict) -> int | None:
    """FLOPs of a fused attention op (None for any other op): the scores and the weighted sum (forward), the
    recomputed scores and four products (backward); half of them under a causal mask."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if name in _ATTENTION_FWD:
        q, k, v = args[:3]
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    elif name in _ATTENTION_BWD:
        grad, q, k, v = args[:4]
        flops = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
    else:
        return None
    causal = kwargs.get("is_causal")
    if causal is None:  # positional: after dropout_p in every variant's schema
        causal = any(a is True for a in args[3:8] if isinstance(a, bool))
    return flops // 2 if causal else flops


def op_cost_model(profile: DeviceProfile) -> Callable[[Any, tuple, dict, Any], float]:
    """Seconds per op on `profile`: FLOPs at the achieved matmul rate or bytes at the achieved bandwidth, whichever is
    longer (a roofline), plus the launch cost; nothing for ops that launch no kernel."""
    from torch.utils.flop_counter import flop_registry

    flop_rate = profile.matmul_efficiency
    byte_rate = profile.bandwidth * profile.bandwidth_efficiency

    kinds: dict[Any, tuple[str, Any] | None] = {}  # per op: None (no kernel), or its name and FLOP formula

    def op_seconds(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        if func not in kinds:  # what an op is does not change from call to call: worked out once a trace
            name = str(func)
            no_kernel = getattr(func, "is_view", False) or name in NO_KERNEL or name.startswith(NO_KERNEL_NAMESPACES)
            kinds[func] = None if no_kernel else (name, flop_registry.get(func.overloadpacket))
        kind = kinds[func]
        if kind is None:
            return 0.0
        name, formula = kind
        flops = attention_flops(name, args, kwargs)
        if flops is None:
            flops = 0
            if formula is not None:
                try:
                    flops = formula(*args, **kwargs, out_val=out)
                except Exception:  # noqa: BLE001 - a formula that does not cover an overload: count its bytes only
                    flops = 0
        ts = tensors_of(args, kwargs, out)
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        dtype = str(ts[0].dtype).removeprefix("torch.") if ts else "float32"
        return max(flops / (profile.flops_per_s(dtype) * flop_rate), nbytes / byte_rate) + profile.op_overhead_s

    return op_seconds


def host_copy_seconds(profile: DeviceProfile) -> Callable[[int], float]:
    """Seconds to move `nbytes` across the host link (an offloaded activation, one way). The copies run on side
    streams, yet the H200's offload step took what its copies take on top of full recompute (FACTS.md): charged
    in full."""
    rate = profile.host_bandwidth or profile.bandwidth

    def seconds(nbytes: int) -> float:
        return nbytes / rate

    return seconds


def emulated_step_seconds(kind: str, params: list[tuple[int, int]], profile: DeviceProfile) -> float:
    """A step of an AdamW variant the trace only emulates (EmulatedAdamW: its kernels cannot run on fake tensors, so
    the trace charges nothing) over trainable `params` (numel, bytes per value). adamw-8bit: one memory-bound pass a
    parameter (it read and written, its gradient read, two 8-bit moments read and written) and a launch;
    adamw-cpu-offload: each gradient to the host and each parameter back across the host link (the host's own AdamW
    overlaps those copies: not charged). Not measured on a GPU yet (the 2026-12-04 H200 run had neither)."""
    if kind == "adamw-8bit":
        rate = profile.bandwidth * profile.bandwidth_efficiency
        return sum((3 * size + 4) * n / rate + profile.op_overhead_s for n, size in params)
    if kind == "adamw-cpu-offload":
        return host_copy_seconds(profile)(sum(2 * n * size for n, size in params))
    return 0.0
