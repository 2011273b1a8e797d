"""eval.dtype in phase 5: which dtype the model is evaluated in on the device, and its copy in that dtype."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger("memfit.evaluation")
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def phase5_dtype(cfg: Any, device: torch.device, model: nn.Module) -> str:
    """eval.dtype resolved on this device now: auto compares phase 5's predicted fp32 peak with the free memory
    (CUDA only; on CPU auto is fp32) and says why it leaves fp32."""
    from memfit.memory.estimator.evaluation import evaluation_memory, resolve_eval_dtype

    setting = cfg.eval.dtype
    if setting == "auto" and device.type != "cuda":
        return "fp32"
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    n_params = sum(p.numel() for p in model.parameters())
    fp32 = evaluation_memory(model.config, n_params, cfg).peak
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    dtype = resolve_eval_dtype(setting, device.type, bf16_ok, free, fp32)
    if dtype != "fp32" and setting == "auto":
        log.warning("phase 5 evaluates in %s on %s: in fp32 it would need %.4g GB and %.4g GB are free "
                    "(eval.dtype auto; the exports are still written from fp32 weights)", dtype, device,
                    fp32 / 1e9, (free or 0) / 1e9)
    return dtype


def device_twin(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` for evaluation on `device` in `dtype`, its tensors cast one at a time into place (no second
    full-size copy in host memory); the original keeps its fp32 weights for the exports. Tied weights stay tied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            cast = p.detach().to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)
            memo[id(p)] = nn.Parameter(cast, requires_grad=False)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = b.detach().to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
    twin = copy.deepcopy(model, memo)
    return twin.eval()
