"""Live tensor bytes over a training step: what is alive when, by category, phase and module (any device)."""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from memfit.memory.estimator.tracker import import_tools_module

# What a byte is held for. Pre-existing state is adopted with its category; what the step allocates is
# classified after it (`StepTimeline.classify`), since only then is it known what survived the forward.
CATEGORIES = ("parameter", "buffer", "gradient", "optimizer", "activation", "recompute", "temporary", "other")
ACTIVATION_CATEGORIES = ("activation", "recompute")
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this


@dataclass(slots=True)
class Alloc:
    """One tensor storage seen during (or alive at the start of) the tracked region."""

    index: int
    nbytes: int
    op: str
    module: str  # fully qualified name of the innermost module running ("" = the model itself or none)
    phase: str  # before, forward, backward, recompute, optimizer, other
    born: int  # event index of its allocation
    died: int = -1  # event index of its release; -1 = still alive at the end
    category: str = ""


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages, current and peak, for everything run inside it.

    A storage is identified by its Python object, which PyTorch keeps alive exactly as long as the storage;
    a weak reference's callback marks its release. Views and in-place results share a storage and count
    once. Like torch's MemTracker it sees what the dispatcher allocates (tensor ops, autograd's backward,
    optimizer steps), not allocator caching or kernel workspaces: on CPU it is the figure the probe reports.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device_type = device.type if device is not None else None
        self.current = 0
        self.peak = 0
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def adopt(self, tensors: Any, category: str) -> None:
        """Count tensors that exist before the step (parameters, optimizer state, accumulated grads)."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, category, "(existing)", "before")

    def reset_peak(self) -> None:
        self.peak = self.current

    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        # A DTensor (FSDP2's parameters, their gradients and optimizer state) reports a storage of the global
        # size: this rank holds its local shard. Counted whole, an FSDP2 rank of two read its state twice over.
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local
        if t.is_meta or t.is_sparse or (self.device_type is not None and t.device.type != self.device_type):
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses without a storage
            return None

    def _register(self, t: torch.Tensor, category: str, op: str, phase: str) -> None:
        st = self._storage(t)
        if st is None or st in self._live:
            return
        nbytes = st.nbytes()
        if t.device.type == "cuda":
            nbytes = math.ceil(nbytes / _CUDA_BLOCK) * _CUDA_BLOCK
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        rec = self._record(st, nbytes, category, op, phase)
        self._live[st] = (rec, weakref.ref(st, lambda _ref, n=nbytes, r=rec: self._release(n, r)))

    def _record(self, st: torch.UntypedStorage, nbytes: int, category: str, op: str, phase: str) -> Alloc | None:
        return None

    def _release(self, nbytes: int, rec: Alloc | None) -> None:
        self.current -= nbytes

    def _phase(self) -> str:
        return ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if tensors:
            op, phase = func.overloadpacket.__name__, self._phase()
            for t in tensors:
                self._register(t, "", op, phase)
        return out


class StepTimeline(LiveBytes):
    """LiveBytes that keeps every allocation and release in order, with its phase and module.

    Phases come from where PyTorch is: autograd's graph task (backward), a module's forward running inside
    backward (recompute under gradient checkpointing), an optimizer's step hooks, a module's forward, or
    none of these ("other": the batch, loss sums, gradient clipping). Modules come from torch's ModTracker
    (forward and backward hooks), by fully qualified name.
    """

    def __init__(self, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(device)
        ModTracker = import_tools_module("mod_tracker").ModTracker  # noqa: N806 - the class, as torch names it

        self.model = model
        self.allocs: list[Alloc] = []
        self.events: list[int] = []  # +i: allocs[i-1] allocated; -i: allocs[i-1] released
        self.forward_spans: list[list[int]] = []  # [first event, end event) of each top-level forward
        self.backward_spans: list[list[int]] = []
        self.optimizer_spans: list[list[int]] = []
        self.grad_indices: set[int] = set()
        self.grad_nbytes: dict[int, int] = {}  # id(parameter) -> bytes of its gradient the optimizer saw
        self.optimizer_indices: set[int] = set()
        self._index: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> Alloc
        self._mods = ModTracker()
        self._root = type(model).__name__
        self._fw_depth = 0
        self._in_opt = False
        self._in_bw = False
        self._handles: list[Any] = []
        self.closed = False

    # -- recording -------------------------------------------------------------------------------------
    def _record(self, st: torch.UntypedStorage, nbytes: int, category: str, op: str, phase: str) -> Alloc:
        self._note_backward(phase)
        rec = Alloc(index=len(self.allocs), nbytes=nbytes, op=op, phase=phase, born=len(self.events),
                    module=self._module() if phase != "before" else "", category=category)
        self.allocs.append(rec)
        self.events.append(rec.index + 1)
        self._index[st] = rec
        return rec

    def _release(self, nbytes: int, rec: Alloc | None) -> None:
        super()._release(nbytes, rec)
        if rec is not None and not self.closed:
            rec.died = len(self.events)
            self.events.append(-(rec.index + 1))

    def _note_backward(self, phase: str) -> None:
        # Backward has no hook of its own at this level: a span opens at its first op and closes at the
        # first op outside it.
        in_bw = phase in ("backward", "recompute")
        if in_bw and not self._in_bw:
            self.backward_spans.append([len(self.events), len(self.events)])
        if in_bw:
            self.backward_spans[-1][1] = len(self.events) + 1
        self._in_bw = in_bw

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if self._fw_depth > 0 else "backward"
        if self._in_opt:
            return "optimizer"
        return "forward" if self._fw_depth > 0 else "other"

    def _module(self) -> str:
        names = [p for p in self._mods.parents if p != "Global"]
        if not names:
            return ""
        inner = max(names, key=len)
        return inner.partition(".")[2] if inner.split(".")[0] == self._root else inner

    def _alloc_of(self, t: torch.Tensor) -> Alloc | None:
        st = self._storage(t)
        return None if st is None else self._index.get(st)

    # -- hooks -----------------------------------------------------------------------------------------
    def _fw_pre(self, module: nn.Module, args: Any) -> None:
        if module is self.model and self._fw_depth == 0 and torch._C._current_graph_task_id() == -1:
            self.forward_spans.append([len(self.events), len(self.events)])
        self._fw_depth += 1

    def _fw_post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._fw_depth = max(0, self._fw_depth - 1)
        if module is self.model and self._fw_depth == 0 and torch._C._current_graph_task_id() == -1:
            self.forward_spans[-1][1] = len(self.events)

    def _opt_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The gradients as the optimizer sees them: zero_grad releases them right after the step.
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.grad_nbytes[id(p)] = p.grad.untyped_storage().nbytes()
                if (rec := self._alloc_of(p.grad)) is not None:
                    self.grad_indices.add(rec.index)
        self._in_opt = True
        self.optimizer_spans.append([len(self.events), len(self.events)])

    def _opt_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_opt = False
        self.optimizer_spans[-1][1] = len(self.events)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and (rec := self._alloc_of(v)) is not None:
                    self.optimizer_indices.add(rec.index)

    def __enter__(self) -> StepTimeline:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_module_forward_pre_hook(self._fw_pre),
                         register_module_forward_hook(self._fw_post, always_call=True),
                         register_optimizer_step_pre_hook(self._opt_pre),
                         register_optimizer_step_post_hook(self._opt_post)]
        self._mods.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.closed = True  # releases after the region (the next step's) are not part of this timeline
        self._mods.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- analysis --------------------------------------------------------------------------------------
    def classify(self) -> None:
        """Give every allocation of the step its category, now that its fate is known.

        Forward allocations still alive when their forward returns are activations (saved for backward,
        or the logits and loss); the rest are temporaries. Recompute allocations are activations rebuilt in
        backward; gradients and optimizer state are those the optimizer saw; the rest are temporaries.
        """
        ends = [e for _, e in self.forward_spans]
        starts = [s for s, _ in self.forward_spans]
        for rec in self.allocs:
            if rec.phase == "before":
                continue
            if rec.index in self.optimizer_indices:
                rec.category = "optimizer"
            elif rec.index in self.grad_indices:
                rec.category = "gradient"
            elif rec.phase == "forward":
                i = bisect.bisect_right(starts, rec.born) - 1
                end = ends[i] if i >= 0 else rec.born
                rec.category = "activation" if rec.died == -1 or rec.died >= end else "temporary"
            elif rec.phase == "recompute":
                rec.category = "recompute"
            elif rec.phase in ("backward", "optimizer"):
                rec.category = "temporary"
            else:
                rec.category = "other"

    def curves(self) -> dict[str, list[int]]:
        """Live bytes after every event, in total and per category (call `classify` first)."""
        cur = dict.fromkeys(CATEGORIES, 0)
        out: dict[str, list[int]] = {c: [] for c in (*CATEGORIES, "total")}
        total = 0
        for ev in self.events:
            rec = self.allocs[abs(ev) - 1]
            delta = rec.nbytes if ev > 0 else -rec.nbytes
            cur[rec.category or "other"] += delta
            total += delta
            for c in CATEGORIES:
                out[c].append(cur[c])
            out["total"].append(total)
        return out

    def live_at(self, event: int, categories: tuple[str, ...] | None = None) -> list[Alloc]:
        """Allocations alive just before event index `event`."""
        return [r for r in self.allocs if r.born < event and (r.died == -1 or r.died >= event)
                and (categories is None or r.category in categories)]
