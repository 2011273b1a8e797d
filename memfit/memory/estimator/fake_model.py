"""The model an estimate traces: its transformers config, built at any depth on fake tensors, and the fake mode."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memfit.errors import ConfigError
from memfit.models.experts import traceable_experts


def model_config_for(cfg: Any) -> Any:
    """The transformers config of the model a memfit config trains; weights and tokenizer are not needed."""
    from transformers import AutoConfig

    from memfit.models.loading import preset_config, preset_spec
    from memfit.models.source import resolve_model_source

    if cfg.model.name_or_path:
        target, local = resolve_model_source(cfg.model.name_or_path, need_config=True)
        try:
            return AutoConfig.from_pretrained(target, trust_remote_code=cfg.model.trust_remote_code,
                                              local_files_only=local)
        except Exception as err:  # noqa: BLE001 - unreadable or unknown architecture
            raise ConfigError(f"model.name_or_path: cannot read the model config from {target} ({err})") from None
    spec = preset_spec(cfg.model, cfg.train.seed, "", cfg.data.seq_len)
    # A preset's vocabulary is its trained tokenizer's, at most model.vocab_size: estimate with the maximum.
    return preset_config(spec, cfg.model.vocab_size, 0)


def config_from_dict(config_dict: dict[str, Any] | None) -> Any:
    """A transformers config from its to_dict() form (the probe report's architecture); None for none."""
    if not config_dict:
        return None
    from transformers import AutoConfig

    d = dict(config_dict)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def n_blocks_of(hf_config: Any) -> int:
    n = getattr(hf_config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"model config ({type(hf_config).__name__}) has no num_hidden_layers; memfit cannot "
                          "estimate this architecture")
    return n


def with_depth(hf_config: Any, n: int) -> Any:
    c = copy.deepcopy(hf_config)
    c.num_hidden_layers = n
    types = getattr(c, "layer_types", None)
    if isinstance(types, list) and len(types) > n:
        c.layer_types = types[:n]
    c.use_cache = False
    return c


def fake_model(hf_config: Any, precision: str, lora_cfg: Any | None, mode: Any, quantize: str = "none",
               lean_layers: bool = False) -> torch.nn.Module:
    """The model with fake weights (shapes and dtypes only), as training would hold it.

    Built on the meta device (no init, no memory), then made the training model there by the trainer's own
    code (memfit.models.lora.prepare_lora_model: base quantized, adapters added, frozen weights in the compute
    dtype); then every parameter and buffer becomes a fake CPU tensor (fake tensors themselves cannot go
    through Module.to()). A 4-bit base is booked from its layers' shapes: same-sized stand-ins for
    bitsandbytes' packed codes and statistics (memfit.models.quantization), since fake tensors cannot hold them.
    """
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if lora_cfg is not None:
        from memfit.models.lora import prepare_lora_model

        with no_init():  # meta tensors have no values: peft's kaiming init of each adapter is pure overhead
            model = prepare_lora_model(model, lora_cfg, precision, quantize=quantize, fake=True)
        if precision == "bf16-true":
            model.to(torch.bfloat16)  # the trainer casts the adapters too
    if lean_layers:
        from memfit.memory.techniques.lean_layers import apply_lean_layers

        apply_lean_layers(model)
    _meta_to_fake(model, mode)
    model.train()
    return model


@contextmanager
def no_init() -> Iterator[None]:
    """torch.nn.init's in-place initialisers as no-ops, for models built on the meta device (there is nothing to
    fill); ~0.1 s per adapted layer otherwise (15 s of a 30B MoE estimate's 42 s)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def _meta_to_fake(model: torch.nn.Module, mode: Any) -> None:
    cpu = torch.device("cpu")
    done: dict[int, Any] = {}  # tied weights (GPT-2's wte and lm_head) stay one tensor

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            meta = t.detach().to("meta") if t.device.type != "meta" else t.detach()
            f = mode.fake_tensor_converter.from_meta_and_device(mode, meta, cpu)
            done[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else f
        return done[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)


@contextmanager
def fake_tracing() -> Iterator[Any]:
    """A FakeTensorMode (not yet entered), with transformers' mask logic taking the branch real batches take.

    transformers cannot read fake position ids, so it assumes packed sequences and builds an explicit mask
    where real tensors (memfit's batches: one sequence per row, no padding) get SDPA's is_causal; that
    changes what attention saves for backward.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    # FakeTensorMode logs a failing op's whole traceback before raising it; the error itself reaches the caller.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with traceable_experts():  # MoE experts' grouped_mm in fp32 / bf16-mixed (memfit/models/experts.py)
            yield FakeTensorMode(allow_non_fake_inputs=False)
    finally:
        fake_log.setLevel(level)
        if original is not None:
            masking_utils.find_packed_sequence_indices = original
