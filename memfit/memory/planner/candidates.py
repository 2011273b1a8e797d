"""The planner's candidate stacks: which techniques a config leaves open, and the fallbacks in their order."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from memfit.config.devices import DeviceProfile
from memfit.memory.estimator.compose import Stack

# Stack fields the planner varies within a tier (not fallbacks: the fastest that fits wins), each with the
# values the estimator models; a field is varied only where its config value is `auto` (technique_choices).
# Both leave the numbers of a step as they are: the chunked loss equals the plain one, and the step in
# backward is the same AdamW step (without clipping). Offload is a checkpointing kind (CUDA targets only).
TECHNIQUE_CHOICES: dict[str, tuple[Any, ...]] = {"loss": ("plain", "chunked"),
                                                 "optimizer_in_backward": (False, True)}
# The AdamW variants that hold less state, tried (when memory.optimizer is auto) only after the configured
# one fits nowhere in a tier: they change the numbers (8-bit moments) or the speed (the step on the host).
LEAN_OPTIMIZERS = ("adamw-8bit", "adamw-cpu-offload")


def technique_choices(cfg: Any, profile: DeviceProfile | None = None) -> dict[str, tuple[Any, ...]]:
    """TECHNIQUE_CHOICES for the fields this config leaves to the planner (memory.* set to auto); the fused loss
    too for a CUDA target where liger-kernel is installed (a plan made on a CPU for a GPU assumes the GPU's
    environment is this one's: without liger here, plain or chunked)."""
    from memfit.memory.techniques.fused_loss import fused_unavailable

    m = cfg.memory
    out: dict[str, tuple[Any, ...]] = {}
    # chunked runs in one process only; DPO's log-probs come from the logits (plain), whatever memory.loss says
    if m.loss == "auto" and cfg.distributed.world_size == 1 and cfg.train.objective != "dpo":
        fused = profile is not None and fused_unavailable(profile.kind) is None
        out["loss"] = TECHNIQUE_CHOICES["loss"] + (("fused",) if fused else ())
    # The step in backward needs every gradient of the step at once for a global clip: only without one.
    if m.optimizer_in_backward == "auto" and cfg.train.max_grad_norm is None and cfg.distributed.world_size == 1:
        out["optimizer_in_backward"] = TECHNIQUE_CHOICES["optimizer_in_backward"]
    return out


def _allowed(stack: Stack) -> bool:
    # The step in backward: one micro-batch a step, and no fp16 loss scaler (it checks every gradient first).
    return not stack.optimizer_in_backward or (stack.grad_accum_steps == 1 and stack.precision != "fp16-mixed")


def technique_variants(stack: Stack, choices: dict[str, tuple[Any, ...]] | None = None) -> list[Stack]:
    """`stack` with every allowed combination of `choices` (the stack itself when there are none)."""
    choices = TECHNIQUE_CHOICES if choices is None else choices
    if not choices:
        return [stack]
    keys = list(choices)
    variants = [replace(stack, **dict(zip(keys, values, strict=True)))
                for values in itertools.product(*choices.values())]
    return [v for v in variants if _allowed(v)] or [stack]


def lean_layer_fallbacks(cfg: Any) -> list[bool]:
    """memory.lean_layers as set, or under auto without them first, then with them: they keep the numbers but add
    a few in-place ops per layer, and trying them only where a tier fits nowhere without keeps the search small."""
    m = cfg.memory.lean_layers
    return [False, True] if m == "auto" else [m]


def lean_rival(tier: list[Stack], following: list[list[Stack]]) -> bool:
    """Whether the tier after `tier` holds its stacks with lean layers (memory.lean_layers auto), the rest alike."""
    if not tier or not following or not following[0]:
        return False
    a, b = tier[0], following[0][0]
    return not a.lean_layers and b.lean_layers and replace(a, lean_layers=True) == b


def optimizer_fallbacks(cfg: Any, profile: DeviceProfile) -> list[str]:
    """memory.optimizer as set, or under auto the default one, then the leaner ones this target can run."""
    import importlib.util

    from memfit.memory.techniques.optim import resolve_optimizer

    if cfg.memory.optimizer != "auto":
        return [cfg.memory.optimizer]
    lean = []
    if importlib.util.find_spec("bitsandbytes") is not None:
        lean.append("adamw-8bit")
    if profile.kind == "cuda":  # torchao's CPUOffloadOptimizer: a CUDA device and pinned host memory
        lean.append("adamw-cpu-offload")
    return [resolve_optimizer("auto", profile.kind)] + lean


def techniques(cfg: Any) -> dict[str, Any]:
    """The memory.* techniques a stack carries (auto loss and optimizer are resolved by the estimator)."""
    m = cfg.memory
    return {"loss": m.loss, "optimizer": m.optimizer, "optimizer_in_backward": m.optimizer_in_backward is True,
            "lean_layers": m.lean_layers is True}


def configured_stack(cfg: Any, lora: bool | None = None) -> Stack:
    t = cfg.train
    if lora is None:
        lora = cfg.lora.enabled is True
    return Stack(t.precision, t.micro_batch_size, t.grad_accum_steps, lora,
                 quantize=cfg.lora.quantize if lora and cfg.lora.enabled is True else "none", **techniques(cfg))


def lora_fallbacks(lora_cfg: Any) -> list[tuple[bool, str]]:
    """(LoRA, quantization) in the order the planner tries them: lora.enabled fixes LoRA; under auto full
    fine-tuning first, then LoRA on a 16-bit base, then (when lora.quantize allows it) on a 4-bit base."""
    if lora_cfg.enabled is True:
        return [(True, lora_cfg.quantize)]
    if lora_cfg.enabled is False:
        return [(False, "none")]
    return [(False, "none"), (True, "none")] + ([(True, lora_cfg.quantize)] if lora_cfg.quantize != "none" else [])


def no_bf16_precision(precision: str) -> str:
    # A target without bf16 (a T4) runs the same mixed-precision recipe in fp16, with the loss scaler.
    return "fp16-mixed" if precision == "bf16-mixed" else precision


def adapter_rows(cfg: Any, est: Any, e: Any, limit: int | None) -> list[dict[str, Any]]:
    """With lora.enabled true or auto: the same step (policy, micro-batch, precision) with LoRA on a 16-bit base
    and with QLoRA (an NF4 base), side by side, as rows: peak, trainable parameters, fits."""
    if cfg.lora.enabled is False:
        return []
    rows = []
    for quantize in ("none", "nf4"):
        stack = replace(e.stack, lora=True, quantize=quantize)
        other = e if stack == e.stack else est.estimate(stack, e.kinds)
        rows.append({"stack": "QLoRA (NF4 base)" if quantize == "nf4" else "LoRA", "peak_bytes": other.peak_bytes,
                     "weight_bytes": other.weight_bytes, "n_trainable": other.n_trainable,
                     "fits": None if limit is None else other.peak_bytes <= limit})
    return rows
