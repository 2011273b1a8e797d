"""LoRA through peft: adapters on a causal LM, only they train; merged back into the weights for export."""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit.errors import ConfigError

LORA_KEY_MARK = ".lora_"


def _linear_names(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sorted(names)


def apply_lora(model: nn.Module, lora_cfg: Any) -> nn.Module:
    """Wrap `model` with LoRA adapters (peft); every base weight is frozen, only the adapters train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora_cfg.target_modules
    peft_cfg = PeftLoraConfig(task_type="CAUSAL_LM", r=lora_cfg.r, lora_alpha=lora_cfg.alpha,
                              lora_dropout=lora_cfg.dropout, bias="none",
                              target_modules=targets if isinstance(targets, str) else list(targets))
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as err:
        if "not found in the base model" in str(err) or "target modules" in str(err).lower():
            raise ConfigError(f"lora.target_modules: {targets} match no module of {type(model).__name__}; its "
                              f"linear layers are named {', '.join(_linear_names(model))} (or use all-linear)"
                              ) from None
        raise ConfigError(f"lora: peft could not add adapters ({err})") from None
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ConfigError(f"lora.target_modules: {targets} produced no trainable adapter weights")
    return wrapped


def lora_wanted(lora_cfg: Any) -> bool | None:
    """True/False when lora.enabled fixes it; None when the planner decides (auto)."""
    return None if lora_cfg.enabled == "auto" else bool(lora_cfg.enabled)


def is_lora_state(state_dict: dict[str, Any]) -> bool:
    return any(LORA_KEY_MARK in k for k in state_dict)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters folded into its weights."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
