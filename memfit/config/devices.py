"""Target device profiles: memory, what the runtime keeps for itself, and speed for the step-time model."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from memfit.errors import ConfigError

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator as the planner sees it. Speeds are dense vendor figures (no sparsity)."""

    name: str
    kind: str  # "cuda" or "cpu"
    memory_bytes: int  # what nvidia-smi reports as total
    reserved_bytes: int  # CUDA context, cuBLAS/cuDNN workspaces: outside PyTorch's tensors
    matmul_flops: dict[str, float]  # peak FLOP/s by compute dtype
    bandwidth: float  # bytes/s of device memory
    op_overhead_s: float  # fixed cost per dispatched op (kernel launch, Python)
    bf16: bool
    # The step-time clock (memory/estimator/clock.py): the host link (PCIe) that offloaded activations cross, and
    # the fractions of the peaks a training step's kernels reach (calibrated against measured steps; FACTS.md).
    host_bandwidth: float = 0.0  # bytes/s between device and pinned host memory; 0: none (a CPU target)
    matmul_efficiency: float = 1.0  # achieved / peak FLOP/s of the step's matmuls and attention
    bandwidth_efficiency: float = 1.0  # achieved / peak bytes/s of its memory-bound kernels

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    def flops_per_s(self, dtype: str) -> float:
        return self.matmul_flops.get(dtype) or self.matmul_flops["float32"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["usable_bytes"] = self.usable_bytes
        return d


# Achieved fractions of the vendor peaks, calibrated on an H200 (FACTS.md "GPU, measured 2026-12-04": 1B and 8B
# Llama steps, tests/unit/test_step_clock.py holds them): the step's bf16 GEMMs at 0.7 of the dense peak, its
# elementwise kernels at 0.75 of HBM bandwidth put all six rows within 5 % and their ratios within 7 % (a grid
# over 0.6-0.75 / 0.6-0.8). The other GPUs share them (same kernels, not measured there).
GPU_MATMUL_EFFICIENCY, GPU_BANDWIDTH_EFFICIENCY = 0.7, 0.75


def _gpu(name: str, mib: int, bf16_tflops: float, fp16_tflops: float, fp32_tflops: float, tb_s: float,
         host_gb_s: float, bf16: bool = True) -> DeviceProfile:
    # fp32 matmuls run as TF32 by default only when allowed; memfit leaves the default (full fp32).
    return DeviceProfile(name=name, kind="cuda", memory_bytes=mib * MIB, reserved_bytes=GIB,
                         matmul_flops={"bfloat16": bf16_tflops * 1e12, "float16": fp16_tflops * 1e12,
                                       "float32": fp32_tflops * 1e12},
                         bandwidth=tb_s * 1e12, op_overhead_s=6e-6, bf16=bf16, host_bandwidth=host_gb_s * 1e9,
                         matmul_efficiency=GPU_MATMUL_EFFICIENCY, bandwidth_efficiency=GPU_BANDWIDTH_EFFICIENCY)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    # Host link: PCIe 4.0 x16 (32 GB/s a direction), 5.0 x16 (64), 3.0 x16 (16): the SXM parts' too.
    _gpu("a100-40gb", 40960, 312, 312, 19.5, 1.555, 32),
    _gpu("a100-80gb", 81920, 312, 312, 19.5, 2.039, 32),
    _gpu("h100-80gb", 81559, 989, 989, 67, 3.35, 64),
    _gpu("h200", 143771, 989, 989, 67, 4.8, 64),
    _gpu("l4", 23034, 121, 121, 30, 0.3, 32),
    _gpu("l40s", 46068, 362, 362, 91.6, 0.864, 32),
    _gpu("rtx-4090", 24564, 165, 165, 82.6, 1.008, 32),
    _gpu("t4", 15360, 65, 65, 8.1, 0.32, 16, bf16=False),
    # This machine kind (2 AVX-512 cores): measured orders of magnitude; memory is the host's RAM.
    DeviceProfile(name="cpu", kind="cpu", memory_bytes=24 * GIB, reserved_bytes=2 * GIB,
                  matmul_flops={"float32": 1.5e11, "bfloat16": 1.5e11, "float16": 0.3e11},
                  bandwidth=3e10, op_overhead_s=1e-5, bf16=True),
)}

_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "4090": "rtx-4090", "rtx4090": "rtx-4090",
            "h200-141gb": "h200", "l4-24gb": "l4", "t4-16gb": "t4"}


def normalise_device_name(name: str, field: str = "--device") -> str:
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = _ALIASES.get(key, key)
    if key not in PROFILES:
        raise ConfigError(f"{field}: unknown device {name!r}; choose one of {', '.join(PROFILES)} "
                          "(or set memory.budget_gb)")
    return key


def get_profile(name: str, field: str = "--device") -> DeviceProfile:
    return PROFILES[normalise_device_name(name, field)]


def cpu_profile(memory_bytes: int | None = None) -> DeviceProfile:
    """The CPU profile, with this host's RAM when known."""
    base = PROFILES["cpu"]
    if memory_bytes is None:
        return base
    return DeviceProfile(**{**asdict(base), "memory_bytes": int(memory_bytes)})


def profile_for_report(device: dict[str, Any]) -> DeviceProfile:
    """The closest profile for a device the environment report describes (speeds of the nearest match)."""
    if device.get("type") != "cuda":
        return cpu_profile(device.get("memory_total_bytes"))
    name = str(device.get("name", "")).lower()
    best = None
    # Whole words of the CUDA name ("NVIDIA L40S" is not an L4): the most specific key first.
    words = set(name.replace("-", " ").split())
    for key, hint in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb"), ("l40s", "l40s"),
                      ("l4", "l4"), ("4090", "rtx-4090"), ("t4", "t4")):
        if key in words:
            best = PROFILES[hint]
            break
    base = best or PROFILES["a100-80gb"]
    total = int(device.get("memory_total_bytes") or base.memory_bytes)
    return DeviceProfile(**{**asdict(base), "name": name or base.name, "memory_bytes": total,
                            "bf16": bool(device.get("bf16_supported", base.bf16))})
