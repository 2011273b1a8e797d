"""Gradient-checkpointing policies: objects with `.apply(model)`, applied in `apply_policy` only."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import ConfigError

# What one decoder block does in backward: keep everything, recompute all of it, recompute the cheap ops
# only, or recompute all of it with its saved inputs parked in host memory.
BLOCK_KINDS = ("none", "selective", "full", "offload")
POLICY_NAMES = ("none", "full", "every_k", "selective", "offload", "mixed")

# The estimator traces on fake CPU tensors, where pinned host memory does not exist; it sets these
# saved-tensor hooks so that `offload` marks what it would move instead of moving it.
OFFLOAD_EMULATION: contextvars.ContextVar[tuple[Callable, Callable] | None] = contextvars.ContextVar(
    "memfit_offload_emulation", default=None)


class GradCheckpointPolicy(Protocol):
    """How a model recomputes activations in backward instead of keeping them (never training checkpoints)."""

    name: str

    def block_kinds(self, n_blocks: int) -> list[str]: ...

    def apply(self, model: nn.Module) -> None: ...

    def describe(self) -> str: ...


# -- which blocks -----------------------------------------------------------------------------------------
def _base_model(model: nn.Module) -> nn.Module:
    # PEFT wrappers hold the transformers model inside; checkpointing flags live on that one.
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def find_blocks(model: nn.Module, block_class: str | None = None) -> list[nn.Module]:
    """The decoder blocks, in order: those of class `block_class` when given, else the model's block list."""
    base = _base_model(model)
    if block_class:
        found = [m for m in base.modules() if type(m).__name__ == block_class
                 or f"{type(m).__module__}.{type(m).__qualname__}" == block_class]
        if not found:
            repeated = sorted({type(m).__name__ for ml in base.modules() if isinstance(ml, nn.ModuleList)
                               for m in ml})
            raise ConfigError(f"memory.block_class: no module of class {block_class!r} in "
                              f"{type(base).__name__}; classes found in its module lists: "
                              f"{', '.join(repeated) or 'none'}")
        return found
    from memfit.models.loading import find_decoder_blocks

    return list(find_decoder_blocks(base))


def spread(count: int, n: int) -> list[int]:
    """`count` of `n` indices spread evenly (0-based), e.g. 3 of 8 -> [0, 3, 5]; deterministic."""
    if count <= 0:
        return []
    if count >= n:
        return list(range(n))
    return sorted({int(i * n / count) for i in range(count)})


def mixed_kinds(n: int, counts: dict[str, int]) -> list[str]:
    """A block assignment with the given number of blocks per kind, each kind spread over the stack."""
    if sum(counts.values()) != n or any(k not in BLOCK_KINDS for k in counts):
        raise ValueError(f"block counts {counts} do not describe {n} blocks of kinds {BLOCK_KINDS}")
    kinds = ["none"] * n
    free = list(range(n))
    # The most memory-saving kind first, so it is spread over the whole stack.
    for kind in ("offload", "full", "selective"):
        picked = [free[i] for i in spread(counts.get(kind, 0), len(free))]
        for i in picked:
            kinds[i] = kind
        free = [i for i in free if i not in set(picked)]
    return kinds


# -- how a block is checkpointed ---------------------------------------------------------------------------
def _selective_context_fn(save_ops: Sequence[str]) -> Callable:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    unknown = [op for op in save_ops if not hasattr(torch.ops.aten, op)]
    if unknown:
        raise ConfigError(f"memory.selective_save_ops: unknown aten ops {unknown}; use names like 'mm', 'bmm'")
    save = {getattr(torch.ops.aten, op).default for op in save_ops}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _offload_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    emulation = OFFLOAD_EMULATION.get()
    if emulation is not None:
        with torch.autograd.graph.saved_tensors_hooks(*emulation):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is not None and first.device.type != "cuda":
        raise ConfigError(_OFFLOAD_NEEDS_CUDA)
    if not torch.is_grad_enabled():  # nothing is saved: no block to park (an empty one would linger until backward)
        return function(*args, **kwargs)
    from memfit.memory.techniques.activation_offload import offloader

    with offloader().block():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_function(kind: str, save_ops: Sequence[str] = ()) -> Callable | None:
    """The function a block's forward is passed through for `kind` (None: run it plainly)."""
    if kind == "none":
        return None
    if kind == "full":
        # use_reentrant=False: works with LoRA's frozen inputs and with kwargs-only block calls.
        return functools.partial(checkpoint, use_reentrant=False)
    if kind == "selective":
        return functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_context_fn(save_ops))
    if kind == "offload":
        return _offload_checkpoint
    raise ValueError(f"unknown block kind {kind!r}")


def _is_hf_layer(block: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(block, GradientCheckpointingLayer)


def _set_block(block: nn.Module, func: Callable | None) -> None:
    if _is_hf_layer(block):
        # transformers' own mechanism: the layer's forward goes through _gradient_checkpointing_func when
        # gradient_checkpointing is set (its module hooks stay outside the recompute).
        block.gradient_checkpointing = func is not None
        if func is not None:
            block._gradient_checkpointing_func = func
        return
    # Any other block class: wrap the instance's forward (state dict and hooks unchanged).
    if "_memfit_plain_forward" in block.__dict__:
        previous = block.__dict__.pop("_memfit_plain_forward")
        block.__dict__.pop("forward", None)
        if previous is not None:
            block.__dict__["forward"] = previous
    if func is None:
        return
    previous = block.__dict__.get("forward")  # an instance-level forward set by someone else, or None
    block.__dict__["_memfit_plain_forward"] = previous
    plain = previous if previous is not None else type(block).forward.__get__(block)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return func(plain, *args, **kwargs)
        return plain(*args, **kwargs)

    block.__dict__["forward"] = checkpointed


def assign_blocks(model: nn.Module, kinds: Sequence[str], *, block_class: str | None = None,
                  save_ops: Sequence[str] = ()) -> None:
    """Give each decoder block its kind of checkpointing; `use_cache` off while training."""
    blocks = find_blocks(model, block_class)
    if len(kinds) != len(blocks):
        raise ValueError(f"{len(kinds)} block kinds for {len(blocks)} decoder blocks")
    base = _base_model(model)
    funcs = {kind: checkpoint_function(kind, save_ops) for kind in set(kinds)}
    # With frozen embeddings (LoRA) the first block's input needs requires_grad for grads to flow
    # through recomputed blocks; transformers does the same in activation_checkpointing_enable.
    if (any(kind != "none" for kind in kinds) and hasattr(base, "enable_input_require_grads")
            and not any(p.requires_grad for p in base.get_input_embeddings().parameters())):
        base.enable_input_require_grads()
    for block, kind in zip(blocks, kinds, strict=True):
        _set_block(block, funcs[kind])
    if getattr(base, "config", None) is not None:
        # The KV cache is useless while training and conflicts with recompute.
        base.config.use_cache = False


# -- the policies -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Policy:
    block_class: str | None = field(default=None, kw_only=True)
    save_ops: tuple[str, ...] = field(default=(), kw_only=True)
    name: str = field(default="", init=False)

    def block_kinds(self, n_blocks: int) -> list[str]:
        raise NotImplementedError

    def apply(self, model: nn.Module) -> None:
        n = len(find_blocks(model, self.block_class))
        assign_blocks(model, self.block_kinds(n), block_class=self.block_class, save_ops=self.save_ops)


@dataclass(frozen=True)
class _Uniform(_Policy):
    """Every block of one kind: the policy's name is that block kind."""

    def block_kinds(self, n_blocks: int) -> list[str]:
        return [self.name] * n_blocks


@dataclass(frozen=True)
class NoCheckpointing(_Uniform):
    name: str = field(default="none", init=False)

    def describe(self) -> str:
        return "no gradient checkpointing: every activation kept for backward"


@dataclass(frozen=True)
class FullCheckpointing(_Uniform):
    name: str = field(default="full", init=False)

    def describe(self) -> str:
        return "every decoder block recomputed in backward (non-reentrant)"


@dataclass(frozen=True)
class EveryKCheckpointing(_Policy):
    """One block in every k recomputed (blocks 0, k, 2k, ...: transformers' every_n_layers, spread evenly)."""

    k: int = 2
    name: str = field(default="every_k", init=False)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"memory.every_k ({self.k}) must be at least 1")

    def block_kinds(self, n_blocks: int) -> list[str]:
        return ["full" if i % self.k == 0 else "none" for i in range(n_blocks)]

    def describe(self) -> str:
        return f"one decoder block in every {self.k} recomputed in backward"


@dataclass(frozen=True)
class SelectiveCheckpointing(_Uniform):
    """Per-op: keep the outputs of expensive ops (matmuls, attention), recompute cheap pointwise ones."""

    name: str = field(default="selective", init=False)

    def apply(self, model: nn.Module) -> None:
        _selective_context_fn(self.save_ops)  # unknown op names fail here, before the model is touched
        super().apply(model)

    def describe(self) -> str:
        return f"selective per-op: save outputs of {', '.join(self.save_ops)}; recompute the rest"


_OFFLOAD_NEEDS_CUDA = ("memory.policy: 'offload' moves saved activations from the GPU to pinned CPU memory and "
                       "needs a CUDA device; on CPU use 'full' or 'selective'")


def _check_offload_device(model: nn.Module) -> None:
    # The policy is applied before the trainer moves the model to its device: a model still on the CPU is
    # fine where CUDA exists (a block run on the CPU is refused when it runs, in _offload_checkpoint).
    if OFFLOAD_EMULATION.get() is not None:
        return
    device = next(model.parameters()).device
    if device.type != "cuda" and not torch.cuda.is_available():
        raise ConfigError(_OFFLOAD_NEEDS_CUDA)


@dataclass(frozen=True)
class OffloadCheckpointing(_Uniform):
    """Full checkpointing whose saved block inputs live in pinned CPU memory (GPU only), copied there on a side
    stream during forward and back one block ahead during backward (activation_offload.py)."""

    name: str = field(default="offload", init=False)

    def apply(self, model: nn.Module) -> None:
        _check_offload_device(model)
        super().apply(model)

    def describe(self) -> str:
        return "every decoder block recomputed; its saved inputs offloaded to pinned CPU memory"


@dataclass(frozen=True)
class MixedCheckpointing(_Policy):
    """A kind per block, as the planner chose it (e.g. 2 blocks full, 6 selective)."""

    kinds: tuple[str, ...] = ()
    name: str = field(default="mixed", init=False)

    def block_kinds(self, n_blocks: int) -> list[str]:
        if len(self.kinds) != n_blocks:
            raise ConfigError(f"memory plan: {len(self.kinds)} block kinds for a model with {n_blocks} "
                              "decoder blocks; re-run the planner for this model")
        return list(self.kinds)

    def apply(self, model: nn.Module) -> None:
        if "offload" in self.kinds:
            _check_offload_device(model)
        super().apply(model)

    def describe(self) -> str:
        return describe_kinds(self.kinds)


def describe_kinds(kinds: Sequence[str]) -> str:
    counts = {k: sum(1 for x in kinds if x == k) for k in BLOCK_KINDS}
    parts = [f"{counts[k]} {k}" for k in ("full", "offload", "selective", "none") if counts[k]]
    return f"per block ({len(kinds)} blocks): " + ", ".join(parts)


def make_policy(name: str, *, every_k: int = 2, save_ops: Sequence[str] = (), block_class: str | None = None,
                kinds: Sequence[str] | None = None) -> GradCheckpointPolicy:
    common = {"block_class": block_class, "save_ops": tuple(save_ops)}
    if name == "none":
        return NoCheckpointing(**common)
    if name == "full":
        return FullCheckpointing(**common)
    if name == "every_k":
        return EveryKCheckpointing(k=every_k, **common)
    if name == "selective":
        return SelectiveCheckpointing(**common)
    if name == "offload":
        return OffloadCheckpointing(**common)
    if name == "mixed":
        if not kinds:
            raise ConfigError("memory.policy=mixed needs a block assignment; it comes from the planner "
                              "(memory.policy=auto)")
        return MixedCheckpointing(kinds=tuple(kinds), **common)
    raise ConfigError(f"memory.policy: unknown policy {name!r}; choose one of auto, {', '.join(POLICY_NAMES[:-1])}")


def configured_policy(memory: Any, name: str, every_k: int | None = None,
                      kinds: Sequence[str] | None = None) -> GradCheckpointPolicy:
    """`name` (a plan's policy) with the memory section's every_k, selective save ops and block class."""
    return make_policy(name, every_k=every_k or memory.every_k, save_ops=memory.selective_save_ops,
                       block_class=memory.block_class, kinds=kinds)


def apply_policy(model: nn.Module, policy: GradCheckpointPolicy) -> None:
    """The one place a gradient-checkpointing policy touches a model."""
    base = _base_model(model)
    if (policy.name != "none" and getattr(policy, "block_class", None) is None
            and not getattr(base, "supports_gradient_checkpointing", False)):
        raise ConfigError(f"memory.policy={policy.name}: {type(base).__name__} does not support gradient "
                          "checkpointing; set memory.block_class to its decoder block class, or use "
                          "memory.policy=none")
    policy.apply(model)


def remove_checkpointing(model: nn.Module, block_class: str | None = None) -> None:
    """Back to inference: no recompute, KV cache on."""
    base = _base_model(model)
    for block in find_blocks(model, block_class):
        _set_block(block, None)
    if getattr(base, "config", None) is not None:
        base.config.use_cache = True
