"""Build the ONNX program of an export: from a cached weight-free graph of the same architecture, else by tracing."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import ExportError
from memfit.files import atomic_path, cache_root
from memfit.runtime.env import package_version

log = logging.getLogger("memfit.release")

SUBDIR = "onnx-graphs"
# Bump to invalidate every entry when the entry layout changes (the code digest below covers most changes).
ENTRY_FORMAT = 1
_KEY_PROP, _WEIGHTS_PROP = "memfit.graph_key", "memfit.weights"
_VERSIONED = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "onnx-ir")
# Per-run paths and the version string (versions are keyed separately) do not shape the graph.
_CONFIG_IGNORED = ("_name_or_path", "transformers_version", "_commit_hash")
INPUT_NAMES, OUTPUT_NAMES = ["input_ids"], ["logits"]
# Named strings become Dim.DYNAMIC and also name the ONNX axes "batch"/"sequence".
DYNAMIC_SHAPES = {"input_ids": {0: "batch", 1: "sequence"}}


class CacheMismatch(Exception):
    """A cached graph that does not fit this model; the caller does a full export instead."""


def cache_dir() -> Path:
    """$MEMFIT_CACHE_DIR/onnx-graphs (default ~/.cache/memfit/onnx-graphs)."""
    return cache_root() / SUBDIR


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    # remove_duplicate=False: a tied lm_head/embedding must be findable under either name.
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def _layout(module: nn.Module) -> list:
    """Name, shape, dtype and tie group of every tensor: two models with the same config can still differ here."""
    first: dict[int, str] = {}
    rows = []
    for name, t in _named_tensors(module).items():
        tied = first.setdefault(id(t), name)
        rows.append([name, list(t.shape), str(t.dtype), tied])
    return rows


@functools.cache  # the code this process imported, even if the files change under it
def _code_digest() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("formats.py", "onnx_cache.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def graph_key(wrapper: nn.Module, model: nn.Module, example_shape: tuple[int, int], opset: int | None) -> str:
    """sha256 of everything the exported graph depends on; the weights' values are not part of it."""
    config = getattr(model, "config", None)
    config_doc = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_IGNORED} if config else None
    doc = {
        "entry_format": ENTRY_FORMAT,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "wrapper": f"{type(wrapper).__module__}.{type(wrapper).__qualname__}",
        "config": config_doc,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "layout": _layout(wrapper),
        "example_shape": list(example_shape),
        "opset": opset,
        "dynamic_shapes": DYNAMIC_SHAPES,
        "names": [INPUT_NAMES, OUTPUT_NAMES],
        "versions": {d: package_version(d) for d in _VERSIONED},
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def trace(wrapper: nn.Module, example: torch.Tensor, opset: int | None, label: str):
    """torch.onnx.export (dynamo), not yet optimized: its initializers are exactly the module's tensors, by FQN."""
    out = io.StringIO()
    try:
        # The dynamo exporter reports progress on stdout; keep it for the error message only.
        with contextlib.redirect_stdout(out):
            return torch.onnx.export(
                wrapper, (example,), dynamo=True, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
                dynamic_shapes=DYNAMIC_SHAPES, verbose=False,
                # The optimizer folds weights into new initializers (transposes, merged equal tensors), so the
                # graph it leaves depends on weight values; the cache keeps the graph from before it.
                optimize=False,
                **({"opset_version": opset} if opset is not None else {}),
            )
    except Exception as e:
        raise ExportError(f"torch.onnx.export (dynamo) failed for {label}: {e}\n{out.getvalue()[-2000:]}") from e


def store(key: str, program, wrapper: nn.Module) -> bool:
    """Write the traced (unoptimized) graph without its weights under `key`; False (logged) if it cannot be."""
    import numpy as np
    import onnx_ir as ir

    tensors = _named_tensors(wrapper)
    signature = program.exported_program.graph_signature if program.exported_program is not None else None
    constants = set(signature.inputs_to_lifted_tensor_constants.values()) if signature is not None else set()
    graph = program.model.graph
    weights: dict[str, list] = {}
    for name in graph.initializers:
        if name in tensors:
            weights[name] = [list(tensors[name].shape), str(tensors[name].dtype)]
        elif name not in constants:
            log.info("ONNX graph not cached: initializer %s is neither a model tensor nor a traced constant", name)
            return False
    saved = {name: graph.initializers[name].const_value for name in weights}
    try:
        # Empty stand-ins of the same dtype: the entry holds the graph only, the shapes travel in value_info.
        for name, tensor in saved.items():
            graph.initializers[name].const_value = ir.Tensor(np.zeros(0, tensor.dtype.numpy()), name=name)
        proto = ir.serde.serialize_model(program.model)
    finally:
        for name, tensor in saved.items():
            graph.initializers[name].const_value = tensor
    for k, v in ((_KEY_PROP, key), (_WEIGHTS_PROP, json.dumps(weights, sort_keys=True))):
        prop = proto.metadata_props.add()
        prop.key, prop.value = k, v
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / f"{key}.onnx") as tmp:
            tmp.write_bytes(proto.SerializeToString())
    except OSError as e:
        log.warning("could not write the ONNX graph cache entry in %s (%s); exports still work, uncached", folder, e)
        return False
    return True


def load(key: str, wrapper: nn.Module) -> Any | None:
    """The cached graph for `key` with `wrapper`'s weights in its initializers, as an ONNXProgram; None on a miss.

    An unreadable entry is ignored with a warning; an entry that does not fit raises CacheMismatch.
    """
    path = cache_dir() / f"{key}.onnx"
    if not path.is_file():
        return None
    import onnx
    import onnx_ir as ir

    try:
        proto = onnx.load_model_from_string(path.read_bytes())
        props = {p.key: p.value for p in proto.metadata_props}
        if props.get(_KEY_PROP) != key:
            raise ValueError("its recorded key differs from its file name")
        weights = json.loads(props[_WEIGHTS_PROP])
        keep = [p for p in proto.metadata_props if p.key not in (_KEY_PROP, _WEIGHTS_PROP)]
        del proto.metadata_props[:]
        proto.metadata_props.extend(keep)
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: any parse error means the same
        log.warning("ignoring the unreadable ONNX graph cache entry %s (%s: %s); doing a full export",
                    path, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return None
    tensors = _named_tensors(wrapper)
    inits = model.graph.initializers
    for name, (shape, dtype) in weights.items():
        t = tensors.get(name)
        if name not in inits:
            raise CacheMismatch(f"the cached graph lacks the initializer {name}")
        if t is None:
            raise CacheMismatch(f"initializer {name} is not a tensor of the model")
        if list(t.shape) != shape or str(t.dtype) != dtype:
            raise CacheMismatch(f"initializer {name} is {dtype}{shape} in the cache, {t.dtype}{list(t.shape)} here")
        try:
            inits[name].const_value = ir.Tensor(t.detach().numpy(), name=name)  # shares the tensor's memory
        except (TypeError, RuntimeError) as e:
            raise CacheMismatch(f"initializer {name}: {e}") from e
    for name, value in inits.items():
        if name in weights:
            continue
        if name in tensors:  # a model tensor the entry would replace by a stored value
            raise CacheMismatch(f"initializer {name} is a tensor of the model but cached as a constant")
        if value.const_value is None:
            raise CacheMismatch(f"the cached constant {name} has no data")
    return torch.onnx.ONNXProgram(model, None)


def build(wrapper: nn.Module, model: nn.Module, example: torch.Tensor, opset: int | None, label: str,
          use_cache: bool = True) -> tuple[Any, str]:
    """The optimized ONNXProgram for `wrapper` and where its graph came from: "cache" or "export"."""
    key = graph_key(wrapper, model, tuple(example.shape), opset)
    if use_cache:
        try:
            program = load(key, wrapper)
        except CacheMismatch as e:
            log.warning("cached ONNX graph %s does not fit %s (%s); doing a full export", key[:12], label, e)
            program = None
        if program is not None:
            try:
                program.optimize()
                return program, "cache"
            except Exception as e:  # noqa: BLE001 - whatever breaks on the cached path, the full export decides
                log.warning("optimizing the cached ONNX graph %s for %s failed (%s: %s); doing a full export",
                            key[:12], label, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    program = trace(wrapper, example, opset, label)
    store(key, program, wrapper)
    program.optimize()  # what torch.onnx.export(optimize=True) runs, in the same place (byte-identical file)
    return program, "export"
