"""A served model: tokenizer + backend + limits, loaded from verified files and checked before it takes requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.errors import ModelLoadError
from memfit.server.backends import SMOKE_PROMPT, OnnxBackend, Sampling, TransformersBackend, onnx_criteria
from memfit.server.protocol import Limits
from memfit.server.sources import ModelFiles

log = logging.getLogger("memfit.server")
PARITY_SHAPE = (2, 8)
SMOKE_TOKENS = 4


@dataclass
class ServedModel:
    files: ModelFiles
    tokenizer: Any
    backend: Any
    limits: Limits
    eos_id: int | None

    @property
    def model_id(self) -> str:
        return self.files.model_id

    @property
    def names(self) -> set[str]:
        """Model names a request may carry: the name, the id with its version, the MODEL it was started with."""
        return {self.files.name, self.files.model_id}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def piece(self, token: int) -> str:
        """One token's text, as logprobs name it."""
        return self.tokenizer.decode([token])

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def choose_backend(setting: str, device: str, files: ModelFiles) -> str:
    """Pure: serve.backend → the backend that serves `files`.

    auto is onnx on CPU when the export has an ONNX file: end to end (bench/serve_bench.py, docs/serving.md) the
    tiny champion served 1.2-2x the tokens/s through onnxruntime at 1-8 clients; transformers otherwise (CUDA, or
    no ONNX export).
    """
    if setting == "llama.cpp":
        if files.gguf_dir is None:
            raise ModelLoadError(f"serve.backend=llama.cpp but {files.model_id} has no GGUF export (gguf/); export it "
                                 "(memfit export ... --format gguf, or gguf in export.formats)")
        return "llama.cpp"
    if setting == "onnx":
        if files.onnx_path is None:
            raise ModelLoadError(f"serve.backend=onnx but {files.model_id} has no ONNX export (model.onnx); "
                                 "export it (memfit export ... --onnx) or use serve.backend=transformers")
        return "onnx"
    if setting == "transformers" or files.onnx_path is None:
        return "transformers"
    return "onnx" if device == "cpu" or (device == "auto" and not _cuda()) else "transformers"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load(files: ModelFiles, serve_cfg: Any) -> ServedModel:
    """Tokenizer and backend from `files`, then the checks: ONNX parity within its recorded limits, a smoke run."""
    from transformers import AutoTokenizer

    from memfit.models.loading import model_max_positions

    try:
        tok = AutoTokenizer.from_pretrained(files.hf_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of {files.model_id}: {str(err).splitlines()[0]}") from None
    kind = choose_backend(serve_cfg.backend, serve_cfg.device, files)
    context = model_max_positions(backend_config(files))
    if kind == "llama.cpp":  # checked against transformers at export (gguf_export.py); here: its checksums
        from memfit.server.backends import LlamaCppBackend

        backend: Any = LlamaCppBackend(gguf_file(files, serve_cfg.gguf_quant), context)
    else:
        hf = TransformersBackend(files.hf_dir, tok, "cpu" if kind == "onnx" else serve_cfg.device)
        backend = hf
    if kind == "onnx":
        backend = OnnxBackend(files.onnx_path)
        check_parity(files, hf, backend)
        del hf
    limits = Limits(context=context, max_tokens=serve_cfg.max_tokens, default_max_tokens=serve_cfg.default_max_tokens)
    served = ServedModel(files, tok, backend, limits, tok.eos_token_id)
    smoke(served)
    log.info("loaded %s (%s backend, context %s tokens)", files.model_id, backend.name, limits.context)
    return served


def gguf_file(files: ModelFiles, quant: str) -> Any:
    """The export's model-QUANT.gguf, after every file of the GGUF folder matched its sha256."""
    import json

    from memfit.files import sha256_file
    from memfit.release.gguf_export import MANIFEST_NAME

    folder = files.gguf_dir
    records = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    if f"model-{quant}.gguf" not in records:
        raise ModelLoadError(f"{files.model_id}: no model-{quant}.gguf in {folder} (it has "
                             f"{', '.join(n for n in records if n.endswith('.gguf'))}); set serve.gguf_quant")
    for name, meta in records.items():
        if sha256_file(folder / name) != meta["sha256"]:
            raise ModelLoadError(f"{folder / name} does not match the sha256 in {MANIFEST_NAME}: the GGUF export is "
                                 "incomplete or altered")
    return folder / f"model-{quant}.gguf"


def backend_config(files: ModelFiles) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(files.hf_dir, local_files_only=True)


def check_parity(files: ModelFiles, hf: TransformersBackend, onnx: OnnxBackend) -> None:
    """onnxruntime vs PyTorch logits on a sample batch, judged by the limits the export recorded."""
    from memfit.release.parity import ParityCriteria, parity_failure, shape_parity

    vocab = int(hf.config.vocab_size)
    ids = np.random.default_rng(0).integers(0, vocab, size=PARITY_SHAPE)
    figures = shape_parity(hf.logits(ids), onnx.logits(ids))
    criteria = onnx_criteria(files.onnx_path) or ParityCriteria()
    problem = parity_failure(f"{files.model_id} at load", [figures], criteria)
    if problem:
        raise ModelLoadError(problem)


def smoke(served: ServedModel) -> None:
    """A few greedy tokens through the real path; finite logits and valid token ids, or ModelLoadError."""
    ids = served.encode(SMOKE_PROMPT) or [0]
    logits = served.backend.logits(np.array([ids]))
    if not np.isfinite(logits).all():
        raise ModelLoadError(f"{served.model_id}: the smoke check's logits are not finite (NaN/inf weights)")
    got: list[int] = []
    served.backend.generate([ids], SMOKE_TOKENS, Sampling(), lambda step: got.extend(step),
                            lambda: [len(got) >= SMOKE_TOKENS])
    vocab = logits.shape[-1]
    if not got or any(not 0 <= t < vocab for t in got):
        raise ModelLoadError(f"{served.model_id}: the smoke generation produced {got!r}, not tokens of the model")
