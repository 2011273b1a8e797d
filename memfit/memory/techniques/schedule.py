"""Learning-rate schedule and RNG state helpers: pure functions the training loop and tests share."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `max_steps` (step counts from 0)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def capture_rng() -> tuple[dict[str, Any], dict[str, Any]]:
    """(JSON-able python/numpy states, tensors for torch CPU/CUDA states) — no pickle needed for either."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    json_state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    tensors: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This process's device only: a resume may see another number of GPUs (a new spot host, a rank).
        tensors["cuda"] = torch.cuda.get_rng_state()
    return json_state, tensors


def restore_rng(json_state: dict[str, Any], tensors: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = json_state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = json_state["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        state = tensors["cuda"]
        if isinstance(state, (list, tuple)):  # written by an earlier memfit: one state per visible GPU
            state = state[torch.cuda.current_device()] if torch.cuda.current_device() < len(state) else None
        if state is not None:
            torch.cuda.set_rng_state(state)
