"""Gradient-checkpointing policies: objects with `.apply(model)`, applied in `apply_policy` only."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memfit.errors import ConfigError


class GradCheckpointPolicy(Protocol):
    """How a model recomputes activations in backward instead of keeping them (never training checkpoints)."""

    name: str

    def apply(self, model: nn.Module) -> None: ...

    def describe(self) -> str: ...


def _enable(model: nn.Module, every_n_layers: int = 1, offload: bool = False, **kwargs: Any) -> None:
    # use_reentrant=False: works with LoRA's frozen inputs and with kwargs-only block calls.
    ckpt_kwargs = {"use_reentrant": False, **kwargs}
    model.activation_checkpointing_enable(ckpt_kwargs, every_n_layers=every_n_layers, offload=offload)
    # The KV cache is useless while training and conflicts with recompute.
    model.config.use_cache = False


@dataclass(frozen=True)
class NoCheckpointing:
    name: str = "none"

    def apply(self, model: nn.Module) -> None:
        if getattr(model, "is_activation_checkpointing", False):
            model.activation_checkpointing_disable()
        model.config.use_cache = False

    def describe(self) -> str:
        return "no gradient checkpointing: every activation kept for backward"


@dataclass(frozen=True)
class FullCheckpointing:
    name: str = "full"

    def apply(self, model: nn.Module) -> None:
        _enable(model)

    def describe(self) -> str:
        return "every decoder block recomputed in backward (non-reentrant)"


@dataclass(frozen=True)
class EveryKCheckpointing:
    k: int = 2
    name: str = "every_k"

    def apply(self, model: nn.Module) -> None:
        _enable(model, every_n_layers=self.k)

    def describe(self) -> str:
        return f"one decoder block in every {self.k} recomputed in backward"


@dataclass(frozen=True)
class SelectiveCheckpointing:
    """Per-op: keep the outputs of expensive ops (matmuls, attention), recompute cheap pointwise ones."""

    save_ops: tuple[str, ...] = field(default_factory=tuple)
    name: str = "selective"

    def _policy_fn(self):
        from torch.utils.checkpoint import CheckpointPolicy

        wanted = set(self.save_ops)
        aten = torch.ops.aten
        save = {getattr(aten, op).default for op in wanted if hasattr(aten, op)}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def apply(self, model: nn.Module) -> None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        unknown = [op for op in self.save_ops if not hasattr(torch.ops.aten, op)]
        if unknown:
            raise ConfigError(f"memory.selective_save_ops: unknown aten ops {unknown}; use names like 'mm', 'bmm'")
        context_fn = functools.partial(create_selective_checkpoint_contexts, self._policy_fn())
        _enable(model, context_fn=context_fn)

    def describe(self) -> str:
        return f"selective per-op: save outputs of {', '.join(self.save_ops)}; recompute the rest"


@dataclass(frozen=True)
class OffloadCheckpointing:
    """Full checkpointing whose saved block inputs live in pinned CPU memory (GPU only)."""

    name: str = "offload"

    def apply(self, model: nn.Module) -> None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ConfigError("memory.policy: 'offload' moves saved activations from the GPU to pinned CPU "
                              "memory and needs a CUDA device; on CPU use 'full' or 'selective'")
        _enable(model, offload=True)

    def describe(self) -> str:
        return "every decoder block recomputed; its saved inputs offloaded to pinned CPU memory"


POLICY_NAMES = ("none", "full", "every_k", "selective", "offload")


def make_policy(name: str, *, every_k: int = 2, save_ops: list[str] | tuple[str, ...] = ()) -> GradCheckpointPolicy:
    if name == "none":
        return NoCheckpointing()
    if name == "full":
        return FullCheckpointing()
    if name == "every_k":
        return EveryKCheckpointing(k=every_k)
    if name == "selective":
        return SelectiveCheckpointing(save_ops=tuple(save_ops))
    if name == "offload":
        return OffloadCheckpointing()
    raise ConfigError(f"memory.policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def apply_policy(model: nn.Module, policy: GradCheckpointPolicy) -> None:
    """The one place a gradient-checkpointing policy touches a model."""
    if policy.name != "none" and not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"memory.policy={policy.name}: {type(model).__name__} does not support gradient "
                          "checkpointing; use memory.policy=none")
    policy.apply(model)


def remove_checkpointing(model: nn.Module) -> None:
    """Back to inference: no recompute, KV cache on."""
    if getattr(model, "is_activation_checkpointing", False):
        model.activation_checkpointing_disable()
    model.config.use_cache = True
