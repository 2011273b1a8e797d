"""Export a fine-tuned causal LM to SafeTensors and ONNX, each verified before it is moved into place."""

from __future__ import annotations

import copy
import datetime as _dt
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import memfit
from memfit.errors import ExportError
from memfit.files import commit_folder, file_record, fsync_tree, probe_writable, sha256_file, temporary_sibling
from memfit.models import experts
from memfit.release import onnx_cache
from memfit.release.parity import ParityCriteria, ShapeParity, parity_failure, shape_parity
from memfit.runtime.importing import skip_deepspeed_probe

MANIFEST_NAME = "memfit-export.json"
# Beside an ONNX file: <name>.memfit.json (memfit version, source run, parity per shape, checksums).
ONNX_METADATA_SUFFIX = ".memfit.json"
# torch.export treats sizes 0 and 1 as static, so the example must be >= 2 in both dims for them to
# stay dynamic; the verification shapes then prove the axes really are dynamic.
EXAMPLE_SHAPE = (2, 16)
DEFAULT_SHAPES = ((1, 8), (2, 16), (3, 5))
# ONNX files are protobufs, capped at 2 GiB. torch.onnx switches to external data by itself above
# 1.5 GiB of initializers; we decide from the parameter bytes with the same margin so the choice is
# ours and recorded, not a side effect.
EXTERNAL_DATA_BYTES = int(1.5 * 1024**3)
log = logging.getLogger("memfit.release")


@dataclass
class SafetensorsExport:
    dir: str
    max_abs_diff: float
    files: dict[str, dict]


@dataclass
class OnnxExport:
    path: str
    opset: int
    max_abs_diff: float
    shapes: list[tuple[int, int]]
    external_data: bool
    sha256: str
    per_shape: list[ShapeParity] | None = None
    metadata_path: str | None = None
    criteria: ParityCriteria | None = None
    # "cache": the graph came from the ONNX graph cache (onnx_cache.py) with these weights; "export": traced.
    graph_source: str = "export"


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """Put `model` (in place) in eval mode, checkpointing off and KV cache on; returns it.

    Training usually sets `use_cache=False` (the cache is useless with checkpointing) and that flag
    would otherwise be saved into config.json and make generation slow for every user of the export.
    """
    model.eval()
    # Same test as transformers' `is_activation_checkpointing`, but works on any nn.Module, and we only
    # call disable when it is on: with PEFT, disable also removes an input hook that may not exist.
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        if hasattr(model, "activation_checkpointing_disable"):  # transformers >= 5
            model.activation_checkpointing_disable()
        elif hasattr(model, "gradient_checkpointing_disable"):  # deprecated alias in 5.x, FutureWarning
            model.gradient_checkpointing_disable()
        for m in model.modules():  # plain modules carrying the flag, or a model that ignored disable
            if getattr(m, "gradient_checkpointing", False) is True:
                m.gradient_checkpointing = False
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = True
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.use_cache = True
    return model


def _vocab_size(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    return int(model.config.vocab_size)


def sample_ids(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    # Own generator: deterministic without touching the global RNG a training run may rely on.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.long)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _ready_to_write(model: nn.Module, folder: Path, what: str) -> None:
    """Prove `folder` (created if needed) is writable now, before minutes of export work; then prepare `model`."""
    try:
        probe_writable(folder)
    except OSError as e:
        raise ExportError(
            f"cannot write the {what} into {folder}: {e.strerror or e}. "
            "Choose an output folder you can write to, or fix its permissions."
        ) from e
    prepare_for_inference(model)


@contextmanager
def _staging(final: Path, what: str) -> Iterator[Path]:
    """A temporary name beside `final` to stage in, removed afterwards; an OSError becomes one clear line."""
    tmp = temporary_sibling(final)
    try:
        yield tmp
    except OSError as e:
        raise ExportError(f"writing the {what} to {final} failed: {e}. Check free disk space and permissions.") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids.to(_device_of(model)), use_cache=False).logits.float().cpu()


def export_safetensors(
    model,
    tokenizer,
    out_dir: str | Path,
    *,
    sample_input_ids: torch.Tensor | None = None,
    atol: float = 1e-5,
    metadata: dict | None = None,
) -> SafetensorsExport:
    """Save model + tokenizer as a from_pretrained folder, reload and compare logits, then move it in place.

    The model is prepared for inference in place (see `prepare_for_inference`). Raises ExportError
    when the folder cannot be written or the reloaded model's logits differ by more than `atol`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir).absolute()
    if getattr(model, "_hf_peft_config_loaded", False) or hasattr(model, "peft_config"):
        # save_pretrained would write only the adapter, which AutoModelForCausalLM cannot load alone.
        raise ExportError(
            f"the model carries PEFT adapters; merge them first (model = model.merge_and_unload()) "
            f"before exporting to {out_dir}."
        )
    _ready_to_write(model, out_dir.parent, "SafeTensors export")
    vocab = _vocab_size(model)
    if sample_input_ids is None:
        sample_input_ids = sample_ids(vocab, *EXAMPLE_SHAPE, seed=0)
    elif int(sample_input_ids.max()) >= vocab or int(sample_input_ids.min()) < 0:
        raise ExportError(f"sample_input_ids must lie in [0, {vocab}) (the model's vocabulary).")

    with _staging(out_dir, "SafeTensors export") as tmp:
        # transformers 5 always writes safetensors: `safe_serialization` is gone from save_pretrained
        # (it would land silently in **kwargs), so we check for the files instead of asking for them.
        skip_deepspeed_probe()
        model.save_pretrained(tmp)
        if not any(tmp.glob("*.safetensors")) or any(tmp.glob("*.bin")):
            raise ExportError(f"save_pretrained did not write SafeTensors weights for {out_dir}.")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and not (tmp / "generation_config.json").exists():
            gen.save_pretrained(tmp)  # save_pretrained skips it for models that cannot generate

        config = json.loads((tmp / "config.json").read_text())
        if config.get("use_cache") is not True:
            use_cache = config.get("use_cache")
            raise ExportError(f"config.json for {out_dir} has use_cache={use_cache!r}, not true.")

        dtype = next(model.parameters()).dtype
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(_device_of(model)).eval()
        diff = float((_logits(model, sample_input_ids) - _logits(reloaded, sample_input_ids)).abs().max())
        del reloaded
        if not diff <= atol:  # `not <=` so a NaN difference fails too
            raise ExportError(
                f"SafeTensors export for {out_dir} failed verification: reloaded logits differ by "
                f"max |diff| = {diff:.3g} > atol = {atol:g}; nothing was written to {out_dir}."
            )
        if tokenizer is not None:
            text = "memfit export check: hello world 123"
            again = AutoTokenizer.from_pretrained(tmp)
            if again(text)["input_ids"] != tokenizer(text)["input_ids"]:
                raise ExportError(f"the tokenizer saved for {out_dir} encodes differently after reloading.")
            # The chat template travels with the folder, so apply_chat_template and pipelines work on it.
            if getattr(tokenizer, "chat_template", None) and again.chat_template != tokenizer.chat_template:
                raise ExportError(f"the chat template did not survive saving the tokenizer for {out_dir}.")

        files = {p.relative_to(tmp).as_posix(): file_record(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "memfit_version": memfit.__version__,
            "format": "safetensors",
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "max_abs_diff": diff,
            "atol": atol,
            "metadata": metadata or {},
            "files": files,
        }
        # default=str: a Path or datetime in user metadata should not sink an export that passed.
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        try:
            commit_folder(tmp, out_dir)
        except NotADirectoryError:
            raise ExportError(f"{out_dir} exists and is not a folder; remove it or choose another out_dir.") from None
    return SafetensorsExport(dir=str(out_dir), max_abs_diff=diff, files=files)


class LogitsOnly(nn.Module):
    """input_ids -> logits: one tensor in, one out, no cache objects for the exporter to trace."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _fp32_cpu(model: nn.Module) -> nn.Module:
    """The model itself if already fp32 on CPU, else an fp32 CPU copy (the caller's model is left alone).

    onnxruntime's CPU provider lacks bf16/fp16 kernels for much of a transformer, and parity is
    judged against fp32 PyTorch logits on the same device as onnxruntime.
    """
    params = list(model.parameters()) + list(model.buffers())
    if all(p.device.type == "cpu" and (p.dtype == torch.float32 or not p.is_floating_point())
           for p in params):
        return model
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float32)


def _parity(path: Path, model: nn.Module, shapes) -> list[ShapeParity]:
    import onnxruntime as ort

    wrapper = LogitsOnly(_fp32_cpu(model)).eval()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    vocab = _vocab_size(model)
    out = []
    for i, (batch, seq) in enumerate(shapes):
        ids = sample_ids(vocab, batch, seq, seed=1000 + i)
        with torch.no_grad():
            ref = wrapper(ids).float().numpy()
        got = session.run(["logits"], {"input_ids": ids.numpy()})[0]
        if got.shape != ref.shape:
            raise ExportError(f"ONNX model {path} returned logits shaped {got.shape}, expected {ref.shape}.")
        out.append(shape_parity(ref, got))
    return out


def verify_onnx(path: str | Path, model: nn.Module, shapes=DEFAULT_SHAPES,
                criteria: ParityCriteria = ParityCriteria()) -> list[ShapeParity]:  # noqa: B008 - frozen
    """Parity of onnxruntime vs PyTorch fp32 logits at `shapes` ((batch, seq) pairs); ExportError if not met."""
    return _verify(Path(path), model, shapes, criteria, label=str(path))


def _verify(path: Path, model: nn.Module, shapes, criteria: ParityCriteria, label: str) -> list[ShapeParity]:
    # `label` names the file the user knows about, not the temporary one being checked.
    figures = _parity(path, model, [tuple(s) for s in shapes])
    failure = parity_failure(label, figures, criteria)
    if failure:
        raise ExportError(failure)
    return figures


def _save_checked(program, staged: Path, external: bool, out_path: Path) -> int:
    """Save `program` at `staged`, check it with onnx.checker; returns its opset."""
    import onnx

    program.save(staged, external_data=external)
    try:
        onnx.checker.check_model(str(staged))  # by path, so external data is found and > 2 GB is allowed
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the exported ONNX model for {out_path} fails onnx.checker: {e}") from e
    proto = onnx.load(str(staged), load_external_data=False)
    return int(next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")))


def export_onnx(
    model,
    out_path: str | Path,
    *,
    criteria: ParityCriteria = ParityCriteria(),  # noqa: B008 - frozen dataclass
    opset: int | None = None,
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
    metadata: dict | None = None,
) -> OnnxExport:
    """Export input_ids -> logits (dynamic batch and sequence), check with onnx + onnxruntime, move in place.

    The model is prepared for inference in place; the export itself runs on an fp32 CPU copy if
    the model is not fp32 on CPU. On any failure nothing is left at `out_path` (an older file stays).
    A graph exported before for the same architecture comes from the ONNX graph cache (onnx_cache.py)
    and is verified the same way; if it does not fit or fails verification, a full export is done.
    """
    out_path = Path(out_path).absolute()
    shapes = [(int(b), int(s)) for b, s in shapes]
    if not shapes or any(b < 1 or s < 1 for b, s in shapes):
        raise ExportError(f"ONNX verification shapes must be (batch, seq) pairs >= 1, got {shapes}.")
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None) or EXAMPLE_SHAPE[1]
    example_shape = (EXAMPLE_SHAPE[0], max(2, min(EXAMPLE_SHAPE[1], max_pos)))
    if not any(b != example_shape[0] and s != example_shape[1] for b, s in shapes):
        raise ExportError(
            f"ONNX verification shapes {shapes} must include one whose batch and sequence both differ from "
            f"the export example {example_shape}, to prove the axes are dynamic; add e.g. (3, 5)."
        )
    _ready_to_write(model, out_path.parent, "ONNX export")
    src = _fp32_cpu(model)
    with experts.for_export(src):
        return _export_onnx(model, src, out_path, criteria, opset, shapes, metadata, example_shape)


def _export_onnx(model, src, out_path: Path, criteria: ParityCriteria, opset: int | None, shapes, metadata,
                 example_shape: tuple[int, int]) -> OnnxExport:
    external = sum(p.numel() * 4 for p in src.parameters()) > EXTERNAL_DATA_BYTES

    # A temporary folder beside out_path, holding the file under its final name: external data is
    # referenced by file name from inside the .onnx, so the name must not change when it is moved.
    data_name = out_path.name + ".data"
    with _staging(out_path, "ONNX export") as tmp:
        tmp.mkdir()
        example = sample_ids(_vocab_size(src), *example_shape, seed=0)
        wrapper = LogitsOnly(src).eval()
        label = f"{type(model).__name__} -> {out_path}"
        staged = tmp / out_path.name
        checked_as = f"{out_path} (not written)"
        program, source = onnx_cache.build(wrapper, src, example, opset, label)
        try:
            opset_found = _save_checked(program, staged, external, out_path)
            per_shape = _verify(staged, src, shapes, criteria, label=checked_as)
        except ExportError as e:
            if source != "cache":
                raise
            # A cache must never change what a user gets: redo it the long way, which also rewrites the entry.
            log.warning("the ONNX graph from the cache failed its checks (%s); doing a full export",
                        str(e).splitlines()[0])
            program, source = onnx_cache.build(wrapper, src, example, opset, label, use_cache=False)
            opset_found = _save_checked(program, staged, external, out_path)
            per_shape = _verify(staged, src, shapes, criteria, label=checked_as)
        del program
        diff = max(p.max_abs_diff for p in per_shape)
        digest = sha256_file(staged)
        has_data = (tmp / data_name).exists()
        files = {out_path.name: {"bytes": staged.stat().st_size, "sha256": digest}}
        if has_data:
            files[data_name] = file_record(tmp / data_name)
        meta_doc = {
            "memfit_version": memfit.__version__,
            "format": "onnx",
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "opset": int(opset_found),
            "inputs": ["input_ids"], "outputs": ["logits"], "dynamic_axes": ["batch", "sequence"],
            "max_abs_diff": diff,
            "parity_criteria": asdict(criteria),
            "parity": [p.to_dict() for p in per_shape],
            "external_data": has_data,
            "graph_source": source,
            "metadata": metadata or {},
            "files": files,
        }
        meta_path = out_path.parent / (out_path.name + ONNX_METADATA_SUFFIX)
        fsync_tree(tmp)
        # Weights first, graph last: the .onnx appearing is the signal that the export is complete.
        if has_data:
            os.replace(tmp / data_name, out_path.parent / data_name)
        os.replace(staged, out_path)
        if not has_data:
            # A replaced export's external weights would otherwise sit there looking current.
            (out_path.parent / data_name).unlink(missing_ok=True)
        # The metadata last, like a manifest: its checksums describe the files now in place.
        staged_meta = tmp / meta_path.name
        staged_meta.write_text(json.dumps(meta_doc, indent=2, default=str) + "\n")
        os.replace(staged_meta, meta_path)
    return OnnxExport(
        path=str(out_path),
        opset=int(opset_found),
        max_abs_diff=diff,
        shapes=shapes,
        external_data=has_data,
        sha256=digest,
        per_shape=per_shape,
        metadata_path=str(meta_path),
        criteria=criteria,
        graph_source=source,
    )
