"""A tensor-memory tracker for one training step, on real or fake tensors, cut into per-block segments."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch import nn
from torch.utils._pytree import tree_flatten


def import_tools_module(name: str) -> types.ModuleType:
    """`torch.distributed._tools.<name>` without the package's __init__, which imports every tool of the
    package, the runtime estimator with torch._inductor among them: ≈ 1.3 s of CPU before each run's first step
    for modules memfit never uses (measured on 2 cores). A bare package object stands in while the submodule
    loads and is removed after, so a later `import torch.distributed._tools` runs the real __init__ (which
    reuses the submodules already loaded)."""
    package = "torch.distributed._tools"
    if package in sys.modules:
        return importlib.import_module(f"{package}.{name}")
    stand_in = types.ModuleType(package)
    stand_in.__path__ = [str(Path(torch.distributed.__file__).parent / "_tools")]
    sys.modules[package] = stand_in
    try:
        return importlib.import_module(f"{package}.{name}")
    finally:
        if sys.modules.get(package) is stand_in:
            del sys.modules[package]
        if getattr(torch.distributed, "_tools", None) is stand_in:
            delattr(torch.distributed, "_tools")


_mem_tracker = import_tools_module("mem_tracker")
MemTracker, _MemRefType, _UpdateType = _mem_tracker.MemTracker, _mem_tracker._MemRefType, _mem_tracker._UpdateType
active_fake_mode, DTensor = _mem_tracker.active_fake_mode, _mem_tracker.DTensor
# Ops the parent treats specially (a collective's wait returns its input under fake tensors): left to it.
_PARENT_OPS = frozenset({torch.ops._c10d_functional.wait_tensor.default})

# Tracker categories -> the breakdown memfit reports.
CATEGORY = {
    _MemRefType.PARAM: "params", _MemRefType.BUFFER: "params", _MemRefType.GRAD: "grads",
    _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations", _MemRefType.TEMP: "other",
    _MemRefType.OTH: "other",
}
BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "other")
# Storages the `offload` policy parks in host memory are booked on this pseudo-device.
HOST = torch.device("meta")

Vec = dict[str, int]


def zero_vec() -> Vec:
    return dict.fromkeys(BREAKDOWN_KEYS, 0)


def add(a: Vec, b: Vec, sign: int = 1) -> Vec:
    return {k: a[k] + sign * b[k] for k in BREAKDOWN_KEYS}


def total(v: Vec) -> int:
    return sum(v.values())


@dataclass
class Segment:
    """One stretch of the step (e.g. block 3's forward): memory at its start, end and highest point."""

    label: str
    start: Vec
    end: Vec
    peak: Vec
    seconds: float = 0.0
    ops: int = 0

    @property
    def delta(self) -> Vec:
        return add(self.end, self.start, -1)

    @property
    def rise(self) -> Vec:
        """The highest point relative to the start (what this stretch adds on top of what it found)."""
        return add(self.peak, self.start, -1)


@dataclass
class _Open:
    label: str
    start: Vec
    peak: Vec
    peak_total: int
    seconds: float = 0.0
    ops: int = 0


@dataclass
class TrackResult:
    peak: Vec
    peak_label: str
    segments: list[Segment] = field(default_factory=list)
    host_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return total(self.peak)


class StepTracker(MemTracker):
    """torch's MemTracker (categories: params, grads, optimizer state, activations, temporaries) with:

    - O(1) peak bookkeeping per op (the parent walks every module per op: minutes for a 32-block model);
    - segments: the step cut at decoder-block boundaries, so deep stacks can be composed from shallow ones;
    - offload emulation: storages the offload policy would move to pinned host memory are booked as host;
    - an optional per-op cost model (seconds) for the step-time prediction.
    """

    def __init__(self, blocks: list[nn.Module] | tuple[nn.Module, ...] = (),
                 op_seconds: Callable[[Any, tuple, dict, Any], float] | None = None,
                 host_seconds: Callable[[int], float] | None = None) -> None:
        super().__init__()
        self._block_index = {id(b): i for i, b in enumerate(blocks)}
        self._n_blocks = len(blocks)
        self._op_seconds = op_seconds
        self._host_seconds = host_seconds  # an offloaded tensor's trip across the host link, each way
        self._prefix = ""
        self._phase = "idle"
        self._open: _Open | None = None
        self.segments: list[Segment] = []
        self.peak_vec: Vec = zero_vec()
        self.peak_label = ""
        self.host_peak_bytes = 0
        self._skipped: set[int] = set()  # modules whose no-grad forward the parent's hooks sit out (below)

    # -- accounting ---------------------------------------------------------------------------------------
    def vec(self) -> Vec:
        out = zero_vec()
        for dev, snap in self._curr_mem_snap.items():
            if dev == HOST:
                continue
            for ref, nbytes in snap.items():
                cat = CATEGORY.get(ref)
                if cat is not None:
                    out[cat] += nbytes
        return out

    def _device_total(self) -> int:
        return sum(snap.get("Total", 0) for dev, snap in self._curr_mem_snap.items() if dev != HOST)

    def _update_peak_stats(self, peak_state: Any) -> None:
        now = self._device_total()
        if self._open is not None and now > self._open.peak_total:
            self._open.peak_total = now
            self._open.peak = self.vec()
        if now > total(self.peak_vec):
            self.peak_vec = self.vec()
            self.peak_label = self._open.label if self._open else self._phase
        host = self._curr_mem_snap.get(HOST, {}).get("Total", 0)
        self.host_peak_bytes = max(self.host_peak_bytes, host)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        # The parent hooks every parameter, which fails on frozen ones (LoRA's base weights): hook only
        # those that get gradients.
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_seen),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_seen(p.grad)),
                    )
        return sizes

    def _grad_seen(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def move_to_host(self, t: torch.Tensor) -> None:
        """Book `t`'s storage on the host (what save_on_cpu does to a saved tensor), off the device total."""
        winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
        if winfo is None or winfo.device == HOST:
            return
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.DEL, winfo)
        winfo.device = HOST
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.ADD, winfo)

    def offload_hooks(self) -> tuple[Callable, Callable]:
        """saved_tensors_hooks that emulate save_on_cpu: pack books the tensor on the host, unpack copies it back."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "meta":
                self.move_to_host(t)
                self._charge_host(t)
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            self._charge_host(t)
            return t.clone()  # the host-to-device copy backward makes

        return pack, unpack

    def _charge_host(self, t: torch.Tensor) -> None:
        if self._host_seconds is not None and self._open is not None:
            self._open.seconds += self._host_seconds(t.numel() * t.element_size())

    # -- segments -----------------------------------------------------------------------------------------
    def mark(self, label: str) -> None:
        """Close the current segment and open `label` (a phase boundary the driver or a block hook sees)."""
        now = self.vec()
        if self._open is not None:
            o = self._open
            self.segments.append(Segment(o.label, o.start, now, o.peak, o.seconds, o.ops))
        self._open = _Open(label, now, dict(now), total(now))

    def phase(self, name: str, prefix: str = "") -> None:
        """The driver says which part of the step runs next: fwd, ref (a DPO reference's no-grad forward, after the
        policy's head: one segment, no block marks), bwd, opt or idle."""
        self._phase, self._prefix = name, prefix
        if name == "idle":
            if self._open is not None:
                self.mark("idle")
                self._open = None
            return
        self.mark(prefix + {"fwd": "fpre", "ref": "fref", "bwd": "bpost"}.get(name, name))

    @property
    def prefix(self) -> str:
        """The running micro-batch's label prefix (m0., m1.)."""
        return self._prefix

    def result(self) -> TrackResult:
        return TrackResult(peak=dict(self.peak_vec), peak_label=self.peak_label, segments=list(self.segments),
                           host_peak_bytes=self.host_peak_bytes)

    def _again_without_grad(self, module: nn.Module) -> bool:
        # A module run again in a no-grad forward of the same step (a DPO reference's: adapter_off runs the policy
        # itself once more) saves nothing for backward; the parent refuses a root module's second forward, and its
        # per-module statistics are not what memfit reads (the ops' bytes are still counted in dispatch).
        return not torch.is_grad_enabled() and not self._mod_tracker.is_bw and module in self.memory_tracking

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if self._again_without_grad(module):
            self._skipped.add(id(module))
            return
        super()._pre_fw_hook(module, inputs)
        i = self._block_index.get(id(module))
        if i is not None and self._phase == "fwd":
            self.mark(f"{self._prefix}fb{i}")

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if id(module) in self._skipped:
            self._skipped.discard(id(module))
            return
        super()._post_fw_hook(module, inputs, outputs)
        i = self._block_index.get(id(module))
        if i is not None and i == self._n_blocks - 1 and self._phase == "fwd":
            self.mark(f"{self._prefix}fpost")

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._pre_bw_hook(module, args)
        i = self._block_index.get(id(module))
        if i is not None and self._phase == "bwd":
            self.mark(f"{self._prefix}bb{i}")

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        i = self._block_index.get(id(module))
        if i == 0 and self._phase == "bwd":
            self.mark(f"{self._prefix}bpre")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _PARENT_OPS or any(t is DTensor for t in types):
            res = super().__torch_dispatch__(func, types, args, kwargs)
        else:
            # The parent's bookkeeping without its per-op pytree walk (tree_map_only over the outputs: ≈ 1/7 of a
            # fake-tensor trace, measured on the 1B plan): an op returns a tensor or a flat tuple/list of them.
            res = func(*args, **(kwargs or {}))
            if active_fake_mode() is self._fake_mode_on_entry:
                if self._in_opt:
                    ref = _MemRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    ref = _MemRefType.TEMP
                else:
                    ref = _MemRefType.ACT
                for t in _output_tensors(res):
                    self._track(ref, t)
                self._update_peak_stats(None)
        if self._op_seconds is not None and self._open is not None:
            self._open.seconds += self._op_seconds(func, args, kwargs or {}, res)
            self._open.ops += 1
        return res


def _output_tensors(res: Any) -> list[torch.Tensor]:
    if isinstance(res, torch.Tensor):
        return [res]
    if type(res) in (tuple, list) and all(x is None or isinstance(x, (torch.Tensor, int, float, bool)) for x in res):
        return [x for x in res if isinstance(x, torch.Tensor)]
    return tensors_of(res)


def tensors_of(*trees: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(trees)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
