"""The export flow: a training checkpoint (local or S3) → verified SafeTensors, ONNX, GGUF, optionally uploaded."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from tasks.export_checkpoint import export_checkpoint_task


@flow(name="memfit-export", log_prints=True, validate_parameters=True)
def export(checkpoint_uri: str, out_dir: str, onnx: bool = True, upload_uri: str | None = None,
           gguf_quants: list[Literal["f16", "q8_0", "q4_k_m"]] | None = None) -> dict[str, Any]:
    """Export a training checkpoint: a `…/step-NNNNNNNN` folder, or a checkpoint root (its newest verified one).

    The model and tokenizer come from the checkpoint's own config.yaml; both exports are verified
    (SafeTensors reloaded, ONNX compared with onnxruntime at several shapes) before they are moved in place.
    `gguf_quants` (e.g. ["q8_0"]) also writes GGUF files checked by llama.cpp, and an Ollama Modelfile.
    """
    return export_checkpoint_task(checkpoint_uri, out_dir, onnx, upload_uri, gguf_quants)
