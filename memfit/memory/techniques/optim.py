"""The optimizer recipe, the end of an optimizer step and the step metrics the training loop logs."""

from __future__ import annotations

import functools
import math
from typing import Any

import psutil
import torch
from torch import nn

from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.techniques.schedule import lr_factor

ADAMW_BETAS = (0.9, 0.95)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in two AdamW groups: no decay on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = ("adamw", "adamw-fused", "adamw-8bit", "adamw-cpu-offload")


def resolve_optimizer(setting: str, device_type: str) -> str:
    """`memory.optimizer` as run. auto: fused on CUDA (no foreach scratch copy); on CPU the default path, whose
    numbers the golden losses pin (fused differs in the last bits, though it is several times faster there)."""
    if setting != "auto":
        return setting
    return "adamw-fused" if device_type == "cuda" else "adamw"


def make_adamw(model: nn.Module, lr: float, weight_decay: float, foreach: bool | None = None,
               kind: str = "adamw", offload_gradients: bool = False) -> torch.optim.Optimizer:
    """The one place the AdamW implementation is chosen (`memory.optimizer`, resolved): same groups, same betas.

    offload_gradients (adamw-cpu-offload with memory.optimizer_in_backward): each gradient goes to host memory as
    soon as it is accumulated and is freed on the GPU (torchao's option); the step runs on the CPU after backward.
    """
    groups = param_groups(model, weight_decay)
    common = {"lr": lr, "betas": ADAMW_BETAS, "eps": 1e-8}
    if kind == "adamw":
        return torch.optim.AdamW(groups, foreach=foreach, **common)
    if kind == "adamw-fused":
        return torch.optim.AdamW(groups, fused=True, **common)
    if kind == "adamw-8bit":
        from memfit.models.quantization import import_bitsandbytes

        try:
            bnb = import_bitsandbytes()
        except ImportError:
            raise ConfigError("memory.optimizer: adamw-8bit needs bitsandbytes (pip install bitsandbytes==0.50.2), "
                              "or choose adamw / adamw-fused") from None
        return bnb.optim.AdamW8bit(groups, **common)
    if kind == "adamw-cpu-offload":
        devices = {p.device.type for g in groups for p in g["params"]}
        if devices != {"cuda"}:
            raise ConfigError("memory.optimizer: adamw-cpu-offload moves the optimizer state from a CUDA device "
                              f"to the CPU; this model is on {', '.join(sorted(devices))}: use adamw or adamw-8bit")
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            raise ConfigError("memory.optimizer: adamw-cpu-offload needs torchao (pip install torchao), or choose "
                              "adamw-8bit") from None
        from memfit.memory.techniques.offload_optim import make_offloaded_adamw

        return make_offloaded_adamw(groups, offload_gradients, **common)
    raise ConfigError(f"memory.optimizer: unknown optimizer {kind!r}; choose auto, {', '.join(OPTIMIZERS)}")


class StepInBackward:
    """`memory.optimizer_in_backward`: each parameter stepped as soon as its gradient is accumulated, and that
    gradient freed, so the full set of gradients is never alive.

    The run's one optimizer does it: in a post-accumulate-grad hook every other gradient is None (stepped and
    freed, or not computed yet), and every AdamW here skips parameters without a gradient, so `step()` moves
    that parameter alone, with exactly the arithmetic of a whole step. The state, the schedule (which sets the
    groups' lr) and training checkpoints stay those of the ordinary optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._sq: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._step)
                         for g in optimizer.param_groups for p in g["params"]]

    def _step(self, p: torch.Tensor) -> None:
        sq = p.grad.detach().float().pow(2).sum()  # the global norm is still reported (not clipped by)
        self._sq = sq if self._sq is None else self._sq + sq
        self.optimizer.step()
        p.grad = None

    def finish(self) -> torch.Tensor:
        """The step's global gradient norm (every parameter has stepped by now)."""
        norm = self._sq.sqrt() if self._sq is not None else torch.zeros(())
        self._sq = None
        return norm

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def lr_schedule(t: TrainConfig) -> functools.partial:
    """Warmup then cosine to `min_lr_ratio`, as a factor of `lr` per optimizer step."""
    return functools.partial(lr_factor, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                             min_ratio=t.min_lr_ratio)


def make_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(t))


def make_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    return torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    scaler: torch.amp.GradScaler | None, max_grad_norm: float | None) -> torch.Tensor:
    """Unscale, clip, step, advance the schedule, clear the gradients; returns the pre-clip gradient norm."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else math.inf)
    stepped = True
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skips the step when the unscaled gradients hold inf/nan
        scaler.update()
        stepped = scaler.get_scale() >= scale  # update() lowers the scale exactly when it skipped
    else:
        optimizer.step()
    if stepped:  # a skipped fp16 step leaves the weights, and so the schedule, where they were
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def restore_schedule(scheduler: Any, scaler: torch.amp.GradScaler | None, state: dict[str, Any]) -> None:
    """The schedule's position and the loss scale from a training checkpoint's state."""
    sched = dict(state["scheduler"])
    sched.pop("lr_lambdas", None)  # ours is rebuilt from the config (max_steps may have grown)
    scheduler.load_state_dict({**scheduler.state_dict(), **sched})
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


def memory_now(device: torch.device) -> tuple[int, int]:
    """(peak, current) bytes: the CUDA allocator on GPU (peak since the memory monitor's last reading, or the
    start), process RSS on CPU. Read only: the monitor compares the same CUDA peak counters with the budget
    and is the one that resets them, so a reset here would hide a peak from it.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.memory_allocated(device))
    rss = psutil.Process().memory_info().rss
    return int(rss), int(rss)


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Pure: training FLOPs per token as PaLM (appendix B) and torchtitan count them: 6 per parameter (forward and
    backward) plus attention's 12 x layers x hidden x sequence length (not counted in the parameters)."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def step_metrics(loss: float, lr: float, grad_norm: float, tokens: int, seconds: float,
                 memory: tuple[int, int], trained: int | None = None, slots: int | None = None,
                 flops: float | None = None, peak_flops: float | None = None) -> dict[str, float]:
    """What every trainer logs for an optimizer step (the names the MLflow charts and the README use).

    `tokens`: the step's real tokens (no padding); `trained`: those whose prediction is trained (a label);
    `slots`: the token positions computed, padding included (padding_fraction = 1 - tokens / slots); `flops`:
    FLOPs per token and `peak_flops` the device's peak FLOP/s (tflops, mfu: CUDA runs)."""
    out = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / seconds,
           "step_time_s": seconds, "memory_peak_bytes": memory[0], "memory_current_bytes": memory[1]}
    if trained is not None:
        out["trained_tokens_per_s"] = trained / seconds
    if slots:
        out["padding_fraction"] = 1.0 - tokens / slots
    if flops:  # `flops`: per real token (flops_per_token); MFU against the device's dense peak for the dtype
        achieved = flops * tokens / seconds
        out["tflops"] = achieved / 1e12
        if peak_flops:
            out["mfu"] = achieved / peak_flops
    return out


def cuda_flops(model: nn.Module, device: torch.device, seq_len: int, precision: str) -> dict[str, float]:
    """On CUDA: FLOPs per token (PaLM's count) and the device's dense peak for the compute dtype, for the tflops
    and mfu metrics; elsewhere nothing (a CPU has no meaningful peak to hold a step against)."""
    if device.type != "cuda":
        return {}
    from memfit.config.devices import profile_for_report

    config = getattr(getattr(model, "module", model), "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    dtype = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "fp16-mixed": "float16"}.get(precision, "float32")
    profile = profile_for_report({"type": "cuda", "name": torch.cuda.get_device_name(device)})
    n_params = sum(p.numel() for p in model.parameters())
    return {"flops": flops_per_token(n_params, layers, hidden, seq_len), "peak_flops": profile.flops_per_s(dtype)}
