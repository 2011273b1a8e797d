"""Where LoRA adapters go: lora.target_modules' presets resolved on the model, the MoE router never adapted."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from memfit.errors import ConfigError

PRESETS = ("all-linear", "attention", "attention-mlp", "attention-experts")
_ATTENTION = re.compile(r"(^|_)(attn|attention)$")


@dataclass(frozen=True)
class Targets:
    """peft's LoraConfig arguments: modules (a list of names or suffixes, or one exact-match regex) and the 3-D
    expert parameters."""

    modules: list[str] | str
    parameters: list[str] = field(default_factory=list)


def _linears(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not head]


def routers(model: nn.Module) -> list[str]:
    """Full names of MoE routers: the `gate` / `router` child of a module that also holds `experts`."""
    out = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "experts" in children:
            out += [f"{name}.{c}" if name else c for c in ("gate", "router") if c in children]
    return out


def expert_parameters(model: nn.Module) -> list[str]:
    """The routed experts' fused weights (3-D parameters under a module named `experts`), as peft's
    target_parameters names them (the part after the experts module: experts.gate_up_proj, experts.down_proj)."""
    names = {f"experts.{n.rsplit('.', 1)[-1]}" for n, p in model.named_parameters()
             if p.dim() == 3 and "experts" in n.split(".")}
    return sorted(names)


def _in_attention(name: str) -> bool:
    return any(_ATTENTION.search(part) for part in name.split(".")[:-1])


def _in_routed_experts(name: str) -> bool:
    return "experts" in name.split(".")


def resolve(model: nn.Module, target: list[str] | str) -> Targets:
    """lora.target_modules → peft's arguments. A list is kept as given; the presets:
    all-linear: every linear layer but the output head, and the routed experts' fused weights;
    attention: the attention projections; attention-mlp: those and every dense MLP layer (shared experts, dense
    layers of an MoE model), routed experts and routers not; attention-experts: attention and the routed experts'
    fused weights (peft's target_parameters). A router is never adapted: routing would drift from what the
    experts were trained for."""
    router_names = routers(model)
    if isinstance(target, list):
        return Targets(list(target))
    linears = [n for n in _linears(model) if n not in router_names]
    attention = [n for n in linears if _in_attention(n)]
    if target == "all-linear":
        chosen, params = linears, expert_parameters(model)
    elif target == "attention":
        chosen, params = attention, []
    elif target == "attention-mlp":
        chosen, params = [n for n in linears if not _in_routed_experts(n)], []
    elif target == "attention-experts":
        params = expert_parameters(model)
        if not params:
            raise ConfigError(f"lora.target_modules: attention-experts, but {type(model).__name__} has no fused "
                              "expert weights (it is not a mixture of experts); use attention or all-linear")
        chosen = attention + [n for n in linears if _in_routed_experts(n)]  # per-expert Linear layouts
    else:
        raise ConfigError(f"lora.target_modules: unknown preset {target!r}; choose one of {', '.join(PRESETS)} "
                          "or list module names")
    if not chosen and not params:
        raise ConfigError(f"lora.target_modules: {target} finds no layer in {type(model).__name__}; list the "
                          "module names to adapt instead")
    # A string target is one regex peft full-matches against each module's name: exactly these modules.
    return Targets("|".join(re.escape(n) for n in chosen) if chosen else [], params)
