"""Start-up imports with Python's cyclic garbage collector paused, then what they made frozen out of collections."""

# Importing torch, transformers, Prefect and MLflow allocates millions of objects that live as long as the process.
# CPython's cyclic collector runs every few hundred allocations and walks the young ones each time, and every so often
# all of them: on the 2-core reference machine `import torch, transformers, prefect` took 7.3 CPU s with it and 5.8
# with it paused (three runs each, 2026-12-02). Imports make little cyclic garbage, so nothing piles up meanwhile.
# Afterwards, in a process of memfit's own, `gc.freeze()` moves what exists to a permanent generation, so later full
# collections (during training, serving) no longer walk the modules either.
#
# The memfit processes that import heavily at start-up use it around those imports: `memfit run` and the other
# commands, the tracking process, each torchrun rank.

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic collector for the block (nested uses pause it once) and resume it at the outermost exit,
    also when the block raises.

    `freeze`: only at a process's own start-up (its entry point knows). What is frozen is never collected as
    cyclic garbage, so in a long-lived process that called memfit in-process (a test runner, a notebook) it could
    keep a cycle that just became garbage, say one holding a model, for good.
    """
    if not gc.isenabled():  # an outer block (or the caller) already paused it: that one resumes it
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()


def skip_deepspeed_probe() -> None:
    """Let transformers' save_pretrained leave DeepSpeed unimported where no DeepSpeed engine can exist.

    It unwraps the model through accelerate's extract_model_from_parallel, which imports deepspeed whenever the
    package is installed, to ask whether the model is a DeepSpeedEngine: 1.6 s on the reference machine, and MLflow
    too (deepspeed's autotuner imports it), in every process that saves a model, memfit's own included, though
    memfit keeps MLflow in its tracking process. A model can only be an engine once deepspeed has been imported,
    so that is what the check asks (once per process; call it before saving a model)."""
    import sys

    from accelerate.utils import other

    check = other.is_deepspeed_available
    if getattr(check, "memfit_skip", False):
        return

    def imported() -> bool:
        return "deepspeed" in sys.modules and check()

    imported.memfit_skip = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = imported
