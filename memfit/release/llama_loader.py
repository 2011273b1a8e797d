"""Opens a GGUF file with llama-cpp-python the one way memfit does: export checks, adapters and serving alike."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

# llama.cpp's AMX kernels (the "extra buffer" its CPU backend repacks q8_0 / q4 weights into on CPUs with AMX-INT8:
# Sapphire Rapids and later Xeons, i.e. most current cloud CPUs) crash the process in ggml_backend_amx_mul_mat on the
# first decode. Measured with llama-cpp-python 0.3.36 on this project's 2-core Xeon: every q8_0 file segfaulted, from
# the tiny test models to a 2048 x 5632 Llama; with extra buffers off the same files run. Upstream:
# ggml-org/llama.cpp#20824 (closed unfixed). Off on such CPUs, then; MEMFIT_LLAMA_CPP_EXTRA_BUFFERS=1 turns them back
# on (a build known to be fixed), =0 turns them off everywhere.
ENV = "MEMFIT_LLAMA_CPP_EXTRA_BUFFERS"
_lock = threading.Lock()  # Llama() reads the default parameters from a module function, patched while it runs


def extra_buffers_wanted(system_info: str, env: str | None) -> bool:
    """Whether llama.cpp may use its extra buffer types: not where its CPU backend reports AMX-INT8, unless `env`
    (the variable's value) says otherwise."""
    if env is not None and env.strip() in ("0", "1"):
        return env.strip() == "1"
    return "AMX_INT8 = 1" not in system_info


def open_gguf(path: str | Path, **kwargs: Any) -> Any:
    """llama_cpp.Llama(model_path=path, **kwargs), with extra buffer types as extra_buffers_wanted decides."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    wanted = extra_buffers_wanted(lib.llama_print_system_info().decode(errors="replace"), os.environ.get(ENV))
    if wanted:
        return llama_cpp.Llama(model_path=str(path), **kwargs)
    defaults = lib.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    # Llama takes no argument for it; its constructor reads llama_model_default_params from this module at call time.
    with _lock:
        lib.llama_model_default_params = without_extra_buffers
        try:
            return llama_cpp.Llama(model_path=str(path), **kwargs)
        finally:
            lib.llama_model_default_params = defaults
