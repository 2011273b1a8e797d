"""The environment report (hardware, memory, disk, library versions: one JSON-able dict); threads and heap."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

_LIBRARIES = ("torch", "transformers", "peft", "accelerate", "safetensors", "onnx", "onnxruntime",
              "onnxscript", "prefect", "mlflow", "boto3", "datasets", "tokenizers", "pydantic")


# Environment variables that change how a run behaves; shown in the report, secrets masked.
_ENV_PREFIXES = ("CUDA_", "NCCL_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_",
                 "TOKENIZERS_", "MLFLOW_", "PREFECT_", "AWS_", "MEMFIT_", "NVIDIA_")


def relevant_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The run-relevant environment variables, with credentials masked (names and values both checked)."""
    from memfit.tracking.base import REDACTED, is_secret_key, scrub

    env = dict(os.environ if environ is None else environ)
    return {k: (REDACTED if is_secret_key(k) else scrub(v, env)) for k, v in sorted(env.items())
            if k.startswith(_ENV_PREFIXES)}


def package_version(name: str) -> str | None:
    """The installed version of distribution `name`; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    return {name: package_version(name) for name in _LIBRARIES}


def resolve_device(requested: str = "auto") -> torch.device:
    """`auto` → the first CUDA device when there is one, else CPU; `cuda` without a GPU is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        from memfit.errors import ConfigError

        raise ConfigError("train.device: 'cuda' requested but no CUDA device is visible; "
                          "use train.device=auto or cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cpu_bf16() -> bool:
    # CPU autocast accepts bf16 everywhere, but only chips with avx512_bf16/amx run it fast.
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_report(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "index": device.index,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_total_bytes": int(total),
            "memory_free_bytes": int(free),
            # Native bf16 only (Ampere+): pre-Ampere GPUs emulate it, far too slowly to train in.
            "bf16_supported": bool(torch.cuda.is_bf16_supported(including_emulation=False)),
        }
    vm = psutil.virtual_memory()
    return {
        "type": "cpu",
        "name": platform.processor() or platform.machine(),
        "index": None,
        "count": 1,
        "capability": None,
        "memory_total_bytes": int(vm.total),
        "memory_free_bytes": int(vm.available),
        "bf16_supported": _cpu_bf16(),
    }


def environment_report(device: torch.device, disk_path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """What is here: the device used for training, every visible GPU, CPU RAM, disk and versions."""
    vm = psutil.virtual_memory()
    probe_dir = Path(disk_path)
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    disk = shutil.disk_usage(probe_dir)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_total_bytes": int(p.total_memory)})
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": gpus,
        "device": device_report(device),
        "cpu_ram_total_bytes": int(vm.total),
        "cpu_ram_available_bytes": int(vm.available),
        "disk_path": str(probe_dir.resolve()),
        "disk_free_bytes": int(disk.free),
        "libraries": library_versions(),
        "environment_variables": relevant_environment(),
    }


def default_threads(processes: int = 1) -> int:
    """OMP_NUM_THREADS when it is set (torchrun, a batch scheduler or a test runner sharing out the cores),
    else an even share of the cores among `processes` (the ranks of this node), at most 4."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, min(4, (os.cpu_count() or 1) // max(1, processes)))


def pin_threads(num_threads: int | None) -> int:
    """Pin torch's CPU threads: a thread-count change alone changes float sums (FACTS: 4e-6)."""
    n = num_threads or default_threads()
    torch.set_num_threads(n)
    return n


# -- glibc's heap while the loop trains ---------------------------------------------------------------
# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's default trim threshold, put back after training: a process that goes on (serving, exporting, a notebook)
# gives its free memory back as before.
DEFAULT_TRIM_THRESHOLD = 128 * 1024
# The most glibc accepts, and where its own sliding threshold stops on 64-bit: a tensor up to this size comes from
# the heap rather than from an mmap that is unmapped when freed and faulted in again at the next step.
MMAP_THRESHOLD = 32 * 1024 * 1024
KEEP_ALL = 2**31 - 1  # no trimming at all: what one step freed, the next step allocates again


def _glibc() -> Any | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt does nothing, macOS has none
        return libc
    except (OSError, AttributeError):
        return None


def keep_heap() -> Callable[[], None]:
    """Stop glibc trimming its heap until the returned function is called (a no-op without glibc).

    A step frees megabytes of tensors at its end. glibc hands the top of its heap back to the kernel whenever more
    than its trim threshold is free there (twice its sliding mmap threshold, so about twice the largest tensor
    freed so far), and the next step faults every page in again, zeroed by the kernel; with two torch threads
    each shrink also has the other core's TLB flushed. Whether a step's end leaves the heap's top free depends only on
    where long-lived allocations happen to sit, so two processes running the same step differ: on the tiny
    model 1060 page faults a step in memfit's against 340 in a bare loop's (docs/monitoring.md). Process-wide, like
    torch.set_num_threads; it moves no float. The returned function gives the free memory back (malloc_trim) and
    puts glibc's default trim threshold back; the mmap threshold stays at glibc's own ceiling.
    """
    libc = _glibc()
    if libc is None:
        return lambda: None
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_ALL)

    def release() -> None:
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)

    return release
