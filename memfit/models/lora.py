"""LoRA through peft: adapters on a (16-bit or 4-bit) frozen base, only they train; merged back for export."""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from memfit.errors import CheckpointError, ConfigError

LORA_KEY_MARK = ".lora_"


def _linear_names(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sorted(names)


def apply_lora(model: nn.Module, lora_cfg: Any) -> nn.Module:
    """Wrap `model` with LoRA adapters (peft); every base weight is frozen, only the adapters train."""
    from memfit.models.lora_targets import resolve

    _import_peft()
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora_cfg.target_modules
    where = resolve(model, targets)
    peft_cfg = PeftLoraConfig(task_type="CAUSAL_LM", r=lora_cfg.r, lora_alpha=lora_cfg.alpha,
                              lora_dropout=lora_cfg.dropout, bias="none", target_modules=where.modules,
                              target_parameters=where.parameters or None)
    try:
        with _targets_as_named(), peft_quietly():
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


@contextmanager
def _targets_as_named() -> Iterator[None]:
    """peft 0.21 rewrites the targets of MoE families (Mixtral, Qwen-MoE, DeepSeek) from transformers 4's layout
    to 5's, for old adapters: every name ending in gate, gate_proj, up_proj or down_proj becomes the router's or
    the routed experts' weight, so dense and shared-expert MLPs were never adapted and the router was. memfit
    names targets for the model it holds (memfit/models/lora_targets.py): no rewrite while adding adapters."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


class _HideBitsandbytes(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ModuleNotFoundError("bitsandbytes is not needed: nothing is quantized", name=name)


def _import_peft() -> None:
    """peft, imported without bitsandbytes where nothing has imported it yet (memfit's NF4 policy does, first).
    peft imports it unconditionally (peft/helpers.py, which does without it), and on 2 busy cores that costs
    2-3 s and logs "Failed to load CPU gemm_4bit_forward from kernels-community"; only its layers need it."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    hide = _HideBitsandbytes()
    sys.meta_path.insert(0, hide)
    try:
        import peft  # noqa: F401 - imported here, while bitsandbytes is hidden
    finally:
        sys.meta_path.remove(hide)


@contextmanager
def peft_quietly() -> Iterator[None]:
    """peft adding or loading adapters without two side effects on a run's terminal where nothing is quantized:
    bitsandbytes imported, and transformers' FutureWarning for peft's read of a deprecated alias."""
    _import_peft()
    from peft.tuners.lora import model as lora_model

    names = ("is_bnb_available", "is_bnb_4bit_available")
    # bitsandbytes not imported: no layer of this model is one of its Linear8bitLt / Linear4bit, so peft's
    # bitsandbytes dispatchers can match nothing; peft would import it merely to try them.
    skip = "bitsandbytes" not in sys.modules and all(hasattr(lora_model, n) for n in names)
    saved = {n: getattr(lora_model, n) for n in names} if skip else {}
    with warnings.catch_warnings():
        # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates: nothing memfit can do.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        for n in saved:
            setattr(lora_model, n, lambda: False)
        try:
            yield
        finally:
            for n, original in saved.items():
                setattr(lora_model, n, original)


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point weights in the compute dtype (the mixed-precision LoRA recipe); trainable ones, and
    so their gradients and optimizer state, stay as they are (fp32). Buffers (rotary tables) are left alone."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


class _UpcastOutsideAutocast:
    """peft's `cast_input_dtype_enabled` flag, true only outside autocast. peft casts each adapter's input to the
    adapter's dtype (fp32) and autocast casts it straight back to the compute dtype for the matmul: the same
    values, for an fp32 copy of every adapted layer's input and a second compute-dtype copy saved for backward."""

    def __bool__(self) -> bool:
        return not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))


def skip_redundant_upcast(model: nn.Module) -> None:
    flag = _UpcastOutsideAutocast()
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = flag


def prepare_lora_model(model: nn.Module, lora_cfg: Any, precision: str, quantize: str | None = None,
                       fake: bool = False, seed: int = 0) -> nn.Module:
    """The one place a LoRA training model is built: the base quantized (lora.quantize, or `quantize`), the
    adapters added (their init drawn from `seed`), every frozen weight held in train.precision's compute
    dtype. `fake`: the estimator's meta-device model (quantization by same-sized stand-ins)."""
    from memfit.models.quantization import compute_dtype, quantization_for

    policy = quantization_for(lora_cfg.quantize if quantize is None else quantize, precision, fake=fake)
    if policy is not None:
        model = policy.apply(model)
    # Seeded and forked: the adapters' random init must not depend on what ran before in this process
    # (the probe, another run), nor move the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = apply_lora(model, lora_cfg)
    hold_frozen_in(model, compute_dtype(precision))
    skip_redundant_upcast(model)
    return model


def lora_wanted(lora_cfg: Any) -> bool | None:
    """True/False when lora.enabled fixes it; None when the planner decides (auto)."""
    return None if lora_cfg.enabled == "auto" else bool(lora_cfg.enabled)


def is_lora_state(state_dict: dict[str, Any]) -> bool:
    return any(LORA_KEY_MARK in k for k in state_dict)


def is_adapted(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint holds of the model: every weight, or with adapters only the trainable ones
    (the frozen base, 16-bit or 4-bit, is rebuilt from model.name_or_path or the preset on resume and export)."""
    state = model.state_dict()
    if not is_adapted(model):
        return state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def load_trainable_state(model: nn.Module, state: dict[str, Any], where: str = "training checkpoint") -> None:
    """Load a training checkpoint's model state: all of it, or (adapters) every trainable weight at least."""
    if not is_adapted(model):
        model.load_state_dict(state, strict=True)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lacking = sorted(trainable & set(missing))
    if unexpected or lacking:
        what = f"unexpected keys {unexpected[:3]}" if unexpected else f"no value for {lacking[:3]}"
        raise CheckpointError(f"{where} does not fit the LoRA model of its config ({what}); check lora.r, "
                              "lora.target_modules and lora.quantize against the run that saved it")


def merged_from_state(model: nn.Module, lora_cfg: Any, state: dict[str, Any],
                      where: str = "training checkpoint") -> nn.Module:
    """A plain model (for evaluation and export) from a freshly loaded base and a training checkpoint's state:
    with adapters, the base as training held it (a 4-bit base quantized and dequantized), the adapters loaded
    and merged in; without, the weights loaded as they are."""
    return merge_lora(adapted_from_state(model, lora_cfg, state, where))


def adapted_from_state(model: nn.Module, lora_cfg: Any, state: dict[str, Any],
                       where: str = "training checkpoint", quantize: str | None = None) -> nn.Module:
    """As merged_from_state, before the merge: the peft model (its adapter can be saved alone), or with a full
    fine-tune's state the plain model. `quantize`: the base's quantization as trained (the plan's), else
    lora.quantize."""
    if not is_lora_state(state):
        model.load_state_dict(state, strict=True)
        return model
    from memfit.models.quantization import quantization_for

    policy = quantization_for(lora_cfg.quantize if quantize is None else quantize, "fp32")
    if policy is not None:
        model = policy.round_trip(model)
    model = apply_lora(model, lora_cfg)
    load_trainable_state(model, state, where)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters folded into its weights."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
