"""train.compile: each decoder block compiled with torch.compile in place (regional compilation, as torchtitan)."""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn

log = logging.getLogger("memfit.training")


def compile_blocks(model: nn.Module, block_class: str | None = None) -> int:
    """Compile every decoder block's forward in place (`nn.Module.compile`): one block's graph is compiled once
    and reused by its alike siblings, so start-up stays near one block's compile whatever the depth; the state
    dict keys are unchanged (training checkpoints and exports read the same names). Returns the blocks compiled.
    Shapes that vary (padded batches cut to their longest row) recompile once, then run with dynamic shapes."""
    from memfit.memory.techniques.policies import find_blocks

    blocks = find_blocks(model, block_class)
    for block in blocks:
        block.compile()
    return len(blocks)


class CompileClock:
    """The compile time, reported apart from step times: the wall time between torch.compile's own compile-start
    and compile-end callbacks (dynamo graphs, the lazily compiled backward, recompiles for new shapes), wherever
    they happen (the first validation pass compiles too). `take()` returns the seconds not yet reported."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.total = 0.0
        self._reported = 0.0
        self._started: float | None = None
        if enabled:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)

    def _start(self, _args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, _args: Any) -> None:
        if self._started is not None:
            self.total += time.perf_counter() - self._started
            self._started = None

    def take(self) -> dict[str, float]:
        """{"compile_s": seconds compiled since the last take} when there were any (a metric), else {}."""
        new = self.total - self._reported
        if not self.enabled or new <= 0:
            return {}
        self._reported = self.total
        log.info("train.compile: %.1f s compiling (%.1f s in this process)", new, self.total)
        return {"compile_s": new}

    def close(self) -> None:
        if self.enabled:
            from torch._dynamo.callback import callback_handler

            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
