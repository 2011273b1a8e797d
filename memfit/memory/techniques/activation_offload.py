"""Saved block inputs parked in pinned host memory, copied on side CUDA streams so the copies overlap compute."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Smaller tensors stay on the GPU: a copy costs a launch and a pinned allocation whatever its size.
MIN_OFFLOAD_BYTES = 1 << 20


@dataclass
class _Parked:
    """One saved tensor in host memory, and its way back."""

    host: torch.Tensor
    device: torch.device
    block: int
    copied: Any  # CUDA event: the device-to-host copy is done
    back: torch.Tensor | None = None  # on the device again (prefetched), not yet handed to backward
    ready: Any = None  # CUDA event: `back` is complete


class ActivationOffloader:
    """The `offload` kind's saved-tensor hooks (the Unsloth / torchtune approach).

    Forward: each checkpointed block's saved inputs are copied to pinned host memory on a side stream while the
    next block computes; the device tensor is released once its copy is done (record_stream keeps the allocator
    from reusing it before). Backward: when block k's inputs are unpacked, block k-1's are sent back on a second
    side stream, so they are on the device before its recompute needs them.
    """

    def __init__(self) -> None:
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()
        self.blocks: list[list[_Parked]] = []
        self._current = -1
        self._in_backward = False

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Around one checkpointed block's forward: what it saves is parked under its index."""
        if self._in_backward:  # a new forward (next micro-batch or step): the previous one is consumed
            self.blocks, self._in_backward = [], False
        self.blocks.append([])
        self._current = len(self.blocks) - 1
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, t: torch.Tensor) -> Any:
        if not t.is_cuda or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)
            copied = self.d2h.record_event()
        parked = _Parked(host, t.device, self._current, copied)
        self.blocks[self._current].append(parked)
        return parked

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Parked):
            return packed
        self._in_backward = True
        if packed.back is None:
            self._fetch(packed)
        main = torch.cuda.current_stream(packed.device)
        main.wait_event(packed.ready)
        t, packed.back = packed.back, None
        t.record_stream(main)
        if packed.block > 0:  # the block backward reaches next
            for q in self.blocks[packed.block - 1]:
                if q.back is None:
                    self._fetch(q)
        return t

    def _fetch(self, q: _Parked) -> None:
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(q.copied)
            q.back = q.host.to(q.device, non_blocking=True)
            q.ready = self.h2d.record_event()


_OFFLOADER: ActivationOffloader | None = None


def offloader() -> ActivationOffloader:
    """The process's offloader (its streams are created once, on first use with CUDA)."""
    global _OFFLOADER
    if _OFFLOADER is None:
        _OFFLOADER = ActivationOffloader()
    return _OFFLOADER
