"""The quantization policy (lora.quantize): a 4-bit NF4 frozen base through bitsandbytes, and its way back out."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError

NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4-bit)
NESTED_BLOCK = 256  # absmax values per fp32 scale under double quantization
INSTALL_HINT = "pip install bitsandbytes==0.50.2"
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                  "fp16-mixed": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under train.precision: frozen weights are held (or dequantized) in it."""
    return COMPUTE_DTYPES[precision]


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight in NF4 with double quantization: packed 4-bit codes, 8-bit absmax per 64 weights,
    an fp32 scale per 256 absmax values, and the two 16-entry / 256-entry code books."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * (16 + 256) + 4


class _NoHubKernelNotice(logging.Filter):
    """Drops bitsandbytes' one log line at import on a CPU with AVX512-BF16 when the optional `kernels` package
    (a hub download) is absent: that kernel serves the repacked inference layout memfit turns off on every layer
    (support_avx512bf16_for_cpu below), and memfit downloads nothing from the hub; nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


_NO_HUB_KERNEL_NOTICE = _NoHubKernelNotice()


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported without its hub-kernel notice (every importer of it comes here); ImportError as is."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NO_HUB_KERNEL_NOTICE)  # once: the same object
    import bitsandbytes as bnb

    return bnb


def require_bitsandbytes(field: str = "lora.quantize") -> Any:
    try:
        bnb = import_bitsandbytes()
    except ImportError:
        raise ConfigError(f"{field}=nf4 needs bitsandbytes, which is not installed: {INSTALL_HINT} "
                          f"(or set {field}=none)") from None
    return bnb


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every linear layer the policy quantizes: all but the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child is not head:
                found.append((parent, name, child))
    return found


class _FakeNF4Linear(nn.Linear):
    """What the estimator puts in place of a Linear4bit: the packed codes and statistics as frozen tensors of
    bitsandbytes' sizes (fake tensors cannot hold a Params4bit), and a forward that dequantizes into a
    compute-dtype temporary and saves nothing but the codes, as bitsandbytes' MatMul4Bit does."""

    def __init__(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.compute_dtype = layer.in_features, layer.out_features, dtype
        n, device = layer.weight.numel(), layer.weight.device
        blocks = math.ceil(n / NF4_BLOCK)
        self.weight = nn.Parameter(torch.empty((math.ceil(n / 2), 1), dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32,
                                                          device=device))
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(x, self.weight, (self.out_features, self.in_features), self.compute_dtype,
                                    self.bias)


class _DequantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.shape, ctx.dtype = shape, dtype
        ctx.save_for_backward(packed)
        w = packed.new_empty(shape, dtype=dtype)  # the dequantized weight: a temporary of the layer's shape
        return nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (packed,) = ctx.saved_tensors
        w = packed.new_empty(ctx.shape, dtype=ctx.dtype)
        return (grad.to(ctx.dtype) @ w).to(grad.dtype), None, None, None, None


class NF4Quantization:
    """lora.quantize=nf4: every linear layer but the head becomes a frozen 4-bit NF4 layer with double
    quantization that computes in `dtype` (bitsandbytes' Linear4bit), then peft's k-bit preparation.

    `fake=True` (the estimator, on the meta device) swaps in same-sized stand-ins instead of bitsandbytes.
    """

    name = "nf4"

    def __init__(self, dtype: torch.dtype, fake: bool = False) -> None:
        self.dtype, self.fake = dtype, fake

    def apply(self, model: nn.Module) -> nn.Module:
        if self.fake:
            for parent, name, layer in quantized_linears(model):
                setattr(parent, name, _FakeNF4Linear(layer, self.dtype))
        else:
            bnb = require_bitsandbytes()
            for parent, name, layer in quantized_linears(model):
                setattr(parent, name, self._linear4bit(bnb, layer))
        # What peft and transformers read to know the base is k-bit (transformers sets it in from_pretrained).
        model.is_loaded_in_4bit = True
        from peft import prepare_model_for_kbit_training

        # memfit's own policy applies gradient checkpointing later (memory/techniques/policies.py), in its one place.
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    def _linear4bit(self, bnb: Any, layer: nn.Linear) -> nn.Module:
        q = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                              compute_dtype=self.dtype, quant_type="nf4", compress_statistics=True,
                              device="meta")
        q.weight = bnb.nn.Params4bit(layer.weight.data.detach().float().contiguous(), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True)
        if layer.bias is not None:
            q.bias = nn.Parameter(layer.bias.data.detach().clone(), requires_grad=False)
        # On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks the codes for its inference kernel at the first
        # eval forward (the initial validation loss) and keeps them so: training forwards then go through that
        # kernel, which has no backward, and the gradient to the layer's input is silently lost (adapters below
        # it learn from the residual path alone); a state_dict() unpacks them again, so a training checkpoint's
        # save changed the numerics. memfit keeps the one layout that trains, on every CPU.
        q.support_avx512bf16_for_cpu = False
        # Params4bit quantizes when it is moved to a device: here the CPU, so the codes do not depend on
        # the machine (a resumed run on another GPU quantizes the same base the same way).
        return q.to(layer.weight.device if layer.weight.device.type != "meta" else "cpu")

    def dequantize(self, model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Every Linear4bit back to a plain nn.Linear holding its dequantized weight (for merging, export)."""
        bnb = require_bitsandbytes()
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, bnb.nn.Linear4bit):
                    w = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state).to(dtype)
                    plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device=w.device, dtype=dtype)
                    plain.weight = nn.Parameter(w, requires_grad=False)
                    if child.bias is not None:
                        plain.bias = nn.Parameter(child.bias.data.to(dtype), requires_grad=False)
                    setattr(parent, name, plain)
        model.is_loaded_in_4bit = False
        return model

    def round_trip(self, model: nn.Module) -> nn.Module:
        """The fp32 weights a 4-bit run trained against: quantized as training did, then dequantized."""
        model = self.apply(model)
        return self.dequantize(model)


def logical_param_count(model: nn.Module) -> int:
    """Parameters as the unquantized model counts them (a 4-bit weight holds two per byte)."""
    n = 0
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            packed = name == "weight" and p.dtype == torch.uint8 and hasattr(m, "in_features")
            n += m.in_features * m.out_features if packed else p.numel()
    return n


def quantization_for(quantize: str, precision: str, fake: bool = False) -> NF4Quantization | None:
    """The policy lora.quantize names (None for none), computing in train.precision's dtype."""
    if quantize == "none":
        return None
    if quantize == "nf4":
        return NF4Quantization(compute_dtype(precision), fake=fake)
    raise ConfigError(f"lora.quantize: unknown value {quantize!r}; use none or nf4")
